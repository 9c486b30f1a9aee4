"""Expert parallelism for JAX: move MoE tokens to the ranks holding their experts and back.

The counterpart of ``etp.ep`` (torch) for code running inside ``shard_map``; static
shapes, differentiable, no host round trip. See ``docs/jax.md``. Public API::

    from etp.jax import ep as jep
    cfg = jep.EPConfig(num_experts=8, topk=2, hidden_size=16, max_tokens_per_rank=32, axis_name="ep")
    # inside shard_map over a mesh with axis "ep":
    handle = jep.ep_prepare(cfg, topk_idx)                        # [T, K] int32
    recv_x, recv_w, tokens_per_expert = jep.ep_dispatch(cfg, x, topk_weights, handle)
    out = jep.ep_combine(cfg, expert_out, handle)                 # [T, H]
"""
from etp.jax.ep.checks import validate_topk_idx
from etp.jax.ep.compat import shard_map
from etp.jax.ep.config import EPConfig
from etp.jax.ep.moves import ep_combine, ep_dispatch
from etp.jax.ep.routing_layout import EPHandle, ep_prepare

__all__ = ["EPConfig", "EPHandle", "ep_combine", "ep_dispatch", "ep_prepare", "shard_map", "validate_topk_idx"]
