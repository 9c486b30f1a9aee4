"""finalize_grads: finish ETP's pending reduce-scatters and complete the other gradients.

ETP peers see different data, so every *replicated* parameter (biases, norms, routers,
embeddings) has a partial gradient on each peer: it is all-reduced over the ETP group with
the same mean / sum as the sharded weights. Optionally (``replicate=True``, for training
without megatron-core DDP) every gradient, shards included, is then all-reduced over the
replicate group too.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.autograd.profiler import record_function

from .collectives import all_reduce_coalesced
from .config import ETPConfig
from .groups import ETPGroups
from .param import ETPShardedParam
from .wrap import is_expert_param

__all__ = ["finalize_grads"]


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def finalize_grads(
    model: nn.Module, config: ETPConfig, groups: ETPGroups, replicate: bool = True
) -> None:
    """Completes gradients after backward, before the optimizer step (a collective: every
    rank calls it). Parameters without a gradient on every rank are skipped.

    Args:
        model: the wrapped model.
        config: its ETP settings (``reduction`` picks mean or sum).
        groups: its ETP groups.
        replicate: also reduce every gradient over the replicate groups (the data-parallel
            axis); leave False when megatron-core DDP does that reduction.

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
