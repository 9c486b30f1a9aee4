"""etp-train's checkpoints: when a run saves, where it resumes from, and the rules that keep
one run from destroying another's work.

[Note: a checkpoint directory is never clobbered by accident]
* [Note: restarts] A run given ``load`` resumes from its latest checkpoint, or starts fresh while
  it holds none (``resume_from_load``): with ``load`` = ``save`` every restart continues the run.
* A fresh run (no ``--resume``) whose ``save`` directory already holds checkpoints is refused
  before any rank starts, naming ``--resume`` (continue that run) and ``--overwrite`` (replace
  its checkpoints: they are deleted first, and the run says which).
* A resumed run saves into the directory it resumed from, or into a new one. Resuming from an
  iteration older than the directory's ``latest`` is refused unless ``--overwrite``, which
  deletes the newer checkpoints first: ``latest`` never moves backwards
  (``etp.megatron.checkpoint.publish`` refuses that as well).
* ``save`` without ``save_interval`` saves once, after the run's last iteration; with it,
  every ``save_interval`` iterations and after the last one. Work is never left unsaved at the
  end of a run that has somewhere to save it.
* The save directory must be writable, with room for one checkpoint (``checkpoint_bytes``),
  before the first iteration.

[Note: fine-tuning]
Megatron-LM's keys: ``finetune: true`` loads only ``load``'s model weights (its latest
checkpoint, saved at any layout, or a weights-only one ``etp-convert import-hf`` wrote) and
starts at iteration 0 with a fresh optimizer and learning-rate schedule; the optimizer's main
(fp32) weights are refreshed from the loaded model. ``no_load_optim: true`` makes ``--resume``
load the model and the iteration but not the optimizer state. ``skip_train: true`` trains
nothing: the loaded weights are evaluated and their loss printed (and returned). A
weights-only checkpoint cannot be resumed (no optimizer state, no run to continue): ``--resume``
on one is refused, naming ``finetune``. A run started from a checkpoint that carries its
Hugging Face ``config.json`` (an import) carries it on in its own saves, so ``etp-convert
export-hf`` knows the architecture.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from etp.train.options import RunOptions, TrainError

__all__ = ["Checkpointing", "check_checkpoint_dirs", "checkpoint_bytes", "resume_from_load"]

#: Free space a save needs beyond the checkpoint's tensors (metadata, manifests, rounding).
SAVE_MARGIN = 1.05


def checkpoint_bytes(recipe) -> int:
    """Bytes of one checkpoint of ``recipe``: every logical parameter in its training dtype,
    plus the optimizer's fp32 master weights (mixed precision) and Adam's two fp32 moments.

    Example::

        checkpoint_bytes(Recipe.from_yaml("recipes/moe_flagship.yaml")) / 2**30
    """
    mixed = recipe.train.bf16 or recipe.train.fp16
    per_param = (2 + 4 + 8) if mixed else (4 + 8)
    return recipe.num_params() * per_param


def _latest(root: Path) -> tuple[int | None, list[int]]:
    from etp.megatron.checkpoint.manifest import find_latest, list_checkpoints

    return find_latest(root), list_checkpoints(root)


#: manifest metadata a run carries on from the checkpoint it started from
CARRIED_METADATA = ("hf_config", "hf_generation_config")


def _metadata(root: Path, iteration: int) -> dict:
    from etp.megatron.checkpoint.manifest import iteration_dir, verify_checkpoint

    return verify_checkpoint(iteration_dir(root, iteration), verify_hashes=False).get("metadata", {})


def _check_loading(recipe, options: RunOptions, load: Path | None) -> list[str]:
    """[Note: fine-tuning]'s checks: what ``finetune``, ``no_load_optim`` and ``skip_train`` need."""
    t = recipe.train
    if t.finetune and options.resume:
        raise TrainError("--resume continues a run (its optimizer and iteration) and finetune: true starts one from "
                         "weights only: drop one of them")
    if t.skip_train and not (t.finetune or options.resume):
        raise TrainError("skip_train: true evaluates loaded weights: add --set finetune=true (or --resume)")
    if t.no_load_optim and not options.resume:
        raise TrainError("no_load_optim: true applies to --resume (finetune loads no optimizer state already): "
                         "add --resume or remove no_load_optim")
    if not t.finetune:
        return []
    latest, published = _latest(load)
    if latest is None:
        raise TrainError(f"finetune: load={load} holds no checkpoint (no 'latest' marker; published: "
                         f"{published or 'none'}): point load at an etp-train save or an etp-convert import-hf output")
    return [f"fine-tuning from the model weights of {load} (iteration {latest}); iteration, optimizer and "
            "schedule start fresh"]


