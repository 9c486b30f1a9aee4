"""Fast torch replacements for megatron-core's apex / TransformerEngine fallbacks.

[Note: megatron fallbacks]
Without apex or TransformerEngine, megatron-core 0.16 falls back to helpers in
``megatron.core.utils`` that were written for correctness, not speed, and an optimizer that
is torch's multi-kernel ``foreach`` Adam:

* ``local_multi_tensor_l2_norm`` (gradient clipping) computes one ``torch.norm`` per tensor,
  then builds ``torch.tensor(list_of_cuda_scalars)``: one host synchronization per gradient
  tensor, every step, and two more for the total;
* ``local_multi_tensor_scale`` (clipping, and megatron's fp32 -> bf16 parameter copies) runs
  ``dst.copy_(src * scale)`` per tensor: a temporary and two kernels each;
* torch's ``Adam`` / ``AdamW`` with default arguments runs its ``foreach`` implementation,
  several passes over the fp32 states per step.

``etp.megatron.patches.use_fast_fallbacks(True)`` swaps the two helpers in the modules that bound them (``clip_grads`` and
``optimizer``) for ``torch._foreach`` versions with no host synchronization and one kernel
family each, and ``fuse_adam(optimizer)`` switches torch's Adam inside megatron's optimizer to
its fused CUDA kernel (``fused=True``: one pass over params, grads and both moments). Both do
nothing when apex or TransformerEngine provide the real kernels. Numerics: the l2 norm is
the same sum of squares (fp32, different summation order); the scale is the same product.
``tests/megatron/test_megatron_fallbacks.py`` compares each against megatron's own helper.

Example::

    from etp.megatron import fast_fallbacks, patches
    patches.use_fast_fallbacks(True)               # before building the optimizer
    optimizer = get_megatron_optimizer(config, [ddp_model])
    fast_fallbacks.fuse_adam(optimizer)
"""
from __future__ import annotations

import logging

import torch

__all__ = ["foreach_l2_norm", "foreach_scale", "fuse_adam", "inner_optimizers"]

log = logging.getLogger(__name__)

def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm`` / megatron's local version: ``([norm], None)``
    with the l2 norm of every tensor in ``tensor_lists[0]`` (fp32, or 16-bit widened to fp32)
    as a 1-element fp32 tensor on the tensors' device, without a host synchronization."""
    tensors = [t for t in tensor_lists[0] if t.numel()]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device="cuda" if torch.cuda.is_available() else "cpu"), None
    if all(t.dtype == torch.float32 for t in tensors):
        norms = torch._foreach_norm(tensors, 2.0)
    else:  # bf16 gradients read in place (etp.megatron.fused_adamw): each norm summed in fp32
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
    return total.reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * scale`` for the pairs of
    ``tensor_lists[0]`` / ``[1]`` (dtypes may differ: the product is cast into ``dst``)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if len(src) != len(dst):
        raise ValueError(f"foreach_scale: {len(src)} sources but {len(dst)} destinations")
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif isinstance(scale, (int, float)) and scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def inner_optimizers(optimizer) -> list:
    """The optimizers a megatron-core ``ChainedOptimizer`` holds (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _torch_adams(optimizer) -> list:
    """torch ``Adam`` / ``AdamW`` instances inside a megatron optimizer (chained or not)."""
    found, stack = [], [optimizer]
    while stack:
        opt = stack.pop()
        if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            found.append(opt)
            continue
        chained = getattr(opt, "chained_optimizers", None)
        if chained is not None:  # megatron's ChainedOptimizer: its .optimizer asserts one link
            stack += list(chained)
            continue
        inner = getattr(opt, "optimizer", None)
        if inner is not None and inner is not opt:
            stack.append(inner)
    return found


def fuse_adam(optimizer) -> int:
    """Switches every torch ``Adam`` / ``AdamW`` inside ``optimizer`` (a megatron-core
    optimizer, chained or not, or a torch one) to ``fused=True`` where all its params are
    floating-point CUDA tensors. Returns the number of param groups switched (0 with apex /
    TransformerEngine, whose fused Adam megatron already uses)."""
    switched = 0
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            params = group["params"]
            if not params or not all(p.is_cuda and p.is_floating_point() for p in params):
                continue
            if group.get("differentiable"):
                continue  # torch has no fused differentiable Adam
            group["fused"], group["foreach"] = True, False
            switched += 1
        if switched:
            adam.defaults["fused"], adam.defaults["foreach"] = True, False
    return switched
