"""Every process group etp creates waits the world group's timeout, or the one it is given
([Note: group timeouts] in etp/groups.py), and etp-train's set-up leaves no group of the
process at torch's backend default (30 minutes for gloo): on 2 gloo ranks, one spawn.

The timeouts are read back from each group's backend (what gloo enforces), not from what etp
passed, so a group created without a timeout shows torch's default."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed

pytest.importorskip("megatron.core")

#: the world group's timeout: the harness creates it with the spawn's timeout
WORLD_S = 170.0
GIVEN = datetime.timedelta(seconds=7)
#: the recipe's distributed_timeout_minutes, in seconds (not the world's: which one a group took shows)
RECIPE_S = 120.0


def _timeout_s(group) -> float | None:
    """The timeout gloo enforces on ``group`` (None: this rank holds no group there)."""
    if group is None:
        return None
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _every_group_s() -> dict[str, float]:
    """Every process group of this rank, by name, with its timeout in seconds."""
    from torch.distributed.distributed_c10d import _world

    return {name: _timeout_s(group) for group, name in _world.pg_names.items()}


def _public_api(ctx) -> dict:
    from megatron.core import parallel_state as ps

    from etp import ETPConfig
    from etp.ep.backends.hosts import host_groups
    from etp.groups import ETPGroups, build_etp_groups, new_groups, new_process_group, world_timeout
    from etp.megatron.ddp import etp_process_groups
    from etp.megatron.groups import build_megatron_etp_groups

    config = ETPConfig(etp_size=2, expert_etp_size=2)
    seen: dict = {"world": world_timeout().total_seconds()}
    for label, timeout in (("default", None), ("given", GIVEN)):
        groups = build_etp_groups(config, timeout=timeout)
        taken = ETPGroups.from_process_groups(dense=dist.group.WORLD, timeout=timeout)  # its rs communicator
        hosts = host_groups(new_groups([(0, 1)]), declared=1, timeout=timeout)  # 2 "hosts" of 1: a rail of 2
        ps.initialize_model_parallel(distributed_timeout_minutes=(timeout or world_timeout()).total_seconds() / 60)
        try:
            megatron = build_megatron_etp_groups(config, timeout=timeout)
            pgs = etp_process_groups(megatron, timeout=timeout)  # replicate axis of 1: singleton groups
            seen[label] = {
                "etp ag": _timeout_s(groups.dense.ag_group), "etp rs": _timeout_s(groups.dense.rs_group),
                "from_process_groups rs": _timeout_s(taken.dense.rs_group),
                "new_groups": _timeout_s(new_groups([(0, 1)], timeout)),
                "new_process_group": _timeout_s(new_process_group(backend="gloo", timeout=timeout)),
                "host group": _timeout_s(hosts.host_group), "rail group": _timeout_s(hosts.rail_group),
                "megatron etp ag": _timeout_s(megatron.expert.ag_group),
                "megatron etp rs": _timeout_s(megatron.expert.rs_group),
                "ddp singleton": _timeout_s(pgs.dp),
                "megatron tp": _timeout_s(ps.get_tensor_model_parallel_group()),
            }
        finally:
            ps.destroy_model_parallel()
    return seen


def _etp_train_set_up(ctx) -> dict[str, float]:
    """The groups etp-train's set-up of the tiny recipe makes (in a world made before it)."""
    from pathlib import Path

    from megatron.core import parallel_state as ps

    from etp.recipe import Recipe
    from etp.train.setup import set_up

    root = Path(__file__).resolve().parents[1]
    recipe = Recipe.from_yaml(root / "recipes" / "tiny_moe_cpu.yaml", distributed_timeout_minutes=RECIPE_S / 60)
    before = set(_every_group_s())
    set_up(recipe, ctx.rank, ctx.world_size)
    made = {name: s for name, s in _every_group_s().items() if name not in before}
    ps.destroy_model_parallel()
    return made


def _both(ctx):
    return _public_api(ctx), _etp_train_set_up(ctx)


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_both, 2, timeout=WORLD_S)


def test_groups_take_the_world_timeout_or_the_given_one(spawned):
    for seen, _ in spawned:
        assert seen["world"] == WORLD_S
        assert seen["default"] == dict.fromkeys(seen["default"], WORLD_S), seen["default"]
        assert seen["given"] == dict.fromkeys(seen["given"], GIVEN.total_seconds()), seen["given"]


def test_etp_train_set_up_leaves_no_group_at_torchs_default(spawned):
    for _, made in spawned:
        assert len(made) > 10, made  # megatron-core's groups and gloo twins, etp's ETP and replicate groups
        assert made == dict.fromkeys(made, RECIPE_S), made
