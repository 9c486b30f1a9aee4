"""The JAX calls whose spelling moved between releases: ``shard_map`` and the axis size."""
from __future__ import annotations

import jax

__all__ = ["axis_size", "shard_map"]

try:
    _shard_map = jax.shard_map
    _NEW_SHARD_MAP = True
except AttributeError:  # JAX releases before jax.shard_map was public
    from jax.experimental.shard_map import shard_map as _shard_map

    _NEW_SHARD_MAP = False


def shard_map(f, mesh, in_specs, out_specs, check=True):
    """``jax.shard_map`` where present, else ``jax.experimental.shard_map.shard_map``.

    Args:
        f: the per-shard function.
        mesh: the ``jax.sharding.Mesh`` to map over.
        in_specs: a ``PartitionSpec`` (or pytree of them) per argument of ``f``.
        out_specs: a ``PartitionSpec`` (or pytree of them) per output of ``f``.
        check: the replication check (``check_vma`` in new JAX, ``check_rep`` in old).

    Example::

        step = shard_map(body, mesh, in_specs=(P("ep"),), out_specs=P("ep"))
    """
    if _NEW_SHARD_MAP:
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    return _shard_map(f, mesh, in_specs, out_specs, check_rep=check)


def axis_size(axis_name) -> int:
    """Size W of the mapped axis ``axis_name`` as a Python int (static at trace time).

    Raises ValueError outside a ``shard_map`` / ``pmap`` that binds ``axis_name``.
    """
    try:
        if hasattr(jax.lax, "axis_size"):
            return int(jax.lax.axis_size(axis_name))
        # Older JAX: psum of a Python constant folds to the static axis size.
        return int(jax.lax.psum(1, axis_name))
    except NameError as err:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here: call etp.jax.ep inside shard_map (or pjit) over a "
            f"mesh with an axis named {axis_name!r}, or set EPConfig.axis_name to the mesh's expert axis"
        ) from err
