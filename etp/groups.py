"""ETP process groups: who shards each weight and who replicates it.

[Note: ETP rank layout]
Standalone (``build_etp_groups``), ranks of one ETP group are contiguous and the replicate
axis is the slow one: with world W and ETP size N, ETP group ``k`` is the ranks
``k*N .. k*N + N - 1`` and replicate group ``j`` is ``{j, j + N, j + 2N, ...}``.

    W = 8, N = 4:   ETP groups       [0 1 2 3] [4 5 6 7]
                    replicate groups [0 4] [1 5] [2 6] [3 7]

Expert weights use the same rule with the expert ETP size M. Contiguous ETP ranks keep the
per-layer all-gathers inside one NVLink domain when W spans several hosts. Existing groups
(for example megatron-core's data-parallel group, so that ETP is orthogonal to TP) can be
taken with ``ETPGroups.from_process_groups``.

Every shard group carries two communicators over the same ranks: one for all-gathers and
one for reduce-scatters, so that NCCL can run a weight gather and a gradient reduce-scatter
at the same time (collectives on one communicator execute in issue order).

[Note: group timeouts]
A collective whose peer stopped answering (a host that died without closing its sockets, a hung
process) waits for its group's timeout, then fails the rank, so that the launcher can restart the
run. torch's ``new_group`` does not inherit the world's timeout: without one it takes its
backend's default (30 minutes for gloo), whatever ``init_process_group`` was given. Every group
etp creates therefore goes through ``new_process_group``, which passes the world group's timeout
unless told otherwise (etp-train: the recipe's ``distributed_timeout_minutes``, Megatron-LM's key,
which it also gives megatron-core's ``initialize_model_parallel``); the public functions that
create groups take an optional ``timeout`` for the same purpose.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from .config import ETPConfig

__all__ = ["ShardGroup", "ETPGroups", "build_etp_groups", "new_process_group", "world_timeout"]


def world_timeout() -> datetime.timedelta | None:
    """The timeout the world process group was created with (``init_process_group(timeout=...)``),
    None before it exists or where its backend does not say. See [Note: group timeouts].

    Example::

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        world_timeout()   # datetime.timedelta(seconds=30)
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    for device in getattr(world, "_device_types", ()):
        try:
            return world._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without torch's Options (a third-party one)
            continue
    return None


def new_process_group(ranks=None, *, timeout: datetime.timedelta | None = None, **kwargs) -> dist.ProcessGroup:
    """``torch.distributed.new_group(ranks, **kwargs)`` whose collectives wait ``timeout`` (None:
    the world group's, :func:`world_timeout`) for their peers, rather than torch's default for
    the backend. A collective over the world, like ``new_group``. See [Note: group timeouts].

    Example::

        vote = new_process_group(backend="gloo")   # a CPU group over the world, the world's timeout
    """
    return dist.new_group(ranks, timeout=timeout if timeout is not None else world_timeout(), **kwargs)


@dataclass(frozen=True)
class ShardGroup:
    """One ETP shard group as seen from this rank.

    Args:
        ag_group: process group for all-gathers (None when size == 1).
        rs_group: process group over the same ranks for reduce-scatters.
        ranks: global ranks of the group, in shard order.
        rank: this rank's index within ``ranks``.
    """

    ag_group: dist.ProcessGroup | None
    rs_group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def single(cls) -> "ShardGroup":
        """The trivial group of this rank alone (ETP off)."""
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return cls(None, None, (me,), 0)


def _from_partition(groups: list[dist.ProcessGroup | None],
                    timeout: datetime.timedelta | None = None) -> list[ShardGroup]:
    """ShardGroups for this rank's member of each of several partitions of the world."""
    if not dist.is_initialized():
        return [ShardGroup.single() for _ in groups]
    mine = [
        tuple(dist.get_process_group_ranks(g)) if g is not None and dist.get_world_size(g) > 1 else None
        for g in groups
    ]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    result = []
    for index, group in enumerate(groups):
        partition = [ranks[index] for ranks in everyone if ranks[index] is not None]
        reduce_groups = new_groups(partition, timeout)  # every rank creates every communicator
        if mine[index] is None:
            result.append(ShardGroup.single())
        else:
            ranks = mine[index]
            result.append(ShardGroup(group, reduce_groups, ranks, ranks.index(dist.get_rank())))
    return result