def resume_from_load(recipe, options: RunOptions) -> tuple[RunOptions, str | None]:
    """[Note: restarts] Megatron-LM's ``load``: a run given ``load`` (and neither ``--resume`` nor
    ``finetune``) resumes from that directory's latest checkpoint when it holds one, and starts
    fresh while it holds none, so with ``load`` = ``save`` one command line serves the first start
    and every restart under a launcher (``torchrun --max-restarts``, a requeued SLURM job). The
    options the run then has, and the note to print.

    Example::

        options, note = resume_from_load(recipe, RunOptions())   # resume=True once load has a checkpoint
    """
    t = recipe.train
    if options.resume or not t.load or t.finetune:
        return options, None
    latest, _ = _latest(Path(t.load))
    if latest is None:
        return options, f"load={t.load} holds no checkpoint yet: starting fresh"
    return replace(options, resume=True), f"load={t.load} holds iteration {latest}: resuming from it"


def check_checkpoint_dirs(recipe, options: RunOptions) -> list[str]:
    """The checks of [Note: a checkpoint directory is never clobbered by accident] that need
    no process group; raises ``TrainError`` naming the fix. Returns the notes to print (what
    ``--overwrite`` will remove, where the run resumes from)."""
    t, notes = recipe.train, []
    save = Path(t.save) if t.save else None
    load = Path(t.load) if t.load else save
    resume_at = None
    notes += _check_loading(recipe, options, load)
    if options.resume:
        if load is None:
            raise TrainError("--resume needs a checkpoint directory: set the recipe's load (or save) key, "
                             "e.g. --set load=checkpoints")
        latest, published = _latest(load)
        if latest is None:
            raise TrainError(f"--resume: {load} holds no checkpoint (no 'latest' marker): start a fresh run "
                             "without --resume, or point load at the directory of the run to continue")
        resume_at = latest if options.resume is True else int(options.resume)
        if resume_at not in published:
            raise TrainError(f"--resume {resume_at}: {load} has no checkpoint of that iteration (it has "
                             f"{published}): pick one of them")
        if _metadata(load, resume_at).get("kind") == "weights":
            raise TrainError(f"load={load} holds model weights only (etp-convert import-hf wrote it), no run to "
                             "resume: start from it with --set finetune=true")
        notes.append(f"resuming at iteration {resume_at} from {load}" + (" (model and iteration; a fresh optimizer: "
                                                                          "no_load_optim)" if t.no_load_optim else ""))
    if save is None or t.skip_train:  # skip_train saves nothing
        return notes
    _check_writable(save, checkpoint_bytes(recipe))
    latest, published = _latest(save)
    if published or latest is not None:
        newer = [i for i in published if resume_at is None or i > resume_at]
        same_run = resume_at is not None and load.resolve() == save.resolve()
        if newer and not options.overwrite:
            if not same_run:
                raise TrainError(
                    f"save={save} already holds checkpoints of another run (iterations {published}, latest "
                    f"{latest}): continue that run with --resume, save elsewhere (--set save=NEW_DIR), or pass "
                    "--overwrite to replace them")
            raise TrainError(
                f"--resume {resume_at} in {save}, whose latest checkpoint is {latest}: saving from there would "
                f"replace iterations {newer}; save elsewhere (--set save=NEW_DIR) or pass --overwrite to delete them")
        if newer:
            notes.append(f"--overwrite: deleting checkpoints {newer} of {save}")
    return notes


