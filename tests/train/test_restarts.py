"""A run you can leave alone ([Note: restarts], [Note: early exits]): with ``load`` = ``save`` the
same command line starts fresh, and once a SIGTERM has made the run save and exit 0, resumes
from that checkpoint and logs the losses the uninterrupted run logged."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from etp.megatron.checkpoint.manifest import find_latest

ROOT = Path(__file__).resolve().parents[2]
ITERS = 10


def _command(ckpt: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "etp.train", "--recipe", str(ROOT / "recipes" / "tiny_moe_cpu.yaml"),
            "--train-iters", str(ITERS), "--log-interval", "1", "--set", "eval_interval=1000", "--set", "eval_iters=0",
            *(["--set", f"load={ckpt}", "--set", f"save={ckpt}"] if ckpt else []), *extra]


def _losses(out: str) -> dict[int, float]:
    return {int(i): float(loss) for i, loss in re.findall(r"^iter\s+(\d+)/\d+ \| loss ([0-9.]+)", out, re.M)}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_sigterm_saves_exits_0_and_the_same_command_resumes_the_uninterrupted_losses(tmp_path):
    uninterrupted = subprocess.run(_command(None), cwd=tmp_path, env=_env(), capture_output=True, text=True,
                                   timeout=600)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    reference = _losses(uninterrupted.stdout)
    assert sorted(reference) == list(range(1, ITERS + 1))

    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(_command(ckpt, "--set", "exit_signal_handler=true"), cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # SIGTERM once the run has logged iteration 3, as a scheduler would
        seen.append(line)
        if line.startswith("iter     3/"):
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=300) == 0, out[-3000:]
    assert "holds no checkpoint yet: starting fresh" in out
    stopped = int(re.search(r"stopping after iteration (\d+): SIGTERM received", out).group(1))
    assert 3 <= stopped < ITERS
    assert find_latest(ckpt) == stopped  # the SIGTERM's save is the directory's latest

    again = subprocess.run(_command(ckpt, "--set", "exit_signal_handler=true"), cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"holds iteration {stopped}: resuming from it" in again.stdout
    resumed = _losses(again.stdout)
    assert sorted(resumed) == list(range(stopped + 1, ITERS + 1))
    for i, loss in resumed.items():
        assert abs(loss - reference[i]) <= 1e-4 * reference[i], (i, loss, reference[i])

