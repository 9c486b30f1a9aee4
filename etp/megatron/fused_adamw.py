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

Example::

    optimizer = get_megatron_optimizer(config, [ddp_model])
    fast_fallbacks.fuse_adam(optimizer)
    patches.step_with_fused_adamw(optimizer)      # etp.megatron.patches
"""
from __future__ import annotations

import functools

import torch

from etp.kernels.adam import multi_tensor_adamw

__all__ = ["copy_unless_written", "model_weights", "step", "unsupported_reason"]


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


@torch.no_grad()
def step(adam, closure=None, *, weights: dict, link):
    """One AdamW step of every param with a gradient, one kernel launch per (group, step count)."""
    if closure is not None:
        raise ValueError("etp's AdamW step takes no closure (megatron-core passes none)")
    scale = getattr(adam, "grad_scale", None)
    written = 0
    for group in adam.param_groups:
        beta1, beta2 = group["betas"]
        by_step: dict[int, list] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = adam.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step = _host_step(state)
            step += 1
            by_step.setdefault(int(step.item()), []).append(p)
        for count, params in by_step.items():
            out = [weights[id(p)] for p in params] if weights else None
            multi_tensor_adamw(params, [p.grad for p in params], [adam.state[p]["exp_avg"] for p in params],
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