def _check_writable(save: Path, needed: int) -> None:
    try:
        save.mkdir(parents=True, exist_ok=True)
        probe = save / f".etp_write_probe_{os.getpid()}_{time.monotonic_ns()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise TrainError(f"save={save} is not a writable directory ({error.strerror or error}): "
                         "choose another with --set save=DIR") from None
    free = shutil.disk_usage(save).free
    if free < needed * SAVE_MARGIN:
        raise TrainError(f"save={save} has {free / 2**30:.1f} GiB free; a checkpoint of this recipe takes about "
                         f"{needed / 2**30:.1f} GiB: free space or choose another directory with --set save=DIR")


def remove_newer_checkpoints(root: Path, after: int | None) -> list[int]:
    """Deletes ``root``'s published checkpoints newer than ``after`` (all when None) and its
    ``latest`` marker if it named one of them (``--overwrite``); returns what it deleted."""
    from etp.megatron.checkpoint.manifest import LATEST_NAME, find_latest, iteration_dir, list_checkpoints

    doomed = [i for i in list_checkpoints(root) if after is None or i > after]
    latest = find_latest(root)
    if latest is not None and (after is None or latest > after):
        (root / LATEST_NAME).unlink()
    for iteration in doomed:
        shutil.rmtree(iteration_dir(root, iteration))
    return doomed


