"""megatron-core's optimizer step without a host synchronization.

[Note: sync-free step]
megatron-core 0.16's ``optimizer.step()`` clips through ``get_grad_norm_fp32``, which ends in
``total_norm.item()``, and ``clip_grad_by_total_norm_fp32`` then branches on the Python float.
The host therefore waits, every step, for the whole backward and the gradient reductions to
finish before it issues Adam; and etp-train waited once more for the loss. Each wait empties
the device's queue: the next forward starts with the device idle while the host issues it,
and on a large recipe these waits are a visible share of every iteration.

``step(optimizer)`` is the same step with every decision on the device:

* the norm: per link of the (chained) optimizer, the sum of squares of the gradients megatron
  counts (``etp.megatron.compat.grads_for_norm``: ``shared`` duplicates left out; bf16 ones
  where etp's AdamW reads them in place, ``etp.megatron.fused_adamw.grads_for_norm``), all-reduced over that link's ``get_grad_stats_parallel_group()``, summed over
  the links and square-rooted: a device tensor;
* the clip coefficient ``min(1, clip_grad / (norm + 1e-6))``, megatron's formula, also a
  device tensor. Where the link's torch Adam runs fused it is handed to the kernel as
  ``grad_scale`` (= 1 / coefficient, the divisor torch's ``GradScaler`` uses): no pass of its
  own over the fp32 gradients. Otherwise one ``torch._foreach_mul_`` scales them (megatron's
  clip does that same pass whenever it clips);
* the step itself: megatron's ``prepare_grads`` and ``step_with_ready_grads``, unchanged.

Multiplying by a coefficient of exactly 1 changes nothing, so a step that does not clip is
megatron's; one that clips differs by the rounding of a divide against a multiply.

Not covered (``etp.megatron.patches.step_without_host_sync`` leaves megatron's step and says why, once): fp16 loss scaling (its
inf check is the host's decision to skip a step), ``log_num_zeros_in_grad`` (a host count) and
megatron-core 0.19's separate grad-norm groups (multi-token prediction's parameters, normed and
clipped on their own).

Example::

    optimizer = get_megatron_optimizer(config, [ddp_model])
    patches.step_without_host_sync(optimizer)  # optimizer.step() now returns the norm as a tensor
    ok, grad_norm, _ = optimizer.step()     # grad_norm: a 1-element device tensor
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from etp.megatron import fused_adamw
from etp.megatron.compat import grads_for_norm, separate_grad_norm_groups
from etp.megatron.fast_fallbacks import (  # foreach_l2_norm: the norm megatron's clipping runs on
    foreach_l2_norm,
    inner_optimizers,
)

__all__ = ["clip_coefficient", "grad_norm", "step", "unsupported_reason"]

_EPS = 1.0e-6  # megatron-core's clip_grad_by_total_norm_fp32


def unsupported_reason(optimizer) -> str | None:
    """Why ``step`` cannot replace this optimizer's step, or None when it can."""
    for link in inner_optimizers(optimizer):
        if getattr(link, "grad_scaler", None) is not None:
            return "fp16 loss scaling (its inf check decides on the host whether to step)"
        if getattr(link.config, "log_num_zeros_in_grad", False):
            return "log_num_zeros_in_grad (a count the host reads)"
        if groups := separate_grad_norm_groups(link):
            return f"separate grad-norm groups {sorted(groups)} (megatron-core norms and clips them on their own)"
    return None


def grad_norm(optimizer) -> torch.Tensor:
    """The global l2 norm of the gradients megatron-core's clipping counts, as a 1-element
    fp32 device tensor (no host synchronization). A collective over every link's statistics
    group: every rank calls it."""
    squares = []
    for link in inner_optimizers(optimizer):
        grads = fused_adamw.grads_for_norm(link)
        norm, _ = foreach_l2_norm(0, None, [grads_for_norm(link) if grads is None else grads], False)
        square = norm.square()
        dist.all_reduce(square, group=link.get_grad_stats_parallel_group())
        squares.append(square)
    return torch.stack(squares).sum(0).sqrt()


def clip_coefficient(norm: torch.Tensor, clip_grad: float) -> torch.Tensor:
    """megatron-core's ``min(1, clip_grad / (norm + 1e-6))`` on the device."""
    return (clip_grad / (norm + _EPS)).clamp(max=1.0)


def _fused_torch_adam(link):
    """The link's torch Adam / AdamW when every param group runs torch's fused kernel or etp's
    (both honour ``grad_scale``), else None."""
    inner = getattr(link, "optimizer", None)
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    if getattr(inner, "etp_fused_step", False):  # etp's AdamW step ([Note: etp AdamW step])
        return inner
    return inner if all(group.get("fused") for group in inner.param_groups) else None


def _clip(link, coefficient: torch.Tensor) -> None:
    adam = _fused_torch_adam(link)
    if adam is not None:
        adam.grad_scale = coefficient.reciprocal()  # the fused kernel divides every grad by it
        return
    use_decoupled = getattr(link.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
    grads = []
    for p in link.get_parameters():
        g = getattr(p, "decoupled_grad", None) if use_decoupled else p.grad
        if g is not None:
            grads.append(g)
    if grads:
        torch._foreach_mul_(grads, coefficient.reshape(()))  # the Tensor overload takes a 0-dim scalar


@torch.no_grad()
def step(optimizer):
    """megatron-core's ``optimizer.step()`` (``(ok, grad_norm, num_zeros)``) with the norm,
    the clip and the update all on the device: ``grad_norm`` is a 1-element tensor (None
    when ``clip_grad`` is 0, as megatron's), ``num_zeros`` is None."""
    if optimizer.prepare_grads():  # bf16 / fp32: a Python False, no synchronization
        return False, None, None
    links = inner_optimizers(optimizer)
    clipping = [link for link in links if link.config.clip_grad > 0.0]
    norm = None
    if clipping:
        norm = grad_norm(optimizer)
        for link in clipping:
            if not getattr(link, "is_stub_optimizer", False) and link.get_parameters():
                _clip(link, clip_coefficient(norm, link.config.clip_grad))
    ok = optimizer.step_with_ready_grads()
    return ok, norm, None
