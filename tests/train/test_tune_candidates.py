"""``--tune``'s candidates vary only what can change the run: where no weight is ETP-sharded
(both ETP sizes 1: one GPU, ``etp_size=1`` with ``expert_etp_size=1``, an FSDP peer) the
gather keys are inert, so candidates that differ only in them are not timed, and ``auto``'s
start-up line says they are inert; where any weight is sharded (dense or expert) the full
product is kept."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from etp.recipe import Recipe
from etp.train.auto import Machine, nothing_sharded, resolve_auto
from etp.train.options import TrainError
from etp.train.tune import candidates, tune

ROOT = Path(__file__).resolve().parents[2]
FLAGSHIP = ROOT / "recipes" / "moe_flagship.yaml"
H200 = dict(cuda=True, gpu_name="NVIDIA H200", gpu_memory=141 * 2**30, sm90=True)
# sm90 CUDA with no memory to size against: the audit skips nothing, so the count is the
# product of the axes alone (the audit's own verdicts are not what this file tests).
UNSIZED = dict(cuda=True, gpu_name="NVIDIA H200", gpu_memory=None, sm90=True)
TUNED = ("cuda_graph", "etp.gather_dtype", "etp.gather_reuse", "micro_batch_size")  # what --tune holds auto


def _held(world: int, etp: dict, machine: Machine) -> Recipe:
    """The flagship as ``etp-train --tune`` hands it to ``candidates``: the ETP sizes resolved,
    the tuned keys still auto."""
    recipe = Recipe.from_yaml(FLAGSHIP, world_size=world, **({"etp": etp} if etp else {}))
    return resolve_auto(recipe, machine, keep=TUNED)[0]


def _axes(c) -> tuple:
    """A candidate's value on every axis --tune can vary ("auto" where it leaves a key alone)."""
    etp = c.overrides.get("etp", {})
    return (c.overrides.get("cuda_graph", "auto"), etp.get("gather_dtype", "auto"),
            etp.get("gather_reuse", "auto"), c.overrides["micro_batch_size"])


@pytest.mark.parametrize("world, etp", [(1, {}), (2, {"etp_size": 1, "expert_etp_size": 1}),
                                        (4, {"etp_size": 1, "expert_etp_size": 1})])
def test_nothing_sharded_leaves_the_gather_keys_out(world, etp):
    machine = Machine(world, world, **UNSIZED)
    found = candidates(_held(world, etp, machine), machine)
    # By hand: cuda_graph {none, step} x the 3 largest divisors of each rank's 32 / world samples;
    # gather_dtype {param, fp8} and gather_reuse {chain, kept} would multiply this by 4.
    share = 32 // world
    sizes = sorted((m for m in range(1, share + 1) if share % m == 0), reverse=True)[:3]
    assert sorted(_axes(c) for c in found) == sorted((g, "auto", "auto", m) for g in ("none", "step") for m in sizes)
    assert len(found) == 2 * 3 and all(c.skipped is None for c in found)


def test_one_h200_times_no_two_candidates_that_differ_only_in_gathers():
    """The issue's case: the flagship on one H200 (auto: ETP size 1) timed 24 candidates, 18 of
    them repeats; now every timed candidate differs in cuda_graph or micro_batch_size."""
    machine = Machine(1, 1, **H200)
    runnable = [c for c in candidates(_held(1, {}, machine), machine) if c.skipped is None]
    assert runnable and all("etp" not in c.overrides for c in runnable)
    projections = [(c.overrides["cuda_graph"], c.overrides["micro_batch_size"]) for c in runnable]
    assert len(set(projections)) == len(projections) <= 2 * 3


@pytest.mark.parametrize("etp", [{}, {"etp_size": 1}, {"etp_size": 2, "expert_etp_size": 1},
                                 {"etp_size": 1, "expert_etp_size": 2}])
def test_any_sharded_weight_keeps_the_full_product(etp):
    """At world 2 ETP shards the dense weights (etp_size 2), the experts (expert_etp_size 2,
    auto's pick where etp_size alone is 1), or both: the gather keys govern them, so each is varied."""
    machine = Machine(2, 2, **UNSIZED)
    recipe = _held(2, etp, machine)
    assert nothing_sharded(recipe, machine) is None
    found = candidates(recipe, machine)
    # By hand: cuda_graph 2 x gather_dtype {param, fp8_tensorwise} 2 x gather_reuse {chain, kept} 2
    # x micro-batches {16, 8, 4} 3; "kept" is "pass" at one micro-batch per rank, "step" at more.
    expected = {(g, d, r if r == "chain" else ("pass" if m == 16 else "step"), m)
                for g in ("none", "step") for d in ("param", "fp8_tensorwise") for r in ("chain", "kept")
                for m in (16, 8, 4)}
    assert len(found) == 24 and {_axes(c) for c in found} == expected


def test_auto_says_the_gather_keys_are_inert_where_nothing_is_sharded():
    """Before, one H200 read "fp8_tensorwise: half the gathered bytes ... pay": an effect that
    cannot happen with nothing sharded."""
    recipe, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP), Machine(1, 1, **H200))
    assert (recipe.etp.etp_size, recipe.etp.expert_etp_size) == (1, 1)
    assert "etp.gather_dtype auto -> param: inert: nothing is sharded (ETP size 1" in "\n".join(notes), notes
    assert "etp.gather_reuse auto -> chain: inert: nothing is sharded (ETP size 1" in "\n".join(notes), notes
    fsdp = Recipe.from_yaml(FLAGSHIP, use_torch_fsdp2=True, micro_batch_size=4)
    _, notes = resolve_auto(fsdp, Machine(4, 4, **H200))
    assert any(n.startswith("etp.gather_dtype auto -> param: inert: nothing is sharded by ETP (use_torch_fsdp2")
               for n in notes), notes
    # Dense weights sharded, experts not: the gathers matter, and auto gives a reason with an effect.
    _, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP, etp={"etp_size": 2, "expert_etp_size": 1}),
                            Machine(2, 2, **H200))
    assert not any("inert" in n for n in notes), notes


def test_tune_names_what_it_does_not_time(tmp_path, monkeypatch, capsys):
    """tune() on one H200 with the runs stubbed: it names each inert key with its reason, runs
    only the collapsed list, and the file it writes leaves the inert keys to auto."""
    import etp.train.tune as tune_module

    def fake_run(recipe_path, base_args, candidate, machine, iters):
        candidate.ms_per_iter, candidate.tflops = 100.0 / candidate.overrides["micro_batch_size"], 1.0

    monkeypatch.setattr(tune_module, "_run", fake_run)
    machine = Machine(1, 1, **H200)
    recipe = _held(1, {}, machine)
    out = tmp_path / "best.yaml"
    found = tune(recipe, str(FLAGSHIP), [], str(out), machine)
    stdout = capsys.readouterr().out
    for key in ("etp.gather_dtype", "etp.gather_reuse"):
        assert f"etp-train --tune: {key} not timed: inert: nothing is sharded (ETP size 1" in stdout
    timed = [c for c in found if c.skipped is None]
    assert stdout.count("etp-train --tune [") == 2 * len(timed)
    assert "etp" not in yaml.safe_load(out.read_text())
    # Nothing left to time once the inert keys are taken out: refused, naming them.
    only_gathers = resolve_auto(Recipe.from_yaml(FLAGSHIP, world_size=1, micro_batch_size=4, cuda_graph="none"),
                                machine, keep=TUNED)[0]
    with pytest.raises(TrainError, match="nothing to time.*etp.gather_dtype, etp.gather_reuse, are inert"):
        tune(only_gathers, str(FLAGSHIP), [], str(out), machine)
