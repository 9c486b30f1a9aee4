"""What an etp-train run was asked for beyond its recipe, and the error it reports as one line."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RunOptions", "TrainError"]


class TrainError(ValueError):
    """An input error of a run (a path, a checkpoint directory, a setting): etp-train prints its
    message as one line, from one rank, and exits with status 2. Every message names what is
    wrong and how to fix it."""


@dataclass(frozen=True)
class RunOptions:
    """The command-line options of a run (``etp-train --help``).

    Args:
        json_path: write the run's figures (losses, step times, TFLOP/s, memory, provenance).
        audit_path: record per-phase memory and write every rank's audit against the prediction.
        resume: continue from the latest checkpoint (True) or from this iteration.
        exit_after: stop after this iteration (the schedule still spans ``train_iters``).
        profile_dir: torch-profile a few steady-state iterations into this directory.
        timeline: measure, unprofiled, how far the device runs behind the host per phase.
        overwrite: a fresh run may replace the checkpoints already in its ``save`` directory.

    Example::

        RunOptions(json_path="run.json", resume=True)
    """

    json_path: str | None = None
    audit_path: str | None = None
    resume: bool | int = False
    exit_after: int | None = None
    profile_dir: str | None = None
    timeline: bool = False
    overwrite: bool = False
