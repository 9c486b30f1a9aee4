"""megatron-core's stock description of a TP-local weight (its ``ShardedTensor`` or
``ShardedTensorFactory``) read as the segments an ETP shard is cut against, and
``ETPGroupedExperts``' stacked weights described as ``SequentialMLP``'s. See
[Note: ETP checkpoint pieces] in ``etp/megatron/checkpoint/model_state.py``."""
from __future__ import annotations

import math

import torch

from .pieces import ETPPieces, _Segment

__all__ = ["pieces_of"]

# ETPGroupedExperts' weights (``<experts>.experts.fc1_weight``) -> SequentialMLP's checkpoint
# keys (``<experts>.experts.linear_fc1.weight``: SequentialMLP renames ``local_experts.<i>.``
# to ``experts.`` and puts the expert index on a global axis).
_GROUPED_KEYS = {"fc1_weight": "linear_fc1.weight", "fc2_weight": "linear_fc2.weight"}


def _segments_of_tensor(sh_ten, logical: tuple[int, ...]) -> tuple[_Segment, ...]:
    """megatron's ShardedTensor for a weight, rebuilt for its logical TP-local shape: it was
    made from the shard, but ``from_rank_offsets`` sets each offset to chunk x local size,
    so the chunk indices (TP rank, expert index) survive."""
    p = sh_ten.prepend_axis_num
    local = sh_ten.local_shape
    frags = sh_ten.axis_fragmentations
    if frags is None:
        raise ValueError(f"'{sh_ten.key}' already has an irregular sharding; etp cannot re-cut it")
    frags = frags[p:]
    if all(f == 1 for f in frags):  # replicated over TP: the whole weight, at the origin
        shape, offset = logical, (0,) * len(logical)
    elif len(local) == len(logical):
        offset = tuple((o // n) * d for o, n, d in zip(sh_ten.global_offset[p:], local, logical))
        shape = tuple(f * d for f, d in zip(frags, logical))
    else:
        raise ValueError(
            f"'{sh_ten.key}': a {len(logical)}-D weight sharded by megatron along "
            f"{frags} cannot be described from its 2-D ETP shard; keep that module out of ETP "
            "(apply_etp's filter_fn)"
        )
    return (_Segment(0, "", sh_ten.global_shape[:p] + shape, sh_ten.global_offset[:p] + offset,
                     (1,) * p + tuple(logical), sh_ten.allow_shape_mismatch),)


def _segments_of_factory(factory, logical: tuple[int, ...]) -> tuple[_Segment, ...]:
    """Runs megatron's factory (e.g. SwiGLU's gate / up split) on a meta tensor of the
    logical TP-local shape and reads where each ShardedTensor's data lies in it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    placeholder = torch.empty(logical, dtype=factory.data.dtype, device="meta")
    built = factory.build_fn(factory.key, placeholder, factory.replica_id, None)
    built = built if isinstance(built, (dict, list)) else [built]
    segments = []
    for sh_ten in nested_values(built):
        if not isinstance(sh_ten, ShardedTensor):
            continue
        data = sh_ten.data
        if not (data is placeholder or data._base is placeholder) or not data.is_contiguous():
            raise ValueError(
                f"megatron's factory for '{factory.key}' transforms the weight beyond contiguous "
                "slices; etp cannot map its shards onto it: keep that module out of ETP"
            )
        if not sh_ten.key.startswith(factory.key):
            raise ValueError(f"factory '{factory.key}' builds an unrelated key '{sh_ten.key}'")
        p = sh_ten.prepend_axis_num
        segments.append(_Segment(
            data.storage_offset() - placeholder.storage_offset(), sh_ten.key[len(factory.key):],
            sh_ten.global_shape, sh_ten.global_offset, (1,) * p + tuple(sh_ten.local_shape),
            sh_ten.allow_shape_mismatch,
        ))
    segments.sort(key=lambda s: s.start)
    covered = 0
    for seg in segments:
        if seg.start != covered:
            break
        covered += seg.numel
    if covered != math.prod(logical):
        raise ValueError(f"megatron's factory for '{factory.key}' does not cover the weight exactly once")
    return tuple(segments)


def _segments_of_grouped_experts(sh_ten, logical: tuple[int, ...], suffix: str):
    """ETPGroupedExperts' stacked ``[E_local, rows, cols]`` weight as SequentialMLP's global
    ``[E, rows, cols]`` tensor, this rank's experts at its expert-parallel offset."""
    from megatron.core import parallel_state

    ep_size = parallel_state.get_expert_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    if not sh_ten.key.endswith(suffix):
        raise ValueError(f"'{sh_ten.key}': expected an ETPGroupedExperts key ending in '{suffix}'")
    p = sh_ten.prepend_axis_num
    key = sh_ten.key[: -len(suffix)] + _GROUPED_KEYS[suffix]
    segment = _Segment(
        0, "", sh_ten.global_shape[:p] + (logical[0] * ep_size, *logical[1:]),
        sh_ten.global_offset[:p] + (logical[0] * ep_rank, 0, 0), (1,) * p + tuple(logical),
    )
    return key, (segment,)


def pieces_of(entry) -> ETPPieces:
    """The ``ETPPieces`` of any parameter entry of a sharded state dict: an ETP factory's own,
    or one built from megatron's stock ``ShardedTensor`` / factory (the whole param, starting
    at element 0), so that a 1-D slice of any flattened param (the distributed optimizer's
    state) can be described as boxes of the global tensor.

    Example::

        boxes, _ = pieces_of(entry).sharded_tensors(exp_avg_slice, "optimizer.exp_avg." + entry.key,
                                                    entry.replica_id, slice(start, stop))
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        if isinstance(entry.build_fn, ETPPieces):
            return entry.build_fn
        logical = tuple(entry.data.shape)
        return ETPPieces(entry.key, 0, math.prod(logical), _segments_of_factory(entry, logical))
    logical = tuple(entry.data.shape)
    return ETPPieces(entry.key, 0, math.prod(logical), _segments_of_tensor(entry, logical))
