"""GPU (torchrun, NCCL, the default copy-engine transports): a rank killed (SIGKILL) mid-step
ends every other rank within 60 s (none left spinning on a stream wait or a flag), the last
checkpoint stays intact, and a resume from it reproduces the uninterrupted run bit for bit
(``deterministic: true``). Runs at 2 GPUs and, where present, 4 (``ETP_TEST_SIZES``).

Run with ``ETP_TEST_BACKEND=nccl`` on a machine with 2+ GPUs; skipped otherwise.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import backend

ROOT = Path(__file__).resolve().parents[2]
SIZES = [int(s) for s in os.environ.get("ETP_TEST_SIZES", "2,4").split(",") if int(s) <= torch.cuda.device_count()]

pytestmark = pytest.mark.skipif(backend() != "nccl" or torch.cuda.device_count() < 2,
                                reason="needs ETP_TEST_BACKEND=nccl and 2 GPUs")

# A small model of the flagship's kind (its checkpoints ~1.4 GB: a save is seconds, not minutes),
# one schedule of 400 iterations for every run (the uninterrupted and the resumed ones stop at 4),
# a checkpoint every 2, bitwise-reproducible kernels.
SMALL = {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 8, "num_query_groups": 8,
         "ffn_hidden_size": 2816, "num_experts": 8, "moe_ffn_hidden_size": 512}
ARGS = ["--recipe", str(ROOT / "recipes" / "moe_flagship.yaml"),
        *(arg for key, value in SMALL.items() for arg in ("--set", f"{key}={value}")),
        "--train-iters", "400", "--log-interval", "1", "--set", "save_interval=2", "--set", "deterministic=true", "--set", "cuda_graph=none"]


def _torchrun(world: int, *argv) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "etp.train", *ARGS, "--set", f"global_batch_size={2 * world}", *argv]


def _workers(pid: int) -> list[int]:
    """The rank processes torchrun started: its descendants running etp.train."""
    parent, cmdlines = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:
                continue

    def descends(p: int) -> bool:
        while p in parent and p != pid:
            p = parent[p]
        return p == pid

    return sorted(p for p in parent if p != pid and descends(p) and b"etp.train" in cmdlines.get(p, b"")
                  and b"torch.distributed.run" not in cmdlines.get(p, b""))


@pytest.mark.parametrize("world", SIZES)
def test_a_rank_killed_mid_step_ends_the_run_and_a_resume_reproduces_it(world, tmp_path):
    full = subprocess.run(_torchrun(world, "--set", f"save={tmp_path / 'full'}", "--exit-after", "4",
                                    "--json", str(tmp_path / "full.json")), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    proc = subprocess.Popen(_torchrun(world, "--set", f"save={tmp_path / 'ckpt'}"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "saved iteration 2" in line:
            break
    workers = _workers(proc.pid)
    assert len(workers) == world, workers
    os.kill(workers[-1], signal.SIGKILL)
    killed_at = time.monotonic()
    proc.communicate(timeout=180)
    ended = time.monotonic() - killed_at
    assert proc.returncode != 0
    assert ended < 60, f"the other ranks took {ended:.0f} s to end"
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "2"
    resumed = subprocess.run(_torchrun(world, "--set", f"save={tmp_path / 'ckpt'}", "--resume", "--exit-after", "4",
                                       "--json", str(tmp_path / "resumed.json")), cwd=ROOT, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = json.loads((tmp_path / "full.json").read_text())["losses"]
    got = json.loads((tmp_path / "resumed.json").read_text())["losses"]
    assert got == want[2:], (got, want)
