"""Two "hosts" on one machine (docs/multinode.md): two torchrun processes of 2 ranks each meet
through a c10d rendezvous on localhost and train the CPU recipe as one run of 4 ranks, with
``auto`` placing ETP within each host (its ``LOCAL_WORLD_SIZE``) and data parallelism across."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_two_hosts(tmp_path: Path, *extra: str, iters: int = 4) -> list[subprocess.CompletedProcess]:
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"two-hosts-{tmp_path.name}",
         "-m", "etp.train", "--recipe", str(ROOT / "recipes" / "tiny_moe_cpu.yaml"), "--set", "world_size=4",
         "--set", "global_batch_size=16", "--train-iters", str(iters), "--log-interval", "2",
         "--json", str(tmp_path / f"host{host}.json"), *extra],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for host in (0, 1)]
    done = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
    return done


def test_two_hosts_train_one_run_with_etp_inside_each_host(tmp_path):
    done = _launch_two_hosts(tmp_path)
    assert [d.returncode for d in done] == [0, 0], "\n".join(d.stdout[-3000:] for d in done)
    out = "".join(d.stdout for d in done)
    assert "etp.etp_size auto -> 2: the data-parallel ranks of one host (data-parallel size 4)" in out, out[-3000:]
    assert "etp.expert_etp_size auto -> 2" in out
    reports = [json.loads(p.read_text()) for p in tmp_path.glob("host*.json")]
    assert len(reports) == 1  # global rank 0 writes the run's report, on whichever host holds it
    report = reports[0]
    assert report["world_size"] == 4 and report["etp"]["etp_size"] == 2 and report["etp"]["expert_etp_size"] == 2
    assert len(report["losses"]) == 4 and all(0 < loss < 20 for loss in report["losses"])
