"""Runs the steps within a time budget: each command in its own process group with its own
timeout (a timeout ends torchrun *and* its workers, which hold the GPUs), a progress line as
each starts and ends, the log beside the JSON in the step's folder, and a step that no longer
fits the budget skipped and reported."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .steps import Run, Step, fill

__all__ = ["Outcome", "command_argv", "command_env", "run_step"]

ROOT = Path(__file__).resolve().parents[2]
MIN_LEFT_S = 20  # a run is not started with less than this left of the budget


@dataclass
class Outcome:
    """What a step did: its return code (None: not run), seconds, headline and files."""

    step: Step
    rc: int | None = None
    seconds: float = 0.0
    headline: str = ""
    note: str = ""
    runs: list = field(default_factory=list)


def command_env(run: Run, gpus: int) -> dict:
    """The environment of ``run``: this checkout first on the path, its GPUs, its variables."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    # The first GPUs of those this process may use (all of them unless CUDA_VISIBLE_DEVICES says).
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(gpus)))
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "4"),
               TORCH_NCCL_ASYNC_ERROR_HANDLING="1", CUDA_VISIBLE_DEVICES=",".join(visible.split(",")[:run.gpus or gpus]))
    env.update(item.split("=", 1) for item in run.env)
    return env


def command_argv(command: str) -> list[str]:
    """``torchrun ...`` / ``python3 ...`` as this interpreter runs them."""
    argv = shlex.split(command)
    if argv[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    if argv[0] == "python3":
        return [sys.executable, *argv[1:]]
    return argv


def _execute(argv: list[str], env: dict, log: Path, timeout_s: float) -> int:
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            out.write(f"\nreproduce: TIMEOUT after {timeout_s:.0f} s\n")
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: torchrun and its workers
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 124


def _tail(log: Path, lines: int = 12) -> str:
    noise = ("warnings.warn", "UserWarning", "FutureWarning", "OMP_NUM_THREADS", "*****")
    try:
        kept = [ln for ln in log.read_text(errors="replace").splitlines() if not any(n in ln for n in noise)]
    except OSError:
        return ""
    return "\n".join("    | " + ln for ln in kept[-lines:])


def run_step(step: Step, index: str, out: Path, scratch: Path, gpus: int, deadline: float) -> Outcome:
    """Runs ``step``'s commands in order into ``out/<step>/`` unless the budget (``deadline``,
    a ``time.monotonic()`` value) cannot hold its estimate."""
    outcome = Outcome(step)
    left = deadline - time.monotonic()
    if left < max(MIN_LEFT_S, step.est_s):
        outcome.note = f"skipped: needs ~{step.est_s} s, {max(0, left):.0f} s of the budget left"
        print(f"[reproduce] {index} {step.name}: {outcome.note}", flush=True)
        return outcome
    folder = out / step.name
    folder.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    for number, run in enumerate(step.runs, 1):
        left = deadline - time.monotonic()
        command = fill(run.command, folder, run, scratch)
        if left < MIN_LEFT_S:
            outcome.runs.append({"name": run.name, "command": command, "rc": None, "note": "budget spent"})
            outcome.rc = outcome.rc or 124
            break
        timeout = min(run.timeout_s, left)
        print(f"[reproduce] {index} {step.name} run {number}/{len(step.runs)} {run.name} "
              f"(timeout {timeout:.0f} s, {left:.0f} s of the budget left): {command}", flush=True)
        started = time.monotonic()
        rc = _execute(command_argv(command), command_env(run, gpus), folder / f"{run.name}.log", timeout)
        seconds = time.monotonic() - started
        print(f"[reproduce] {index} {step.name} {run.name}: rc {rc} in {seconds:.0f} s", flush=True)
        if rc != 0:
            print(_tail(folder / f"{run.name}.log"), flush=True)
        outcome.runs.append({"name": run.name, "command": command, "env": list(run.env), "gpus": run.gpus,
                             "rc": rc, "seconds": round(seconds, 1), "log": f"{step.name}/{run.name}.log"})
        outcome.rc = outcome.rc or rc  # the first failure's code
        if rc != 0 and step.stop_on_failure:
            break
    outcome.seconds = time.monotonic() - began
    try:
        outcome.headline = step.headline(step, folder)
    except Exception as exc:  # noqa: BLE001 - a headline must never sink the run
        outcome.headline = f"(no headline: {type(exc).__name__}: {exc})"[:160]
    return outcome
