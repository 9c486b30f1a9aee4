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


def test_pretrained_checkpoint_fine_tunes_once_and_the_same_command_resumes(tmp_path):
    """Megatron-LM's ``pretrained_checkpoint`` ([Note: fine-tuning]): the first start fine-tunes from
    it (iteration 1 on, the weights of the checkpoint), an exit interval saves and stops it, and the
    same command resumes from load = save and logs what one uninterrupted fine-tune logs."""
    pretrained = tmp_path / "pretrained"
    made = subprocess.run(_command(None, "--set", f"save={pretrained}", "--train-iters", "3"), cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]

    def fine_tune(ckpt, *extra):
        return subprocess.run(_command(ckpt, "--set", f"pretrained_checkpoint={pretrained}", *extra), cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=600)

    whole = fine_tune(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "holds no checkpoint yet: fine-tuning from pretrained_checkpoint=" in whole.stdout
    reference = _losses(whole.stdout)
    assert sorted(reference) == list(range(1, ITERS + 1))
    scratch = _losses(made.stdout)  # the same seed and samples: a fresh start's first loss
    assert abs(reference[1] - scratch[1]) > 1e-3  # it started from the pretrained weights, not from scratch

    ckpt = tmp_path / "ckpt"
    first = fine_tune(ckpt, "--set", "exit_interval=4")
    assert first.returncode == 0 and find_latest(ckpt) == 4, first.stdout[-3000:]
    again = fine_tune(ckpt)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "holds iteration 4: resuming from it" in again.stdout
    resumed = _losses(again.stdout)
    assert sorted(resumed) == list(range(5, ITERS + 1))
    for i, loss in {**_losses(first.stdout), **resumed}.items():
        assert abs(loss - reference[i]) <= 1e-4 * reference[i], (i, loss, reference[i])
