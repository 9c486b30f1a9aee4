"""etp-train as a new user meets it: a checkpoint directory is never clobbered by accident,
input errors are one line before any rank starts, short and finished runs work, and a rank
killed mid-step ends the run (with the last checkpoint intact and a resume reproducing the
run). Each run is a real ``python -m etp.train`` process on the CPU recipe."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_moe_cpu.yaml")


def _etp_train(*argv, timeout=240):
    done = subprocess.run([sys.executable, "-m", "etp.train", "--recipe", TINY, *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if "Warning" not in line and "warn(" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """4 iterations of the tiny recipe (its warm-up is 5) saving into ``ckpt`` every 3 (so at 3,
    and at its end, 4, which the interval does not reach): (rc, stdout, stderr, the directory)."""
    tmp = tmp_path_factory.mktemp("short")
    rc, out, err = _etp_train("--train-iters", "4", "--log-interval", "2", "--set", f"save={tmp / 'ckpt'}",
                              "--set", "save_interval=3", "--json", str(tmp / "first.json"))
    return rc, out, err, tmp


def test_a_short_run_clips_the_warm_up_and_saves_at_its_end(short_run):
    rc, out, err, tmp = short_run
    assert rc == 0, err
    assert "lr_warmup_iters=5 is longer than train_iters=4" in out
    assert "saved iteration 3" in out and "saved iteration 4" in out
    assert (tmp / "ckpt" / "latest").read_text().strip() == "4"


def test_a_fresh_run_into_another_runs_checkpoints_is_refused(short_run):
    _, _, _, tmp = short_run
    before = sorted(p.name for p in (tmp / "ckpt").iterdir())
    rc, out, err = _etp_train("--train-iters", "2", "--set", f"save={tmp / 'ckpt'}")
    assert rc == 2 and "iter " not in out
    line = _one_line(err)
    assert "already holds checkpoints" in line and "--resume" in line and "--overwrite" in line
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == before
    assert (tmp / "ckpt" / "latest").read_text().strip() == "4"


@pytest.mark.slow  # a finished run's report; the restart tests resume for real
def test_resuming_a_finished_run_says_so_and_writes_its_report(short_run):
    _, _, _, tmp = short_run
    rc, out, err = _etp_train("--train-iters", "4", "--set", f"save={tmp / 'ckpt'}", "--resume",
                              "--json", str(tmp / "again.json"))
    assert rc == 0, err
    assert "nothing to do" in out
    report = json.loads((tmp / "again.json").read_text())
    assert report["losses"] == [] and report["ms_per_iter"] is None
    assert report["provenance"]["command"]


@pytest.mark.slow  # a second run on top of the shared one; the one-line refusals before any rank starts are default
def test_resuming_an_older_iteration_into_the_same_directory_is_refused(short_run, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(short_run[3] / "ckpt", ckpt)  # iterations 3 and 4; the other tests read the original
    rc, _, err = _etp_train("--train-iters", "4", "--set", f"save={ckpt}", "--resume", "3")
    assert rc == 2 and "would replace iterations [4]" in _one_line(err)
    rc, out, err = _etp_train("--train-iters", "4", "--set", f"save={ckpt}", "--resume", "3", "--overwrite")
    assert rc == 0, err
    assert "deleted checkpoints [4]" in out and "saved iteration 4" in out


@pytest.mark.parametrize("case", ["unwritable_save", "resume_without_checkpoint", "missing_data", "json_is_a_dir"])
def test_input_errors_are_one_line_before_any_rank_starts(case, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    argv = {
        "unwritable_save": ["--set", f"save={blocker / 'ckpt'}"],
        "resume_without_checkpoint": ["--set", f"save={tmp_path / 'empty'}", "--resume"],
        "missing_data": ["--set", f"data_path={tmp_path / 'nope'}"],
        "json_is_a_dir": ["--json", str(tmp_path)],
    }[case]
    expect = {"unwritable_save": "not a writable directory", "resume_without_checkpoint": "holds no checkpoint",
              "missing_data": "no such file", "json_is_a_dir": "is a directory"}[case]
    began = time.monotonic()
    rc, out, err = _etp_train("--train-iters", "2", *argv)
    assert rc == 2 and "iter " not in out
    assert expect in _one_line(err)
    assert time.monotonic() - began < 30  # no rank was started


def test_a_save_directory_without_room_is_refused(tmp_path, monkeypatch):
    import shutil

    from etp.recipe import Recipe
    from etp.train import RunOptions, TrainError
    from etp.train.checkpointing import check_checkpoint_dirs, checkpoint_bytes

    recipe = Recipe.from_yaml(TINY, save=str(tmp_path))
    assert checkpoint_bytes(recipe) == recipe.num_params() * 12  # fp32 weights + Adam's two moments
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=checkpoint_bytes(recipe)))
    with pytest.raises(TrainError, match="GiB free; a checkpoint of this recipe takes about"):
        check_checkpoint_dirs(recipe, RunOptions())


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return sorted(found)


@pytest.mark.slow  # three runs; tests/train/test_restarts.py resumes a SIGTERM'd run to the same losses by default
def test_a_rank_killed_mid_step_ends_the_run_and_a_resume_reproduces_it(tmp_path):
    """SIGKILL one of the two ranks after the checkpoint at iteration 4: the run ends (the other
    rank's collectives fail on the lost peer) within 60 s, naming the killed rank; the last
    checkpoint is intact, and resuming from it gives the losses of an uninterrupted run."""
    # One schedule (400 iterations) for all three runs; the uninterrupted and the resumed ones stop at 8.
    args = ["--train-iters", "400", "--log-interval", "1", "--set", "save_interval=4"]
    rc, _, err = _etp_train(*args, "--set", f"save={tmp_path / 'full'}", "--exit-after", "8",
                            "--json", str(tmp_path / "full.json"))
    assert rc == 0, err
    proc = subprocess.Popen([sys.executable, "-m", "etp.train", "--recipe", TINY, *args,
                             "--set", f"save={tmp_path / 'ckpt'}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    for line in proc.stdout:
        if "saved iteration 4" in line:
            break
    ranks = _children(proc.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[1], signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - killed_at < 60
    assert proc.returncode == 1 and "killed by SIGKILL" in err, err
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "4"
    rc, _, err = _etp_train(*args, "--set", f"save={tmp_path / 'ckpt'}", "--resume", "--exit-after", "8",
                            "--json", str(tmp_path / "resumed.json"))
    assert rc == 0, err
    full = json.loads((tmp_path / "full.json").read_text())["losses"]
    resumed = json.loads((tmp_path / "resumed.json").read_text())["losses"]
    assert resumed == full[4:]
