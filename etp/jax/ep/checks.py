"""Trace-time checks of the arrays handed to the EP functions, and the eager index check.

Shapes and dtypes are static under ``jax.jit``, so they are checked while tracing and a
bad call raises ValueError before anything compiles. Expert ids are data: inside ``jit``
they cannot raise, see :func:`validate_topk_idx`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from etp.jax.ep.config import EPConfig

__all__ = ["check_combine", "check_dispatch", "check_prepare", "validate_topk_idx"]


def _shape(array) -> tuple:
    return tuple(getattr(array, "shape", ()))


def _dtype(array):
    return jnp.result_type(array)


def check_prepare(cfg: EPConfig, topk_idx) -> None:
    if not isinstance(cfg, EPConfig):
        raise ValueError(f"cfg={cfg!r}: expected an etp.jax.ep.EPConfig")
    shape = _shape(topk_idx)
    if len(shape) != 2 or shape[1] != cfg.topk:
        raise ValueError(f"topk_idx.shape={shape}: expected [T, topk={cfg.topk}] (this rank's tokens)")
    if not 1 <= shape[0] <= cfg.max_tokens_per_rank:
        raise ValueError(f"topk_idx has T={shape[0]} tokens: expected 1 <= T <= max_tokens_per_rank="
                         f"{cfg.max_tokens_per_rank}; raise EPConfig.max_tokens_per_rank")
    if not jnp.issubdtype(_dtype(topk_idx), jnp.integer):
        raise ValueError(f"topk_idx.dtype={_dtype(topk_idx)}: expected an integer dtype (int32 global expert "
                         "ids); cast with topk_idx.astype(jnp.int32)")


def check_dispatch(cfg: EPConfig, x, topk_weights, tokens: int) -> None:
    if _shape(x) != (tokens, cfg.hidden_size):
        raise ValueError(f"x.shape={_shape(x)}: expected [T={tokens}, hidden_size={cfg.hidden_size}], the T of "
                         "the topk_idx given to ep_prepare")
    if _dtype(x) != jnp.dtype(cfg.dtype):
        raise ValueError(f"x.dtype={_dtype(x)}: expected EPConfig.dtype={jnp.dtype(cfg.dtype)}; cast x or "
                         "change the config")
    if _shape(topk_weights) != (tokens, cfg.topk):
        raise ValueError(f"topk_weights.shape={_shape(topk_weights)}: expected [T={tokens}, topk={cfg.topk}]")
    if not jnp.issubdtype(_dtype(topk_weights), jnp.floating):
        raise ValueError(f"topk_weights.dtype={_dtype(topk_weights)}: expected a floating dtype (e.g. float32)")


def check_combine(cfg: EPConfig, expert_out, rows: int) -> None:
    if _shape(expert_out) != (rows, cfg.hidden_size):
        raise ValueError(f"expert_out.shape={_shape(expert_out)}: expected [C={rows}, hidden_size="
                         f"{cfg.hidden_size}], the shape of the recv_x ep_dispatch returned")
    if _dtype(expert_out) != jnp.dtype(cfg.dtype):
        raise ValueError(f"expert_out.dtype={_dtype(expert_out)}: expected EPConfig.dtype="
                         f"{jnp.dtype(cfg.dtype)}; cast the expert output")


def is_concrete(array) -> bool:
    """Whether ``array`` holds values now (not a tracer under jit / shard_map)."""
    return not isinstance(array, jax.core.Tracer)


def validate_topk_idx(cfg: EPConfig, topk_idx) -> None:
    """Raises ValueError when ``topk_idx`` holds an expert id outside ``[0, num_experts)``.

    Eager only (it reads the values on the host): call it on concrete arrays before the
    jitted step, e.g. on the global ``[W * T, K]`` routing. Under ``jit`` nothing can raise
    on data: out-of-range ids are then not sent (their pairs add zero to ``ep_combine``)
    and counted in ``handle.invalid``.

    Args:
        cfg: the layer's :class:`EPConfig`.
        topk_idx: integer array ``[..., topk]`` of global expert ids.

    Example::

        jep.validate_topk_idx(cfg, topk_idx)   # before step(...), on the host
    """
    if not is_concrete(topk_idx):
        raise ValueError("validate_topk_idx needs concrete values; under jit check handle.invalid instead")
    values = np.asarray(topk_idx)
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"topk_idx.dtype={values.dtype}: expected an integer dtype (int32 global expert ids)")
    if values.shape[-1:] != (cfg.topk,):
        raise ValueError(f"topk_idx.shape={values.shape}: expected [..., topk={cfg.topk}]")
    bad = (values < 0) | (values >= cfg.num_experts)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"topk_idx{list(where)}={int(values[where])} is out of range: expert ids must lie in "
                         f"[0, num_experts={cfg.num_experts}); fix the router or EPConfig.num_experts")
