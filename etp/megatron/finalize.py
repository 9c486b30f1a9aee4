"""finalize_model_grads for ETP-wrapped megatron-core models (drop-in for megatron-core's).

Order matters (see [Note: ETP under megatron-core DDP]): first every pending ETP
reduce-scatter lands in ``main_grad`` and fires DDP's grad-ready (so no bucket is reduced
without its ETP gradients), then megatron-core finishes its reductions over the replicate
groups (and the TP / embedding / per-token steps), and last the replicated params'
gradients are summed over the ETP groups. That last step must follow DDP's: with
``overlap_grad_reduce`` a bucket's reduction may already be running on the gradient buffer.
"""
from __future__ import annotations

import torch

from ..grads import finalize_grads
from ..wrap import _runtime_of

__all__ = ["finalize_model_grads"]


def finalize_model_grads(model, num_tokens: torch.Tensor | None = None, pg_collection=None,
                         force_all_reduce: bool = False) -> None:
    """megatron-core's ``finalize_model_grads`` plus the ETP steps; same signature, so
    Megatron-LM can use it as ``config.finalize_model_grads_func``. A collective.

    ``pg_collection`` is passed to megatron-core unchanged: leave it None so that the
    per-token loss count is summed over the full data-parallel group (ETP included).

    Example::

        losses = forward_backward_func(...)      # or loss.backward()
        finalize_model_grads([ddp_model])
        optimizer.step()
    """
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads as megatron_finalize

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    wrapped = [(chunk, runtime) for chunk in chunks if (runtime := _runtime_of(chunk)) is not None]
    for _, runtime in wrapped:
        runtime.drain()
    megatron_finalize(chunks, num_tokens=num_tokens, pg_collection=pg_collection,
                      force_all_reduce=force_all_reduce)
    for chunk, runtime in wrapped:
        finalize_grads(chunk, runtime.config, runtime.groups, replicate=False)
