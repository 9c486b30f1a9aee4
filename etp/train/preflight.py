"""Every check of a run that needs no process group, made before any rank starts work: in the
launching process for CPU runs, and on every rank before its process group under torchrun
(rank 0 alone reports). A failure is one line naming what is wrong and the fix.
"""
from __future__ import annotations

from pathlib import Path

from etp.train.checkpointing import check_checkpoint_dirs
from etp.train.options import RunOptions, TrainError

__all__ = ["preflight"]


def _output_file(flag: str, path: str | None) -> None:
    """``path`` can be written: its directory exists (made here) and is a directory."""
    if path is None:
        return
    parent = Path(path).expanduser().resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise TrainError(f"{flag} {path}: cannot create its directory {parent} ({error.strerror or error}): "
                         "choose another path") from None
    if Path(path).is_dir():
        raise TrainError(f"{flag} {path} is a directory: give a file path, e.g. {Path(path) / 'run.json'}")


def _megatron_fsdp_can_run(recipe) -> None:
    """What ``use_megatron_fsdp`` needs of the machine (the recipe checked the rest)."""
    from etp.train.baselines.megatron_fsdp import unmet_requirement

    if recipe.parallel.backend == "gloo":
        raise TrainError("use_megatron_fsdp needs backend nccl (megatron-core's Megatron-FSDP runs on CUDA "
                         "GPUs): set backend=nccl (or auto) and run it under torchrun on GPUs")
    reason = unmet_requirement()
    if reason is not None:
        raise TrainError(f"use_megatron_fsdp {reason}")


def preflight(recipe, options: RunOptions) -> list[str]:
    """Checks the recipe's data, the output paths and the checkpoint directories of a run;
    returns the notes to print before it starts (a clipped warm-up, what ``--overwrite``
    deletes, where the run resumes). Raises ``TrainError`` / ``RecipeError`` otherwise.

    Example::

        for note in preflight(recipe, RunOptions(resume=True)):
            print(f"etp-train: {note}")
    """
    from etp.data.checks import check_data

    notes = []
    recipe.resolve_data_path()  # RecipeError naming `data` when the corpus is missing
    _output_file("--json", options.json_path)
    _output_file("--audit", options.audit_path)
    if options.audit_path and recipe.parallel.fsdp_peer:
        raise TrainError(f"--audit does not model {recipe.parallel.fsdp_peer} (it models DDP, the distributed "
                         "optimizer and ETP, not an FSDP's sharded buffers): drop --audit; --json reports the "
                         "measured peak memory")
    if recipe.parallel.use_megatron_fsdp:
        _megatron_fsdp_can_run(recipe)
    if options.profile_dir is not None:
        try:
            Path(options.profile_dir).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise TrainError(f"--profile {options.profile_dir}: cannot create it ({error.strerror or error})") from None
    t = recipe.train
    if t.warmup_clipped_from is not None:
        why = (f"is longer than train_iters={t.train_iters}" if t.warmup_clipped_from > t.train_iters
               else f"leaves no iteration to decay over (lr_decay_iters={t.lr_decay_iters})")
        notes.append(f"lr_warmup_iters={t.warmup_clipped_from} {why}: the warm-up is clipped to "
                     f"{t.lr_warmup_iters} iterations")
    from etp.train.metrics import missing_packages

    missing = missing_packages(recipe)
    if missing:
        raise TrainError(f"tensorboard_dir / wandb_project need {', '.join(missing)}: pip install "
                         f"{' '.join(missing)} (or etp[metrics])")
    if options.exit_after is not None and options.exit_after < 1:
        raise TrainError(f"--exit-after {options.exit_after}: must be >= 1 (the last iteration to run)")
    notes += check_checkpoint_dirs(recipe, options)
    try:  # data_path / mock_data: files, tokenizer, splits (etp.data.checks); last: a tokenizer loads for seconds
        notes += check_data(recipe)
    except ValueError as error:
        raise TrainError(str(error)) from None
    return notes
