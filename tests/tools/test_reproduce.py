"""tools/reproduce.py on CPU: --list / --dry-run name every step and command; every etp-train
command parses and its recipe validates today (no removed key, no removed flag); every tool
and test file it names exists; a command past its timeout is ended with its process group; a
step that does not fit the budget is skipped and reported."""
from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from repro import headlines  # noqa: E402
from repro.runner import run_step  # noqa: E402
from repro.steps import Run, Step, build_steps, fill  # noqa: E402

REPRODUCE = [sys.executable, str(ROOT / "tools" / "reproduce.py")]


def _commands(n: int) -> list[str]:
    return [fill(run.command, Path("/tmp/r") / step.name, run, Path("/tmp/scratch"))
            for step in build_steps(n) for run in step.runs]


def test_list_and_dry_run_name_every_step(tmp_path):
    listed = subprocess.run([*REPRODUCE, "--list", "--gpus", "4"], capture_output=True, text=True, check=True).stdout
    names = [s.name for s in build_steps(4)]
    assert all(f"{name} " in listed for name in names)
    assert {"expert_stack_2gpu", "expert_stack_4gpu", "recipes_wide_4gpu", "kernels_1gpu", "ep_moves_4gpu",
            "memory_audit_4gpu", "checkpoint_4gpu", "graphs_flagship_4gpu", "tests_kernels"} <= set(names)
    dry = subprocess.run([*REPRODUCE, "--dry-run", "--gpus", "4", "--out", str(tmp_path), "--only", "^recipes_wide"],
                         capture_output=True, text=True, check=True).stdout
    assert dry.count("-m etp.train") == 8  # 4 runs at 2 and at 4 GPUs
    assert "CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2" in dry
    assert f"--json {tmp_path}/recipes_wide_4gpu/etp_defaults.json" in dry
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_two_gpus_give_one_set_of_rows():
    names = [s.name for s in build_steps(2)]
    assert len(names) == len(set(names)) and "expert_stack_2gpu" in names
    assert not any(name.endswith("_4gpu") for name in names)


@pytest.mark.parametrize("n", [2, 4])
def test_every_etp_train_command_runs_today(n):
    from etp.recipe import Recipe, parse_overrides
    from etp.train import main as train
    from etp.train.auto import Machine, resolve_auto

    found = 0
    for command in _commands(n):
        argv = shlex.split(command)
        if "etp.train" not in argv:
            continue
        args = train._parse(argv[argv.index("etp.train") + 1:])  # unknown flags exit here
        run_keys = {"train_iters": args.train_iters, "log_interval": args.log_interval}
        overrides = {**parse_overrides(args.set), **{k: v for k, v in run_keys.items() if v is not None}}
        recipe = Recipe.from_yaml(ROOT / args.recipe, **overrides)  # removed or invalid keys raise here
        if args.tune:  # --tune launches its own runs on the visible GPUs
            assert "--nproc-per-node" not in argv, command
            continue
        world = int(argv[argv.index("--nproc-per-node") + 1])
        # as etp-train resolves it under torchrun on one host of 80 GiB sm90 GPUs
        recipe, _ = resolve_auto(recipe, Machine(world, world, cuda=True, gpu_memory=80 * 2**30, sm90=True))
        assert recipe.parallel.world_size == world, command
        recipe.check_world_size(world)
        found += 1
    assert found >= 12


def test_every_tool_flag_and_test_file_named_exists():
    for command in _commands(4):
        argv = shlex.split(command)
        for word in argv:
            if word.startswith(("tools/", "tests/")):
                assert (ROOT / word).exists(), (word, command)
        tool = next((w for w in argv if w.startswith("tools/") and w.endswith(".py")), None)
        if tool:
            source = (ROOT / tool).read_text()
            for flag in (w for w in argv[argv.index(tool) + 1:] if w.startswith("--")):
                assert f'"{flag}"' in source or f"'{flag}'" in source, (flag, tool)


def test_a_command_past_its_timeout_is_ended(tmp_path):
    sleeper = f"python3 -c {shlex.quote('import time; time.sleep(60)')}"
    step = Step("sleeper", "test", (Run("sleep", sleeper, 1, 1, 2),))
    began = time.monotonic()
    outcome = run_step(step, "[1/1]", tmp_path, tmp_path, 2, deadline=time.monotonic() + 60)
    assert outcome.rc == 124 and time.monotonic() - began < 30
    assert "TIMEOUT" in (tmp_path / "sleeper" / "sleep.log").read_text()


def test_a_step_that_does_not_fit_the_budget_is_skipped(tmp_path):
    step = Step("big", "test", (Run("x", "python3 -c pass", 1, 500, 600),))
    outcome = run_step(step, "[1/1]", tmp_path, tmp_path, 2, deadline=time.monotonic() + 100)
    assert outcome.rc is None and outcome.note.startswith("skipped: needs ~500 s")
    assert not (tmp_path / "big").exists()


def test_headlines_read_the_steady_state_mean_and_pytest_summary(tmp_path):
    log = [{"iteration": i, "ms_per_iter": 1000.0 if i < 5 else 300.0 + i, "tflops_per_rank": 100.0}
           for i in range(1, 21)]
    figures = headlines.steady({"log": log, "peak_allocated_gib": 40.0})
    assert figures["iterations"] == 16 and figures["ms"] == pytest.approx(300 + sum(range(5, 21)) / 16)
    step = Step("tests_x", "GPU test suites", (Run("tests_x", "python3 -m pytest", 1, 1, 1),), headlines.pytest)
    (tmp_path / "tests_x.log").write_text("....\n12 passed, 2 skipped in 33.1s\n")
    assert headlines.pytest(step, tmp_path) == "12 passed, 2 skipped in 33.1s"

