"""Which ranks of an expert-parallel group share a host (an NVLink domain), and the two
sub-groups the ``hierarchical`` backend exchanges over.

[Note: host groups]
The group's ranks are taken to sit on hosts in equal, contiguous blocks of ``G`` ranks (as
torchrun numbers them): rank ``r`` is on host ``r // G`` with local index ``r % G``. The
*host group* of a rank holds the ranks of its host (symmetric memory works among them); its
*rail group* holds the ranks of every host with the same local index (what crosses hosts
goes over it, one NCCL peer per host). ``G`` is detected from the hosts' names, or declared
with ``EPConfig.ranks_per_host``: declaring fewer ranks per host than a machine has is the
test hook that runs the cross-host code on one machine (e.g. 4 GPUs as 2 hosts x 2).
"""
from __future__ import annotations

import datetime
import socket
from typing import NamedTuple, Optional

import torch.distributed as dist

from etp.groups import new_process_group

__all__ = ["HostGroups", "host_groups", "ranks_per_host"]

_DETECTED: dict[tuple, int] = {}
_GROUPS: dict[tuple, "HostGroups"] = {}


def _members(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group))


def ranks_per_host(group, declared: Optional[int] = None) -> int:
    """``G``: ``declared`` (checked against the group's size), else detected from the host
    names (one object all-gather per group and process, cached). See [Note: host groups].

    Example::

        ranks_per_host(group)        # 8 on one 8-GPU host; 8 on two of them (16 ranks)
        ranks_per_host(group, 2)     # 4 ranks declared as 2 hosts x 2
    """
    world = dist.get_world_size(group)
    if declared is not None:
        if not isinstance(declared, int) or declared < 1 or world % declared:
            raise ValueError(f"EPConfig.ranks_per_host={declared!r}: expected a divisor of the expert-parallel "
                             f"group's size {world}")
        return declared
    key = _members(group)
    if key not in _DETECTED:
        names: list = [None] * world
        dist.all_gather_object(names, socket.gethostname(), group=group)
        size = names.count(names[0])
        blocks = [names[b * size:(b + 1) * size] for b in range(world // size)] if world % size == 0 else []
        if not blocks or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
            raise ValueError(f"the expert-parallel group's ranks are not in equal contiguous blocks per host "
                             f"({names}); declare EPConfig.ranks_per_host")
        _DETECTED[key] = size
    return _DETECTED[key]


class HostGroups(NamedTuple):
    """This rank's place among the hosts: ``G`` ranks per host, ``hosts`` of them."""

    ranks_per_host: int
    hosts: int
    host: int  # this rank's host
    local: int  # this rank's index on its host
    host_group: object  # the ranks of this host
    rail_group: object  # this local index on every host


def host_groups(group, declared: Optional[int] = None,
                timeout: Optional[datetime.timedelta] = None) -> HostGroups:
    """This rank's :class:`HostGroups` of ``group`` (the sub-groups made once per process and
    group, by their members only; their collectives wait ``timeout`` for a peer, None: the
    world group's, [Note: group timeouts] in ``etp/groups.py``).

    Example::

        groups = host_groups(ep_group, declared=2)   # 4 ranks as 2 hosts x 2
        groups.host_group, groups.rail_group
    """
    size = ranks_per_host(group, declared)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    key = (_members(group), size, timeout)  # a call asking for another timeout gets groups of its own
    if key not in _GROUPS:
        host, local = divmod(rank, size)
        to_global = lambda ranks: [dist.get_global_rank(group, r) for r in ranks]  # noqa: E731
        host_group = new_process_group(to_global(range(host * size, (host + 1) * size)), timeout=timeout,
                                       use_local_synchronization=True)
        rail_group = new_process_group(to_global(range(local, world, size)), timeout=timeout,
                                       use_local_synchronization=True)
        _GROUPS[key] = HostGroups(size, world // size, host, local, host_group, rail_group)
    return _GROUPS[key]
