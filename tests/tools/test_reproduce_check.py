"""tools/reproduce.py --check ([Note: the regression check]): the figures each reader takes
from a report, the verdicts (more than 10 % slower or a changed correctness figure fails; a
figure no longer measured does not), and every reported file the steps name exists, is cited
by BENCHMARKS.md and is of the GPU kind it is filed under."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from repro import check  # noqa: E402
from repro.steps import build_steps  # noqa: E402


def _runs_with_figures():
    seen = {}
    for n in (1, 2, 4, 8):
        for step in build_steps(n):
            for run in step.runs:
                if run.figures:
                    seen[(step.name, run.name)] = (step, run)
    return list(seen.values())


def test_gpu_kind_is_the_benchmarks_file_tag():
    assert check.gpu_kind("NVIDIA H200", 1) == "1xh200"
    assert check.gpu_kind("NVIDIA H100 80GB HBM3", 4) == "4xh100"


def test_one_gpu_runs_the_steps_that_fit_it():
    steps = build_steps(1)
    assert [s.name for s in steps] == ["kernels_1gpu", "cross_entropy_1gpu", "recipes_1gpu", "tests_kernels",
                                       "tests_megatron", "torchtitan_1gpu", "run_costs_1gpu", "hf_round_trip_1gpu"]
    assert all(run.gpus <= 1 for s in steps for run in s.runs)


def test_every_reported_file_exists_is_cited_and_is_of_its_kind():
    report = (ROOT / "BENCHMARKS.md").read_text()
    named = 0
    for step, run in _runs_with_figures():
        assert run.figures in check.FIGURES, (step.name, run.name)
        for kind, name in run.reported.items():
            path = ROOT / "benchmarks" / name
            assert path.exists(), name
            assert name in report, f"{name} is not cited in BENCHMARKS.md"
            assert f"_{kind}_" in name, (kind, name)
            figures = check.FIGURES[run.figures](json.loads(path.read_text()))
            assert figures, f"the {run.figures} reader finds no figure in {name}"
            named += 1
    assert named >= 6


def test_verdicts():
    reported = {"a (of copy bw)": (0.80, "higher"), "b ms": (10.0, "lower"), "exact": (True, "exact"),
                "gone": (1.0, "higher")}
    rows = {c.figure: c for c in check.compare_figures("r", reported, {
        "a (of copy bw)": (0.75, "higher"), "b ms": (11.5, "lower"), "exact": (True, "exact"), "fresh": (3.0, "lower")})}
    assert rows["a (of copy bw)"].verdict == "ok" and rows["a (of copy bw)"].speed == pytest.approx(0.9375)
    assert rows["b ms"].verdict == "SLOWER" and rows["b ms"].failed  # 10 / 11.5 = 0.87
    assert rows["exact"].verdict == "ok"
    assert rows["gone"].verdict == "not measured today" and not rows["gone"].failed
    assert rows["fresh"].verdict == "new" and not rows["fresh"].failed
    changed = check.compare_figures("r", {"exact": (True, "exact")}, {"exact": (False, "exact")})
    assert changed[0].verdict == "CHANGED" and changed[0].failed


def test_the_table_passes_the_reported_run_and_fails_a_slower_one(tmp_path):
    step = next(s for s in build_steps(1) if s.name == "kernels_1gpu")
    run = step.runs[0]
    folder = tmp_path / step.name
    folder.mkdir()
    for each in step.runs:  # the kernels and the AdamW step, both reported on an H200
        shutil.copy(ROOT / "benchmarks" / each.reported["1xh200"], folder / f"{each.name}.json")
    table, failed = check.check_table([step], tmp_path, "1xh200")
    assert not failed and "SLOWER" not in table and "| ok |" in table
    table, _ = check.check_table([step], tmp_path, "1xa100")
    assert "no figure reported for 1xa100" in table  # nothing to compare on another GPU kind
    slow = json.loads((folder / f"{run.name}.json").read_text())
    slow["targets"]["amax"]["fraction_of_copy_bw"] *= 0.85
    (folder / f"{run.name}.json").write_text(json.dumps(slow))
    table, failed = check.check_table([step], tmp_path, "1xh200")
    assert failed and "| amax (of copy bw) |" in table and "SLOWER" in table
    (folder / f"{run.name}.json").unlink()
    table, failed = check.check_table([step], tmp_path, "1xh200")
    assert failed and "no fresh JSON" in table
