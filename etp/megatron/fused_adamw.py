"""etp's fused AdamW (``etp.kernels.multi_tensor_adamw``) as the step of the torch AdamW inside
megatron-core's optimizer, with megatron's fp32 -> bf16 weight copy folded into the same pass.

[Note: etp AdamW step]
Without TransformerEngine or apex, megatron-core steps a torch ``AdamW`` (made ``fused`` by
``fast_fallbacks.fuse_adam``) over its fp32 master weights and then copies every master
into its bf16 model weight (``_copy_main_params_to_model_params``): two passes over the
state, both bound by memory bandwidth ([Note: fused AdamW] says what each moves).
``install(optimizer)`` replaces, per link of the (chained) optimizer:

* the torch AdamW's ``step`` by one ``multi_tensor_adamw`` launch per param group, which also
  writes the bf16 model weight of every master of a mixed-precision link; the clip's
  ``grad_scale`` ([Note: sync-free step]) is honoured as torch's fused AdamW honours it;
* that link's master -> model copy by nothing, for the step just taken only: every other
  caller (a checkpoint load, a reload) still copies.

The optimizer state stays torch's: ``state[p]`` holds ``step`` (a CPU float tensor, as torch's
default AdamW keeps it), ``exp_avg`` and ``exp_avg_sq``, so checkpoints load either way. A
``step`` that arrives on the GPU (from torch's fused AdamW, or a checkpoint of one) is moved to
the host once. Links this does not fit are left to torch, each with a one-line reason: L2
(coupled) weight decay, ``amsgrad``, ``maximize``, state other than float32.

[Note: bf16 gradients, read in place]
With a bf16 gradient buffer (megatron-core's DDP with ``grad_reduce_in_fp32=False``),
megatron's ``_copy_model_grads_to_main_grads`` gives every fp32 master a fp32 copy of its
bf16 gradient (``main_grad.float()``): 4 bytes per parameter allocated at every step, on top
of the buffer. The kernel reads bf16 gradients itself, exactly ([Note: fused AdamW]), so
``read_grads_in_place`` replaces that copy, for a link whose every 16-bit parameter has a bf16
``main_grad``, by a map from each master to its model parameter's ``main_grad``
(``link._etp_grads``): ``step`` and ``grads_for_norm`` read the gradients there, and the masters'
``.grad`` stays None. The norm's filter is megatron's ``param_is_not_shared``; a link whose
gradient statistics span more than one rank (where megatron also drops tensor-parallel
duplicates) keeps megatron's copy.

Where nothing is reduced or accumulated (one rank, one micro-batch) the bf16 buffer holds
exactly the values the fp32 one would: each gradient is one bf16 tensor added into zeros. So
etp-train keeps that buffer bf16 there (``Recipe.main_grad_bytes``): the same step, 2 bytes per
parameter less than the fp32 buffer (16 in all with the bf16 weight, fp32 master and moments).

Example::

    optimizer = get_megatron_optimizer(config, [ddp_model])
    fast_fallbacks.fuse_adam(optimizer)
    patches.step_with_fused_adamw(optimizer)      # etp.megatron.patches
"""
from __future__ import annotations

import functools

import torch

from etp.kernels.adam import multi_tensor_adamw

__all__ = ["copy_unless_written", "grads_for_norm", "model_weights", "read_grads_in_place", "step",
           "unsupported_reason"]


def unsupported_reason(adam) -> str | None:
    """Why etp's AdamW cannot step this torch optimizer, or None when it can."""
    if not isinstance(adam, (torch.optim.Adam, torch.optim.AdamW)):
        return f"{type(adam).__name__} is not torch's Adam / AdamW"
    decoupled = isinstance(adam, torch.optim.AdamW)
    for group in adam.param_groups:
        for key in ("amsgrad", "maximize", "differentiable"):
            if group.get(key):
                return f"{key}=True"
        if group["weight_decay"] and not (decoupled or group.get("decoupled_weight_decay")):
            return "L2 (coupled) weight decay: the kernel decays the weight itself, as AdamW does"
        for p in group["params"]:
            if p.dtype != torch.float32:
                return f"a {p.dtype} parameter (the kernel steps float32 masters)"
    return None


def model_weights(link) -> dict:
    """id(master) -> the bf16 model weight megatron copies it into, for a mixed-precision link
    whose every copy the kernel can write (else empty: megatron copies)."""
    models, mains = getattr(link, "float16_groups", None), getattr(link, "fp32_from_float16_groups", None)
    if models is None or mains is None:
        return {}
    pairs = {id(main): model.data for mg, ng in zip(models, mains) for model, main in zip(mg, ng)}
    fits = all(w.dtype == torch.bfloat16 and w.is_contiguous() for w in pairs.values())
    return pairs if fits else {}


