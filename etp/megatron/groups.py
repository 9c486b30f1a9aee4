"""ETP / EETP process groups orthogonal to megatron-core's parallel_state.

[Note: ETP ranks under megatron-core]
ETP is a sub-axis of data parallelism: dense weights are sharded over ``etp_size`` ranks of
each data-parallel group (ranks holding the same TP / PP slice), expert weights over
``expert_etp_size`` ranks of each expert-data-parallel group (ranks holding the same
experts). So world = TP x CP x PP x DP for dense weights, with DP = ETP x DP_replicate, and
TP, CP, PP and EP groups are untouched. Within a data-parallel group (in megatron's rank
order) the ETP groups are contiguous chunks; the replicate group of a rank holds the ranks
of its data-parallel (x context-parallel) group at the same position within their chunk:
those are the ranks DDP and the optimizer still reduce over.

Example: world 8, TP = 2 (megatron's default order tp-cp-ep-dp-pp), ETP = 2:

=====  ==========  ==============  ============  ===============
rank   TP group    DP group        ETP group     replicate group
=====  ==========  ==============  ============  ===============
0      [0 1]       [0 2 4 6]       [0 2]         [0 4]
1      [0 1]       [1 3 5 7]       [1 3]         [1 5]
2      [2 3]       [0 2 4 6]       [0 2]         [2 6]
4      [4 5]       [0 2 4 6]       [4 6]         [0 4]
=====  ==========  ==============  ============  ===============
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from ..config import ETPConfig
from ..groups import ETPGroups, new_groups, shard_group_from_partition

__all__ = ["build_megatron_etp_groups"]


def _partitions(groups: list[tuple[int, ...]], size: int, what: str, key: str):
    """ETP chunks and replicate classes of each data-parallel group (in its rank order)."""
    shards, position = [], {}
    for ranks in groups:
        if len(ranks) % size:
            raise ValueError(
                f"ETPConfig.{key}={size} does not divide the {what} size {len(ranks)} "
                f"(ranks {list(ranks)}): choose a divisor of {len(ranks)}"
            )
        for start in range(0, len(ranks), size):
            shards.append(ranks[start : start + size])
        for index, rank in enumerate(ranks):
            position[rank] = index % size
    return shards, position


def _replicas(position: dict[int, int], outer_groups: list[tuple[int, ...]]):
    """Within each outer group (data-parallel x context-parallel), the ranks that hold the
    same shard position replicate each other."""
    replicas = []
    for ranks in outer_groups:
        by_position: dict[int, list[int]] = {}
        for rank in ranks:
            by_position.setdefault(position[rank], []).append(rank)
        replicas.extend(tuple(v) for v in by_position.values())
    return replicas


def build_megatron_etp_groups(config: ETPConfig, timeout: datetime.timedelta | None = None) -> ETPGroups:
    """Builds ETP groups inside megatron-core's data-parallel groups; see
    [Note: ETP ranks under megatron-core]. A collective: every rank calls it after
    ``parallel_state.initialize_model_parallel``. Their collectives wait ``timeout`` for a peer
    (None: the world group's, as Megatron-LM's ``distributed_timeout_minutes`` sets it;
    [Note: group timeouts] in ``etp/groups.py``).

    Raises:
        ValueError: an ETP size does not divide its data-parallel group size.

    Example::

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        groups = build_megatron_etp_groups(ETPConfig(etp_size=2, expert_etp_size=4))
    """
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "build_megatron_etp_groups needs megatron-core's parallel_state: call "
            "parallel_state.initialize_model_parallel(...) first"
        )

    def ranks(group):
        return tuple(dist.get_process_group_ranks(group))

    mine = (
        ranks(parallel_state.get_data_parallel_group()),
        ranks(parallel_state.get_data_parallel_group(with_context_parallel=True)),
        ranks(parallel_state.get_expert_data_parallel_group()),
    )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dp, dp_cp, expert_dp = (sorted({r[i] for r in everyone}) for i in range(3))

    dense_shards, dense_position = _partitions(dp, config.etp_size, "data-parallel group", "etp_size")
    expert_shards, expert_position = _partitions(
        expert_dp, config.expert_etp_size, "expert-data-parallel group", "expert_etp_size"
    )
    dense = shard_group_from_partition(dense_shards, timeout)
    dense_replicate = new_groups(_replicas(dense_position, dp_cp), timeout)
    expert = shard_group_from_partition(expert_shards, timeout)
    expert_replicate = new_groups(_replicas(expert_position, expert_dp), timeout)
    return ETPGroups(dense, expert, dense_replicate, expert_replicate)
