"""finalize_grads: finish ETP's pending reduce-scatters and complete the other gradients.

ETP peers see different data, so every *replicated* parameter (biases, norms, routers,
embeddings) has a partial gradient on each peer: it is all-reduced over the ETP group with
the same mean / sum as the sharded weights. Optionally (``replicate=True``, for training
without megatron-core DDP) every gradient, shards included, is then all-reduced over the
replicate group too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

from .collectives import all_reduce_coalesced
from .config import ETPConfig
from .groups import ETPGroups
from .param import ETPShardedParam
from .wrap import is_expert_param

__all__ = ["finalize_grads", "global_grad_norm", "clip_grad_norm_"]


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _ep_size(ep_group) -> int:
    return dist.get_world_size(ep_group) if ep_group is not None else 1


def finalize_grads(
    model: nn.Module, config: ETPConfig, groups: ETPGroups, replicate: bool = True, ep_group=None
) -> None:
    """Completes gradients after backward, before the optimizer step (a collective: every
    rank calls it). Parameters without a gradient on every rank are skipped.

    Args:
        model: the wrapped model.
        config: its ETP settings (``reduction`` picks mean or sum).
        groups: its ETP groups.
        replicate: also reduce every gradient over the replicate groups (the data-parallel
            axis); leave False when megatron-core DDP does that reduction.
        ep_group: the expert-parallel group, when the experts are split over one. An expert's
            gradient then already sums the tokens of its EP peers' batches: with ``mean``, the
            mean over the expert's own ranks is divided by the EP size too, so that every
            gradient is the mean over all data-parallel ranks.

    Example::

        loss.backward()
        finalize_grads(model, config, groups)
        optimizer.step()
    """
    mean = config.reduction == "mean"
    for runtime in {id(p.etp_runtime): p.etp_runtime for p in model.parameters()
                    if isinstance(p, ETPShardedParam)}.values():
        runtime.drain()  # pending reduce-scatters land in main_grad / grad first
    dense_repl, expert_repl, shards = [], [], []
    for param in model.parameters():
        grad = _grad_of(param)
        if grad is None:
            continue
        if isinstance(param, ETPShardedParam):
            shards.append(param)
        elif is_expert_param(param):
            expert_repl.append(grad)
        else:
            dense_repl.append(grad)
    with record_function("etp::finalize"):
        all_reduce_coalesced(dense_repl, groups.dense.ag_group, mean)
        all_reduce_coalesced(expert_repl, groups.expert.ag_group, mean)
        if not replicate:
            return
        dense_all = dense_repl + [_grad_of(p) for p in shards if not is_expert_param(p)]
        expert_all = expert_repl + [_grad_of(p) for p in shards if is_expert_param(p)]
        all_reduce_coalesced(dense_all, groups.dense_replicate, mean)
        all_reduce_coalesced(expert_all, groups.expert_replicate, mean)
        if mean and _ep_size(ep_group) > 1:
            torch._foreach_div_(expert_all, float(_ep_size(ep_group)))


def _is_tp_split(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def global_grad_norm(model: nn.Module, groups: ETPGroups, tp_group=None, ep_group=None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, every logical element counted once.

    Call after ``finalize_grads`` (replicated gradients are then equal on every rank).
    ETP shards count their logical rows only (padding never) and are summed over their
    shard group; tensor-parallel pieces (``tensor_model_parallel`` attribute) are summed over
    ``tp_group`` as well; expert parameters over ``ep_group`` (each EP rank holds other
    experts); everything else counts once. A collective over those groups.

    Example::

        norm = global_grad_norm(model, groups)
    """
    device = next(model.parameters()).device
    # [dense shards, expert shards, dense TP-split shards, expert TP-split shards,
    #  replicated TP-split, replicated, replicated expert TP-split, replicated expert]
    sums = torch.zeros(8, dtype=torch.float64, device=device)
    for param in model.parameters():
        grad = _grad_of(param)
        if grad is None:
            continue
        tp = _is_tp_split(param)
        if isinstance(param, ETPShardedParam):
            square = grad[: param.etp_layout.valid_rows].double().pow(2).sum()
            slot = (2 if tp else 0) + (1 if is_expert_param(param) else 0)
        else:
            square = grad.double().pow(2).sum()
            slot = (6 if is_expert_param(param) else 4) + (0 if tp else 1)
        sums[slot] += square
    if _ep_size(ep_group) > 1:
        with record_function("etp::grad_norm_ep"):
            expert = sums[[1, 3, 6, 7]].clone()
            dist.all_reduce(expert, group=ep_group)
            sums[[1, 3, 6, 7]] = expert
    dense_group, expert_group = groups.dense.ag_group, groups.expert.ag_group
    if dense_group is expert_group:
        sums[0] += sums[1]; sums[1] = 0  # noqa: E702 - one group: one collective
        sums[2] += sums[3]; sums[3] = 0  # noqa: E702
    with record_function("etp::grad_norm"):
        if dense_group is not None:
            dense = sums[[0, 2]].clone()
            dist.all_reduce(dense, group=dense_group)
            sums[[0, 2]] = dense
        if expert_group is not None and expert_group is not dense_group:
            expert = sums[[1, 3]].clone()
            dist.all_reduce(expert, group=expert_group)
            sums[[1, 3]] = expert
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            split = sums[[2, 3, 4, 6]].clone()
            dist.all_reduce(split, group=tp_group)
            sums[[2, 3, 4, 6]] = split
    return sums.sum().sqrt()


def clip_grad_norm_(model: nn.Module, groups: ETPGroups, max_norm: float, tp_group=None,
                    ep_group=None) -> torch.Tensor:
    """Scales every gradient so that ``global_grad_norm`` is at most ``max_norm``; returns
    the norm before clipping.

    Example::

        finalize_grads(model, config, groups)
        clip_grad_norm_(model, groups, max_norm=1.0)
        optimizer.step()
    """
    norm = global_grad_norm(model, groups, tp_group, ep_group)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in model.parameters():
        grad = _grad_of(param)
        if grad is not None:
            grad.mul_(scale.to(grad.dtype))
    return norm
