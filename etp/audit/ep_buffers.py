"""The buffers of etp's expert-parallel dispatcher (recipe key ``moe_token_dispatcher_type:
etp``), per rank, from a recipe alone.

Every MoE layer gets its own ``etp.ep.ExpertDispatcher`` (``install_etp_dispatchers``), sized for
dropless routing: a receive capacity of ``C = EP x T x min(topk, experts per rank)`` rows, ``T``
the tokens of one micro-batch on a rank. The dispatcher holds its receive rows and their
gradient (``[C, h]`` each) and the routing weights (``[C]`` fp32); each of its backends (the
dispatch's and the combine's, which ``backend: auto`` chooses separately) a staging copy of the
same size and its own per-token tables: ``symm_push`` one row per (token, expert) pair it sends,
``symm_dedup`` / ``symm_allgather`` one row per (rank, token) slot (and the allgather a copy of
the rank's tokens). With the symmetric-memory backends all of it lives outside the caching
allocator; the ``nccl`` backends allocate the same rows from it. Counted here: the dispatcher's
rows and two backends of the larger kind, outside the allocator.
"""
from __future__ import annotations

from .activations import moe_layers_on_stage, value_bytes

__all__ = ["ep_dispatcher_bytes"]

_INDEX, _WEIGHT = 8, 4  # int64 row maps; fp32 routing weights


def ep_dispatcher_bytes(recipe, micro_batch_size: int | None = None) -> int:
    """Bytes of etp's expert-parallel dispatchers on one rank (first pipeline stage); 0 unless the
    recipe's dispatcher is ``etp``. See the module doc.

    Example::

        ep_dispatcher_bytes(recipe, micro_batch_size=1) / 2**30
    """
    m, p, t = recipe.model, recipe.parallel, recipe.train
    if not m.is_moe or m.moe_token_dispatcher_type != "etp":
        return 0
    ranks, topk, hidden = p.expert_model_parallel_size, m.moe_router_topk, m.hidden_size
    tokens = m.seq_length * (micro_batch_size or t.micro_batch_size)
    capacity = ranks * tokens * min(topk, m.num_experts // ranks)
    row = hidden * value_bytes(recipe)
    dispatcher = 2 * capacity * row + capacity * _WEIGHT
    stage = capacity * row + capacity * _WEIGHT
    push = tokens * topk * row + capacity * _INDEX + ranks * tokens * topk * _INDEX
    dedup = ranks * tokens * row + capacity * _INDEX + ranks * tokens * topk * _INDEX + tokens * row
    per_layer = dispatcher + 2 * (stage + max(push, dedup))
    return moe_layers_on_stage(recipe) * per_layer