def _host_step(state: dict) -> torch.Tensor:
    step = state["step"]
    if step.device.type != "cpu":  # torch's fused AdamW keeps it on the GPU: read once, then host-side
        step = state["step"] = step.detach().to("cpu", torch.float32)
    return step


def _grad(link, p):
    """The gradient ``p`` (a master) steps from: its model parameter's bf16 ``main_grad`` when
    the link reads them in place, else ``p.grad``."""
    grads = getattr(link, "_etp_grads", None)
    return grads.get(id(p), p.grad) if grads else p.grad


def _bf16_main_grads(link) -> dict | None:
    """id(master) -> its model parameter's ``main_grad``, when every 16-bit parameter of the link
    has a contiguous bf16 one; else None (megatron copies)."""
    models, mains = getattr(link, "float16_groups", None), getattr(link, "fp32_from_float16_groups", None)
    if not models or mains is None:
        return None
    grads = {}
    for model_group, main_group in zip(models, mains):
        for model, main in zip(model_group, main_group):
            g = getattr(model, "main_grad", None)
            if g is None or g.dtype != torch.bfloat16 or not g.is_contiguous():
                return None
            grads[id(main)] = g
    return grads


def read_grads_in_place(link, copy):
    """``link._copy_model_grads_to_main_grads`` without its fp32 copies where the gradients are
    bf16 ([Note: bf16 gradients, read in place]); ``copy`` (megatron's) otherwise."""
    @functools.wraps(copy)
    def copy_model_grads_to_main_grads(*args, **kwargs):
        link._etp_grads = _bf16_main_grads(link)
        if link._etp_grads is None:
            return copy(*args, **kwargs)
        for model_group in link.float16_groups:
            for model in model_group:
                model.grad = None  # as megatron's copy leaves it: main_grad holds the gradient
        for model_group in link.fp32_from_fp32_groups:  # megatron's own second half, unchanged
            for model in model_group:
                model.grad = model.main_grad
        return None
    return copy_model_grads_to_main_grads


def grads_for_norm(link) -> list | None:
    """The gradients the clipping norm counts for a link that reads them in place (megatron's
    ``get_main_grads_for_grad_norm`` over the same parameters, in the same order); None for a
    link that does not (megatron's own list applies)."""
    if not getattr(link, "_etp_grads", None):
        return None
    from megatron.core.transformer.module import param_is_not_shared

    return [g for p in link.get_parameters() if (g := _grad(link, p)) is not None and param_is_not_shared(p)]


@torch.no_grad()
def step(adam, closure=None, *, weights: dict, link):
    """One AdamW step of every param with a gradient, one kernel launch per (group, step count,
    gradient dtype, whether it writes a bf16 model weight)."""
    if closure is not None:
        raise ValueError("etp's AdamW step takes no closure (megatron-core passes none)")
    scale = getattr(adam, "grad_scale", None)
    written = 0
    for group in adam.param_groups:
        beta1, beta2 = group["betas"]
        by_step: dict[tuple, list] = {}
        for p in group["params"]:
            grad = _grad(link, p)
            if grad is None:
                continue
            state = adam.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step = _host_step(state)
            step += 1
            # A group may mix masters of bf16 weights with fp32 parameters (megatron's fp32 links).
            by_step.setdefault((int(step.item()), grad.dtype, id(p) in weights), []).append((p, grad))
        for (count, _, writes), pairs in by_step.items():
            params = [p for p, _ in pairs]
            out = [weights[id(p)] for p in params] if writes else None
            multi_tensor_adamw(params, [g for _, g in pairs], [adam.state[p]["exp_avg"] for p in params],
                               [adam.state[p]["exp_avg_sq"] for p in params], lr=float(group["lr"]), beta1=beta1,
                               beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=count,
                               grad_scale=scale, out=out)
            written += len(params) if out is not None else 0
    # Only a step that wrote every model weight this link copies may skip the copy.
    link._etp_weights_written = bool(weights) and written == len(weights)


def copy_unless_written(link, copy):
    @functools.wraps(copy)
    def copy_main_params_to_model_params(*args, **kwargs):
        if getattr(link, "_etp_weights_written", False):
            link._etp_weights_written = False  # the step wrote them; the next caller copies again
            return None
        return copy(*args, **kwargs)
    return copy_main_params_to_model_params
