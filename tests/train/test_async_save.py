"""``async_save`` ([Note: async saves] in etp/megatron/checkpoint/background.py): the step does
not wait for the disk, the checkpoint holds what a synchronous save writes, a resume from it
reproduces the run, exits wait for the save in flight, and a save in flight at a kill never
becomes ``latest``. Each run is a real ``python -m etp.train`` on the CPU recipe (2 gloo ranks);
``ETP_CHECKPOINT_WRITE_DELAY_S`` holds each background write for that long."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# Three etp-train runs (~1 min on 2 cores) for an opt-in key: run with -m slow (the restart and
# run-ID tests are default).
pytestmark = pytest.mark.slow

pytest.importorskip("megatron.core")
ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_moe_cpu.yaml")
DELAY_S = 5.0
# 8 iterations' schedule, stopped by exit_interval after 6; a save every 3 (at 3, and 6 at the exit)
RUN = ["--train-iters", "8", "--log-interval", "1", "--set", "eval_iters=0", "--set", "save_interval=3",
       "--set", "exit_interval=6"]


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}


def _etp_train(*argv, env=None):
    done = subprocess.run([sys.executable, "-m", "etp.train", "--recipe", TINY, *argv], cwd=ROOT, env=env or _env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _losses(report: Path) -> dict[int, float]:
    """Every iteration's loss in the run's metrics stream (what a killed run kept)."""
    from etp.train.metrics import read_stream

    return {r["iteration"]: r["loss"] for r in read_stream(report.with_suffix(".jsonl"))[0] if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The synchronous run; the same run with async_save (each write held DELAY_S) into
    load = save, killed while its last save (at 6) is written; and the same command again,
    which restarts from 3 and exits 0 once its own save at 6 is written."""
    tmp = tmp_path_factory.mktemp("async")
    _etp_train(*RUN, "--set", f"save={tmp / 'sync'}", "--json", str(tmp / "sync.json"))
    ckpt = tmp / "async"
    command = [sys.executable, "-m", "etp.train", "--recipe", TINY, *RUN, "--set", "async_save=true",
               "--set", f"load={ckpt}", "--set", f"save={ckpt}"]
    env = _env(ETP_CHECKPOINT_WRITE_DELAY_S=str(DELAY_S))
    proc = subprocess.Popen([*command, "--json", str(tmp / "killed.json")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append((time.monotonic(), line))
        if line.startswith("iter     6/"):  # logged after its save began: that write is held DELAY_S
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: this test's own process group
            break
    proc.wait(timeout=60)
    killed = {"latest": (ckpt / "latest").read_text().strip(), "published": sorted(p.name for p in ckpt.glob("iter_*"))}
    restarted = subprocess.run([*command, "--json", str(tmp / "restarted.json")], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=300)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    return tmp, lines, killed, restarted.stdout


def _at(lines, pattern: str) -> float:
    return next(t for t, line in lines if re.search(pattern, line))


def test_the_step_does_not_wait_for_the_write(runs):
    _, lines, _, _ = runs
    began, saved = _at(lines, r"saving iteration 3 in the background"), _at(lines, r"saved iteration 3 to ")
    assert saved - began >= DELAY_S  # the write was held ...
    assert _at(lines, r"^iter +3/") - _at(lines, r"^iter +2/") < DELAY_S / 2  # ... and iteration 3's save did not wait
    assert _at(lines, r"^iter +4/") < saved  # training went on while it was written


def test_a_kill_while_the_write_is_in_flight_leaves_latest_at_the_previous_checkpoint(runs):
    tmp, lines, killed, _ = runs
    assert any("saving iteration 6 in the background" in line for _, line in lines)
    assert killed == {"latest": "3", "published": ["iter_0000003"]}
    from etp.megatron.checkpoint import verify_checkpoint

    verify_checkpoint(tmp / "async" / "iter_0000003")  # whole, every sha256 as its manifest says


def test_an_async_checkpoint_holds_the_synchronous_saves_tensors(runs):
    """Every tensor and every pickled object of the async checkpoint at iteration 3 equals the
    synchronous save's of the same run (the same training state, bit for bit)."""
    tmp, _, _, _ = runs
    reference = _losses(tmp / "sync.json")
    assert _losses(tmp / "killed.json") == {i: reference[i] for i in range(1, 7)}
    sync, async_ = (_read_checkpoint(tmp / name / "iter_0000003") for name in ("sync", "async"))
    assert sync.keys() == async_.keys() and len(sync) > 20
    for key, value in sync.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, async_[key]), key
        else:
            assert value == async_[key], key


def test_the_restart_resumes_the_async_checkpoint_reproduces_the_run_and_waits_to_exit(runs):
    """The same command after the kill resumes at 3 and logs the synchronous run's losses of
    iterations 4-6 (what a resume from its synchronous save logs: test_no_lost_work); its exit
    (exit_interval) waited for its save at 6, which carries the run ID it resumed."""
    tmp, _, _, out = runs
    assert "holds iteration 3: resuming from it" in out
    reference = _losses(tmp / "sync.json")
    assert _losses(tmp / "restarted.json") == {i: reference[i] for i in range(4, 7)}
    assert (tmp / "async" / "latest").read_text().strip() == "6"
    assert "saved iteration 6 to " in out
    ids = {json.loads((tmp / "async" / f"iter_000000{i}" / "etp_manifest.json").read_text())["metadata"]["run"]["id"]
           for i in (3, 6)}
    assert len(ids) == 1


def _read_checkpoint(directory: Path) -> dict:
    """Every tensor and object of a torch_dist checkpoint, read by torch DCP in this process
    (the test's own files: full unpickling is fine here)."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata)
             else io.BytesIO() for key, meta in reader.read_metadata().state_dict_metadata.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    common = torch.load(directory / "common.pt", weights_only=False)
    return {**state, **{f"common.{key}": value for key, value in common.items()}}