class Checkpointing:
    """When a run saves, saving it, and resuming. Rank 0 prints what it did.

    Example::

        checkpoints = Checkpointing(recipe, options, rank, world)
        start = checkpoints.resume(stepper)
        ...
        if checkpoints.due(iteration + 1, stop):
            checkpoints.save(stepper, iteration + 1)
    """

    def __init__(self, recipe, options: RunOptions, rank: int, world: int) -> None:
        self.recipe, self.options, self.rank, self.world = recipe, options, rank, world
        t = recipe.train
        self.save_root = Path(t.save) if t.save else None
        self.load_root = Path(t.load) if t.load else self.save_root
        self.loaded_consumed = None  # the checkpoint's consumed samples per split, once resumed
        self.carried: dict = {}  # CARRIED_METADATA of the checkpoint the run started from

    def due(self, done: int, stop: int) -> bool:
        """Whether the run saves after ``done`` iterations (``stop``: its last)."""
        if self.save_root is None or self.recipe.train.skip_train:
            return False
        interval = self.recipe.train.save_interval
        return done == stop or bool(interval and done % interval == 0)

    def prepare(self, resumed_at: int | None) -> None:
        """``--overwrite``: deletes what the preflight said it would (rank 0, before any save)."""
        if self.options.overwrite and self.save_root is not None and self.rank == 0:
            removed = remove_newer_checkpoints(self.save_root, resumed_at)
            if removed:
                print(f"etp-train: --overwrite: deleted checkpoints {removed} of {self.save_root}", flush=True)

    def start(self, stepper, schedule=None) -> int:
        """The iteration the run starts at: ``--resume``'s, or 0 after ``finetune``'s weights
        (see [Note: fine-tuning]), or 0 for a fresh run."""
        if self.options.resume:
            return self.resume(stepper, schedule)
        if self.recipe.train.finetune:
            self.finetune(stepper)
        return 0

    def resume(self, stepper, schedule=None) -> int:
        """Loads the checkpoint ``--resume`` names into the model and optimizer (and its
        learning-rate schedule into ``schedule``, an ``etp.train.schedule.OptimizerSchedule``);
        the iteration. With ``no_load_optim`` the model alone (Megatron-LM: no optimizer and no
        scheduler state; the schedule restarts at the iteration)."""
        from etp.megatron.checkpoint import load_model_checkpoint, load_training_checkpoint

        wanted = None if self.options.resume is True else int(self.options.resume)
        if self.recipe.train.no_load_optim:
            iteration, metadata, _ = load_model_checkpoint(self.load_root, stepper.model, wanted)
            _refresh_main_weights(stepper)
            if schedule is not None:
                schedule.load_state_dict(None, iteration)
        else:
            iteration, metadata, _ = load_training_checkpoint(self.load_root, stepper.model, stepper.optimizer,
                                                              wanted)
            if schedule is not None:
                schedule.load_state_dict(metadata.get("opt_param_scheduler"), iteration)
        self.carried = {k: metadata[k] for k in CARRIED_METADATA if metadata.get(k) is not None}
        self.loaded_consumed = metadata.get("consumed_samples")
        if self.rank == 0:
            print(f"etp-train: resumed at iteration {iteration} from {self.load_root} (saved with layout "
                  f"{metadata.get('layout')})", flush=True)
        return iteration

    def finetune(self, stepper) -> None:
        """``finetune``: the model weights of ``load``'s latest checkpoint, at this run's layout."""
        from etp.megatron.checkpoint import load_model_checkpoint

        iteration, metadata, _ = load_model_checkpoint(self.load_root, stepper.model)
        _refresh_main_weights(stepper)
        self.carried = {k: metadata[k] for k in CARRIED_METADATA if metadata.get(k) is not None}
        if self.rank == 0:
            print(f"etp-train: fine-tuning from the model weights of {self.load_root} (its iteration {iteration}, "
                  f"{metadata.get('source') or 'saved with layout ' + str(metadata.get('layout'))}); iteration 0, a "
                  "fresh optimizer", flush=True)

    def consumed_samples(self, iteration: int, global_batch_size: int) -> dict:
        """The samples of each split the run has consumed when it starts at ``iteration``: what the
        checkpoint it resumed from recorded, else ``iteration x global_batch_size`` train samples
        (a fresh run: none). [Note: consumed samples]"""
        if self.loaded_consumed is not None:
            return dict(self.loaded_consumed)
        return {"train": iteration * global_batch_size, "valid": 0}

    def save(self, stepper, iteration: int, schedule=None, consumed: dict | None = None) -> float:
        """Saves ``iteration`` (with ``schedule``'s state, stepped past it, and the samples each
        split has ``consumed``, [Note: consumed samples]); returns the seconds it took (kept out of
        the step time)."""
        from etp.megatron.checkpoint import save_training_checkpoint

        p, e = self.recipe.parallel, self.recipe.etp
        layout = {"world_size": self.world, "tensor_model_parallel_size": p.tensor_model_parallel_size,
                  "expert_model_parallel_size": p.expert_model_parallel_size,
                  "etp_size": e.etp_size, "expert_etp_size": e.expert_etp_size}
        began = time.perf_counter()
        metadata = {"recipe": str(self.recipe.source), "layout": layout, **self.carried}
        if schedule is not None:
            metadata["opt_param_scheduler"] = schedule.state_dict()  # Megatron-LM's name for it
        if consumed is not None:
            metadata["consumed_samples"] = consumed
        path = save_training_checkpoint(self.save_root, iteration, stepper.model, stepper.optimizer, metadata)
        seconds = time.perf_counter() - began
        if self.rank == 0:
            print(f"etp-train: saved iteration {iteration} to {path} ({seconds:.1f} s)", flush=True)
        return seconds


def _refresh_main_weights(stepper) -> None:
    """After loading model weights into a stepper whose optimizer was built already: its main
    (fp32) copies are the old weights; megatron-core's optimizers copy them again. torch AdamW
    steps the parameters themselves."""
    reload = getattr(stepper.optimizer, "reload_model_params", None)
    if reload is not None:
        reload()