def new_groups(partition, timeout: datetime.timedelta | None = None) -> dist.ProcessGroup | None:
    """Creates a process group for every rank list of ``partition`` (a collective: every rank
    calls it with the same partition; duplicates are created once, in sorted order) and
    returns the one this rank belongs to (None if none, or if it holds only this rank).
    ``timeout``: how long their collectives wait for a peer (None: the world group's; see
    [Note: group timeouts]).

    Example::

        replicate = new_groups([(0, 2), (1, 3)])   # on rank 2: the group of ranks 0 and 2
    """
    me = dist.get_rank()
    mine = None
    for ranks in sorted({tuple(r) for r in partition if len(r) > 1}):  # singletons need none
        group = new_process_group(list(ranks), timeout=timeout)
        if me in ranks:
            mine = group
    return mine


def shard_group_from_partition(partition, timeout: datetime.timedelta | None = None) -> ShardGroup:
    """This rank's ShardGroup of a partition into shard groups: two communicators per group
    (all-gather and reduce-scatter), waiting ``timeout`` as in ``new_groups``. A collective,
    like ``new_groups``."""
    me = dist.get_rank()
    ag, rs = new_groups(partition, timeout), new_groups(partition, timeout)
    for ranks in partition:
        if me in ranks and len(ranks) > 1:
            return ShardGroup(ag, rs, tuple(ranks), tuple(ranks).index(me))
    return ShardGroup.single()


@dataclass(frozen=True)
class ETPGroups:
    """The dense and expert shard groups plus the replicate groups beside them.

    ``dense`` shards dense weights, ``expert`` shards routed-expert weights; the replicate
    groups are the axes that data-parallel gradient reduction runs over (they exclude the
    ETP axis). See [Note: ETP rank layout].
    """

    dense: ShardGroup
    expert: ShardGroup
    dense_replicate: dist.ProcessGroup | None
    expert_replicate: dist.ProcessGroup | None

    @classmethod
    def from_process_groups(
        cls,
        dense: dist.ProcessGroup | None,
        dense_replicate: dist.ProcessGroup | None = None,
        expert: dist.ProcessGroup | None = None,
        expert_replicate: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> "ETPGroups":
        """Takes existing groups; ``expert`` defaults to ``dense``. The reduce-scatter
        communicators it creates beside them wait ``timeout`` for a peer (None: the world
        group's; [Note: group timeouts]).

        A collective over the world: every rank calls it with its own members of the same
        partitions.

        Example::

            groups = ETPGroups.from_process_groups(dense=mpu.get_data_parallel_group())
        """
        if expert is None or expert is dense:
            (dense_group,) = _from_partition([dense], timeout)
            expert_group = dense_group
            if expert_replicate is None:
                expert_replicate = dense_replicate
        else:
            dense_group, expert_group = _from_partition([dense, expert], timeout)
        return cls(dense_group, expert_group, dense_replicate, expert_replicate)


def _contiguous_groups(world: int, size: int,
                       timeout: datetime.timedelta | None) -> tuple[ShardGroup, dist.ProcessGroup | None]:
    """Creates (on every rank, in the same order) the contiguous shard groups of ``size``
    and the strided replicate groups; returns this rank's pair."""
    shards = [tuple(range(start, start + size)) for start in range(0, world, size)]
    replicas = [tuple(range(offset, world, size)) for offset in range(size)]
    return shard_group_from_partition(shards, timeout), new_groups(replicas, timeout)


def build_etp_groups(config: ETPConfig, timeout: datetime.timedelta | None = None) -> ETPGroups:
    """Builds the ETP groups of ``config`` over the default (world) process group; their
    collectives wait ``timeout`` for a peer (None: the world group's; [Note: group timeouts]).

    Must be called by every rank after ``torch.distributed.init_process_group``. A size of 1
    means ETP is off for that kind of weight; see [Note: ETP rank layout].

    Example::

        dist.init_process_group("nccl")
        groups = build_etp_groups(ETPConfig(etp_size=8, expert_etp_size=8))
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "build_etp_groups needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first"
        )
    world = dist.get_world_size()
    config.check_world_size(world)
    dense, dense_replicate = _contiguous_groups(world, config.etp_size, timeout)
    if config.expert_etp_size == config.etp_size:
        return ETPGroups(dense, dense, dense_replicate, dense_replicate)
    expert, expert_replicate = _contiguous_groups(world, config.expert_etp_size, timeout)
    return ETPGroups(dense, expert, dense_replicate, expert_replicate)
