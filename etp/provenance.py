"""Where a measurement came from: what every benchmark JSON (and ``etp-train --json``) records
beside its figures, so that a figure in BENCHMARKS.md can be traced to the command, the GPUs
and the code that produced it.
"""
from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = ["run_provenance"]


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _command(argv: list[str] | None) -> str:
    """The command that reproduces this run: under torchrun the launcher as typed (a worker's
    own argv is ``python script ...``), and ``-m package.module`` rather than the module's path."""
    args = list(sys.argv if argv is None else argv)
    root = Path(__file__).resolve().parents[1]
    if args and args[0].endswith(".py"):
        script = Path(args[0]).resolve()
        if root in script.parents and script.parts[len(root.parts)] == "etp":
            module = script.relative_to(root).with_suffix("").parts
            args[:1] = ["-m", ".".join(module[:-1] if module[-1] == "__main__" else module)]
        elif root in script.parents:
            args[0] = str(script.relative_to(root))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun in every worker
        return shlex.join(["torchrun", "--standalone", f"--nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', '1')}",
                           *args])
    return shlex.join([Path(sys.executable).name, *args])


def run_provenance(argv: list[str] | None = None) -> dict:
    """The command line, GPU name and count, commit (and whether the tree had uncommitted
    changes to tracked files), date, torch and Python versions of this process's run.

    ``world_size`` is the launcher's (``WORLD_SIZE``, else 1); ``gpu_count`` the GPUs this host
    shows. Outside a git checkout (an installed wheel) ``commit`` is None; ``dirty`` True means
    the code that ran is not exactly ``commit``.

    Example::

        report = {"figures": ..., "provenance": run_provenance()}
    """
    import torch

    cuda = torch.cuda.is_available()
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": _command(argv),
        "gpu_name": torch.cuda.get_device_name() if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "commit": _git("rev-parse", "--short=12", "HEAD"),
        "dirty": None if status is None else bool(status),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
