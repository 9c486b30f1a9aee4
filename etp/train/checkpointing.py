"""etp-train's checkpoints: when a run saves, where it resumes from, and the rules that keep
one run from destroying another's work.

[Note: a checkpoint directory is never clobbered by accident]
* [Note: restarts] A run given ``load`` resumes from its latest checkpoint, or starts fresh while
  it holds none (``resume_from_load``): with ``load`` = ``save`` every restart continues the run.
* [Note: run IDs] Every checkpoint's metadata names its run: ``run: {id, recipe, model}``, a
  uuid with the recipe's name, and the model keys that fix the checkpoint's tensors
  (``MODEL_KEYS``, Megatron-LM's ``check_checkpoint_args`` in spirit). A fresh run draws a new ID
  (rank 0's, broadcast); a resumed run adopts the ID of the checkpoint it resumed. A
  ``save`` directory holding checkpoints of another run ID is refused before any rank
  starts, naming ``--resume`` (continue that run), another ``save`` and ``--overwrite``
  (replace its checkpoints: they are deleted first, and the run says which). A fresh run
  (no ``--resume``, or ``finetune``) is always another run. Checkpoints written before run
  IDs count as the run's own only when it resumed from that same directory.
* With ``load`` = ``save``, a restart whose model keys differ from the latest checkpoint's is
  not that run restarting: it is refused the same way (``--overwrite`` starts it fresh and
  replaces the old run's checkpoints), and ``--resume`` of another model is refused, naming
  the keys that differ.
* A resumed run saves into the directory it resumed from, or into a new one. Resuming from an
  iteration older than the directory's ``latest`` is refused unless ``--overwrite``, which
  deletes the newer checkpoints first: ``latest`` never moves backwards
  (``etp.megatron.checkpoint.publish`` refuses that as well).
* ``async_save`` (Megatron-LM's key): the step waits only for the tensors' copy to host; a
  background thread writes them, and the checkpoint is published (``latest``) at the first
  iteration boundary where every rank's write has finished, or before the next save, or
  before the run exits (a SIGTERM, an exit interval, the last iteration: each waits and then
  exits 0). A save in flight when the process dies never becomes ``latest``
  ([Note: async saves] in ``etp.megatron.checkpoint.background``).
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
on one is refused, naming ``finetune``. ``no_save_optim: true`` saves the model weights and
the iteration alone (Megatron-LM's ``--no-save-optim``: a fine-tune's output for export, a
seventh of the bytes in bf16); such a checkpoint resumes only with ``no_load_optim``.
``pretrained_checkpoint`` (Megatron-LM's) fine-tunes from that checkpoint while ``load`` holds
none and resumes from ``load`` once it does (``resume_from_load``), so with ``load`` =
``save`` a fine-tune restarts like any run ([Note: restarts]). A run
started from a checkpoint that carries its Hugging Face ``config.json`` (an import) carries it on in its own saves, so ``etp-convert
export-hf`` knows the architecture.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from etp.groups import new_process_group
from etp.train.options import RunOptions, TrainError

__all__ = ["Checkpointing", "check_checkpoint_dirs", "checkpoint_bytes", "model_identity", "resume_from_load"]

#: Free space a save needs beyond the checkpoint's tensors (metadata, manifests, rounding).
SAVE_MARGIN = 1.05


def checkpoint_bytes(recipe) -> int:
    """Bytes of one checkpoint of ``recipe``: every logical parameter in its training dtype,
    plus the optimizer's fp32 master weights (mixed precision) and Adam's two fp32 moments (none
    with ``no_save_optim``).

    Example::

        checkpoint_bytes(Recipe.from_yaml("recipes/moe_flagship.yaml")) / 2**30
    """
    mixed = recipe.train.bf16 or recipe.train.fp16
    if recipe.train.no_save_optim:  # the weights alone
        return recipe.num_params() * (2 if mixed else 4)
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


#: the model keys whose values fix a checkpoint's tensors ([Note: run IDs]);
#: ``max_position_embeddings`` only with learned positions (RoPE has no such weight)
MODEL_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "swiglu", "normalization", "qk_layernorm",
              "qk_layernorm_width", "position_embedding_type", "untie_embeddings_and_output_weights",
              "add_bias_linear", "num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
              "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_enable_expert_bias")


def model_identity(recipe) -> dict:
    """The model keys of ``recipe`` that fix its checkpoints' tensors, as JSON stores them
    ([Note: run IDs]).

    Example::

        model_identity(Recipe.from_yaml("recipes/tiny_moe_cpu.yaml"))["hidden_size"]   # 64
    """
    m = recipe.model
    keys = MODEL_KEYS + (("max_position_embeddings",) if m.position_embedding_type == "learned_absolute" else ())
    return json.loads(json.dumps({key: getattr(m, key) for key in keys}))


def _recipe_name(recipe) -> str:
    return Path(recipe.source).stem if recipe.source else "recipe"


def new_run_id(recipe) -> str:
    """A fresh run's ID: the recipe's name and a uuid, e.g. ``tiny_moe_cpu-1f0c...``."""
    return f"{_recipe_name(recipe)}-{uuid.uuid4().hex}"


def _run_of(root: Path, iteration: int) -> dict:
    """The ``run`` metadata of a checkpoint ({} for one written before run IDs, or an import)."""
    run = _metadata(root, iteration).get("run")
    return run if isinstance(run, dict) else {}


def _model_difference(run: dict, recipe) -> str | None:
    """The model keys where ``run``'s checkpoint and ``recipe`` differ (None: the same model, or
    a checkpoint that does not say)."""
    theirs, ours = run.get("model"), model_identity(recipe)
    if not isinstance(theirs, dict):
        return None
    keys = [*ours, *(key for key in theirs if key not in ours)]  # MODEL_KEYS' order: the defining keys first
    differ = [f"{key} {theirs.get(key)!r} there, {ours.get(key)!r} here" for key in keys
              if theirs.get(key) != ours.get(key)]
    if not differ:
        return None
    return ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")


def _describe(run: dict) -> str:
    return f"run {run['id']}" if run.get("id") else "a run without a run ID"


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


def resume_from_load(recipe, options: RunOptions) -> tuple[object, RunOptions, str | None]:
    """[Note: restarts] Megatron-LM's ``load``: a run given ``load`` (and neither ``--resume`` nor
    ``finetune``) resumes from that directory's latest checkpoint when it holds one, and starts
    fresh while it holds none, so with ``load`` = ``save`` one command line serves the first start
    and every restart under a launcher (``torchrun --max-restarts``, a requeued SLURM job). With
    ``pretrained_checkpoint`` ([Note: fine-tuning]) the fresh start is a fine-tune from it: the
    recipe returned loads it with ``finetune``. The recipe and options the run then has, and the
    note to print.

    Example::

        recipe, options, note = resume_from_load(recipe, RunOptions())   # resume=True once load has a checkpoint
    """
    t = recipe.train
    if options.resume or not t.load or t.finetune:
        return recipe, options, None
    load = Path(t.load)
    latest, _ = _latest(load)
    if latest is None and t.pretrained_checkpoint is not None:
        # no_load_optim is for the resumes after it (a fine-tune saving weights only): nothing to load yet
        return (recipe.replace(load=t.pretrained_checkpoint, finetune=True, pretrained_checkpoint=None,
                               no_load_optim=False), options,
                f"load={t.load} holds no checkpoint yet: fine-tuning from pretrained_checkpoint={t.pretrained_checkpoint}")
    if latest is None:
        return recipe, options, f"load={t.load} holds no checkpoint yet: starting fresh"
    run = _run_of(load, latest)
    differ = _model_difference(run, recipe)
    if differ is not None:  # not this run restarting: another model's checkpoints ([Note: run IDs])
        same_dir = t.save is not None and Path(t.save).resolve() == load.resolve()
        if same_dir and options.overwrite:
            return recipe, options, (f"load={t.load} holds {_describe(run)} of another model ({differ}): --overwrite "
                                     "starts this run fresh")
        fix = ("save elsewhere (--set save=NEW_DIR --set load=NEW_DIR) or pass --overwrite to replace them" if same_dir
               else "point load at a checkpoint of this model, or remove load to start fresh")
        raise TrainError(f"load={t.load} holds the checkpoints of {_describe(run)}, another model ({differ}): {fix}")
    return recipe, replace(options, resume=True), f"load={t.load} holds iteration {latest}: resuming from it"


def check_checkpoint_dirs(recipe, options: RunOptions) -> list[str]:
    """The checks of [Note: a checkpoint directory is never clobbered by accident] that need
    no process group; raises ``TrainError`` naming the fix. Returns the notes to print (what
    ``--overwrite`` will remove, where the run resumes from)."""
    t, notes = recipe.train, []
    save = Path(t.save) if t.save else None
    load = Path(t.load) if t.load else save
    resume_at = run_id = None
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
        saved = _metadata(load, resume_at)
        if saved.get("kind") == "weights":
            raise TrainError(f"load={load} holds model weights only (etp-convert import-hf wrote it), no run to "
                             "resume: start from it with --set finetune=true")
        if saved.get("optimizer") is False and not t.no_load_optim:
            raise TrainError(f"--resume {resume_at}: load={load} was saved with no_save_optim (no optimizer state): "
                             "resume with --set no_load_optim=true, or start from its weights with --set finetune=true")
        resumed = _run_of(load, resume_at)
        differ = _model_difference(resumed, recipe)
        if differ is not None:
            raise TrainError(f"--resume {resume_at}: load={load} holds {_describe(resumed)} of another model "
                             f"({differ}): resume it with its own recipe, or start fresh without --resume")
        run_id = resumed.get("id")
        notes.append(f"resuming at iteration {resume_at} from {load}" + (" (model and iteration; a fresh optimizer: "
                                                                          "no_load_optim)" if t.no_load_optim else ""))
    if save is None or t.skip_train:  # skip_train saves nothing
        return notes
    _check_writable(save, checkpoint_bytes(recipe))
    latest, _ = _latest(save)
    same_dir = resume_at is not None and load.resolve() == save.resolve()
    others, newer = _conflicts(save, resume_at, run_id, same_dir)
    if (others or newer) and not options.overwrite:
        if others:
            runs = sorted({_describe(_run_of(save, i)) for i in others})
            raise TrainError(
                f"save={save} already holds checkpoints of another run ({', '.join(runs)}: iterations {others}, "
                f"latest {latest}): continue that run with --resume (load={save}), save elsewhere "
                "(--set save=NEW_DIR), or pass --overwrite to replace them")
        raise TrainError(
            f"--resume {resume_at} in {save}, whose latest checkpoint is {latest}: saving from there would "
            f"replace iterations {newer}; save elsewhere (--set save=NEW_DIR) or pass --overwrite to delete them")
    if others or newer:
        notes.append(f"--overwrite: deleting checkpoints {sorted({*others, *newer})} of {save}")
    return notes


def _conflicts(save: Path, resume_at: int | None, run_id: str | None, same_dir: bool) -> tuple[list[int], list[int]]:
    """``save``'s published checkpoints of another run, and this run's own newer than
    ``resume_at`` ([Note: run IDs]): what a run would clobber, and ``--overwrite`` deletes."""
    from etp.megatron.checkpoint.manifest import list_checkpoints

    others, newer = [], []
    for iteration in list_checkpoints(save):
        theirs = _run_of(save, iteration).get("id")
        # A fresh run (resume_at None) is always another run; without IDs on both sides the
        # directory decides: a resume from this same directory continues its run.
        another = resume_at is None or (theirs != run_id if theirs and run_id else not same_dir)
        if another:
            others.append(iteration)
        elif iteration > resume_at:
            newer.append(iteration)
    return others, newer


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


def remove_conflicting_checkpoints(root: Path, resumed_at: int | None, run_id: str | None,
                                   same_dir: bool) -> list[int]:
    """``--overwrite``: deletes ``root``'s checkpoints that the preflight said it would (another
    run's, and this run's newer than ``resumed_at``; all for a fresh run) and its ``latest``
    marker unless it names a checkpoint kept; returns what it deleted."""
    from etp.megatron.checkpoint.manifest import LATEST_NAME, find_latest, iteration_dir

    others, newer = _conflicts(root, resumed_at, run_id, same_dir)
    doomed = sorted({*others, *newer})
    latest = find_latest(root)
    if latest is not None and (latest in doomed or resumed_at is None or latest > resumed_at):
        (root / LATEST_NAME).unlink()
    for iteration in doomed:
        shutil.rmtree(iteration_dir(root, iteration))
    return doomed


class Checkpointing:
    """When a run saves, saving it, and resuming. Rank 0 prints what it did.

    Example::

        checkpoints = Checkpointing(recipe, options, rank, world)
        start = checkpoints.start(stepper)
        ...after each iteration (every rank):
        checkpoints.poll()                       # publishes an async save whose writes finished
        if checkpoints.due(iteration + 1, stop):
            checkpoints.save(stepper, iteration + 1)
        ...after the last:
        checkpoints.finish_pending()             # waits for an async save in flight
    """

    def __init__(self, recipe, options: RunOptions, rank: int, world: int) -> None:
        self.recipe, self.options, self.rank, self.world = recipe, options, rank, world
        t = recipe.train
        self.save_root = Path(t.save) if t.save else None
        self.load_root = Path(t.load) if t.load else self.save_root
        self.loaded_consumed = None  # the checkpoint's consumed samples per split, once resumed
        self.carried: dict = {}  # CARRIED_METADATA of the checkpoint the run started from
        self.run_id: str | None = None  # [Note: run IDs]: adopted on resume, else drawn at the first need
        self._resumed_run_id: str | None = None  # the resumed checkpoint's (None: written before run IDs)
        self.pending = None  # the async save in flight (etp.megatron.checkpoint.PendingCheckpoint)
        self._pending_began = 0.0
        self._vote_group = None
        if t.async_save and dist.is_initialized() and dist.get_backend() != "gloo":
            # the poll's vote goes over gloo (a CPU tensor): no device synchronization per iteration
            self._vote_group = new_process_group(backend="gloo")  # the world's timeout

    def due(self, done: int, stop: int) -> bool:
        """Whether the run saves after ``done`` iterations (``stop``: its last)."""
        if self.save_root is None or self.recipe.train.skip_train:
            return False
        interval = self.recipe.train.save_interval
        return done == stop or bool(interval and done % interval == 0)

    def prepare(self, resumed_at: int | None) -> None:
        """``--overwrite``: deletes what the preflight said it would (rank 0, before any save)."""
        if self.options.overwrite and self.save_root is not None and self.rank == 0:
            same_dir = resumed_at is not None and self.load_root.resolve() == self.save_root.resolve()
            # what the preflight compared: the resumed checkpoint's ID, not one drawn since
            removed = remove_conflicting_checkpoints(self.save_root, resumed_at, self._resumed_run_id, same_dir)
            if removed:
                print(f"etp-train: --overwrite: deleted checkpoints {removed} of {self.save_root}", flush=True)

    def start(self, stepper, schedule=None) -> int:
        """The iteration the run starts at: ``--resume``'s, or 0 after ``finetune``'s weights
        (see [Note: fine-tuning]), or 0 for a fresh run."""
        if self.options.resume:
            return self.resume(stepper, schedule)
        if self.recipe.train.finetune:
            self.finetune(stepper)
        self._agree_run_id()
        return 0

    def _agree_run_id(self) -> str:
        """This run's ID: the resumed checkpoint's, else rank 0's fresh one, broadcast (a collective
        the first time it is needed). [Note: run IDs]"""
        if self.run_id is None:
            box = [new_run_id(self.recipe) if self.rank == 0 else None]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(box, src=0)
            self.run_id = box[0]
        return self.run_id

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
        run = metadata.get("run") if isinstance(metadata.get("run"), dict) else {}
        self.run_id = self._resumed_run_id = run.get("id")  # the run it continues ([Note: run IDs])
        self._agree_run_id()  # a checkpoint written before run IDs: a fresh ID from here on
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
        the step time). With ``async_save`` it returns once the tensors are copied to host,
        after publishing a save still in flight."""
        from etp.megatron.checkpoint import begin_training_checkpoint, save_training_checkpoint

        p, e = self.recipe.parallel, self.recipe.etp
        layout = {"world_size": self.world, "tensor_model_parallel_size": p.tensor_model_parallel_size,
                  "expert_model_parallel_size": p.expert_model_parallel_size,
                  "etp_size": e.etp_size, "expert_etp_size": e.expert_etp_size}
        waited = self.finish_pending()  # saves are published in order
        # The step the host just queued may still be running on the device: the save's first copy
        # would wait for it, and that wait would be kept out of the step's time with the save's.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        began = time.perf_counter()
        run = {"id": self._agree_run_id(), "recipe": _recipe_name(self.recipe), "model": model_identity(self.recipe)}
        metadata = {"recipe": str(self.recipe.source), "layout": layout, "run": run, **self.carried}
        optimizer = stepper.optimizer
        if self.recipe.train.no_save_optim:
            optimizer, metadata["optimizer"] = None, False  # [Note: fine-tuning]
        if schedule is not None:
            metadata["opt_param_scheduler"] = schedule.state_dict()  # Megatron-LM's name for it
        if consumed is not None:
            metadata["consumed_samples"] = consumed
        if self.recipe.train.async_save:
            self.pending = begin_training_checkpoint(self.save_root, iteration, stepper.model, optimizer, metadata)
            self._pending_began = began
            seconds = time.perf_counter() - began
            if self.rank == 0:
                print(f"etp-train: saving iteration {iteration} in the background (async_save; the step waited "
                      f"{seconds:.2f} s for the copy to host)", flush=True)
            return waited + seconds
        path = save_training_checkpoint(self.save_root, iteration, stepper.model, optimizer, metadata)
        seconds = time.perf_counter() - began
        if self.rank == 0:
            print(f"etp-train: saved iteration {iteration} to {path} ({seconds:.1f} s)", flush=True)
        return waited + seconds

    def poll(self) -> float:
        """At an iteration boundary (every rank): publishes the async save in flight once every
        rank's write has finished (a vote over gloo; nothing waits for the disk). The seconds the
        publish took (kept out of the step time)."""
        if self.pending is None:
            return 0.0
        done = torch.tensor([int(self.pending.written())], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._vote_group)
        return self.finish_pending() if done.item() else 0.0

    def finish_pending(self) -> float:
        """Waits for the async save in flight, if any, and publishes it (every rank: before the
        next save and before the run exits); the seconds it waited."""
        if self.pending is None:
            return 0.0
        pending, self.pending = self.pending, None
        began = time.perf_counter()
        path = pending.publish()
        if self.rank == 0:
            print(f"etp-train: saved iteration {pending.iteration} to {path} (async_save: "
                  f"{time.perf_counter() - self._pending_began:.1f} s after it began)", flush=True)
        return time.perf_counter() - began


def _refresh_main_weights(stepper) -> None:
    """After loading model weights into a stepper whose optimizer was built already: its main
    (fp32) copies are the old weights; megatron-core's optimizers copy them again. torch AdamW
    steps the parameters themselves."""
    reload = getattr(stepper.optimizer, "reload_model_params", None)
    if reload is not None:
        reload()
