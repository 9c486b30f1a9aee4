"""tools/diag/host_sampler.py: samples only the asked iterations, and attributes them to the right lines."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SAMPLER = Path(__file__).resolve().parents[2] / "tools" / "diag" / "host_sampler.py"

# A stand-in for etp-train: the sampler's gate reads the local ``iteration`` of ``train`` in a
# file ending etp/train/main.py. Iterations 3-5 spin in ``inside``, the others in ``outside``.
FAKE_TRAIN = textwrap.dedent("""
    import time

    def spin(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def inside():
        spin(0.05)

    def outside():
        spin(0.05)

    def train():
        for iteration in range(8):
            if 3 <= iteration < 6:
                inside()
            else:
                outside()

    if __name__ == "__main__":
        train()
""")


def _fake_project(tmp_path: Path) -> Path:
    pkg = tmp_path / "etp" / "train"
    pkg.mkdir(parents=True)
    (tmp_path / "etp" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text(FAKE_TRAIN)
    return tmp_path


def test_samples_only_the_gated_iterations(tmp_path):
    root = _fake_project(tmp_path)
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(SAMPLER), "--out", str(out), "--iterations", "3:6",
                    "-m", "etp.train.main"], cwd=root, check=True, timeout=120, capture_output=True)
    report = json.loads((out / "host_samples_rank0.json").read_text())
    assert report["iterations"] == [3, 6] and report["samples"] > 20
    assert 0.1 < report["window_s"] < 1.0  # three iterations of 50 ms, not the whole run (0.4 s)
    inclusive = {row["where"]: row["samples"] for row in report["inclusive"]}
    inside = sum(n for where, n in inclusive.items() if where.endswith("(inside)"))
    outside = sum(n for where, n in inclusive.items() if where.endswith("(outside)"))
    assert inside > 0.8 * report["samples"] and outside < 0.1 * report["samples"], (inside, outside)
    # The innermost lines are the spin loop's, counted in milliseconds of wall time.
    top = report["self"][0]
    assert "(spin)" in top["where"] and top["ms"] > 0


def test_bad_iterations_are_refused(tmp_path):
    root = _fake_project(tmp_path)
    done = subprocess.run([sys.executable, str(SAMPLER), "--out", str(tmp_path / "o"), "--iterations", "6:3",
                           "-m", "etp.train.main"], cwd=root, timeout=60, capture_output=True, text=True)
    assert done.returncode != 0 and "--iterations '6:3'" in done.stderr


@pytest.mark.parametrize("flag", ["--for-s=0", "--interval-ms=-1"])
def test_bad_window_is_refused(tmp_path, flag):
    root = _fake_project(tmp_path)
    done = subprocess.run([sys.executable, str(SAMPLER), "--out", str(tmp_path / "o"), flag,
                           "-m", "etp.train.main"], cwd=root, timeout=60, capture_output=True, text=True)
    assert done.returncode != 0 and "must be positive" in done.stderr


# Iterations of 40 ms; iteration 4 also spends 120 ms in ``lagging``.
UNEVEN_TRAIN = textwrap.dedent("""
    import time

    def spin(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def lagging():  # its own loop: the innermost frame is the place reported
        end = time.perf_counter() + 0.12
        while time.perf_counter() < end:
            pass

    def train():
        for iteration in range(8):
            spin(0.04)
            if iteration == 4:
                lagging()

    if __name__ == "__main__":
        train()
""")


def test_slow_minus_fast_names_where_the_slow_iteration_went(tmp_path):
    root = _fake_project(tmp_path)
    (root / "etp" / "train" / "main.py").write_text(UNEVEN_TRAIN)
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(SAMPLER), "--out", str(out), "--iterations", "1:8",
                    "-m", "etp.train.main"], cwd=root, check=True, timeout=120, capture_output=True)
    report = json.loads((out / "host_samples_rank0.json").read_text())
    per = report["per_iteration_ms"]
    assert sorted(per) == ["2", "3", "4", "5", "6"]  # the window's first and last iterations are cut
    assert per["4"] > 2.5 * per["3"]
    top = report["slow_minus_fast"][0]
    assert top["where"].endswith("(lagging)"), top
    assert 80 < top["ms"] < 160 and top["fast_ms"] == 0


def test_the_gate_names_etp_trains_own_loop():
    # The gate reads the local ``iteration`` of etp-train's ``train``: it must name where that lives.
    import importlib.util

    spec = importlib.util.spec_from_file_location("_sampler", SAMPLER)
    sampler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sampler)
    from etp.train import loop

    assert loop.train.__code__.co_filename.endswith(sampler.TRAIN_FILES) and "iteration" in loop.train.__code__.co_varnames
