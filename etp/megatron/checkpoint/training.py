"""Training checkpoints of ETP models: weights and optimizer state, reshardable, crash-safe.

[Note: ETP training checkpoints]
A checkpoint is megatron-core ``dist_checkpointing`` (torch_dist format) of

* ``model``: the model's sharded state dict with ETP weights as pieces of the full logical
  weights (``etp.megatron.checkpoint.model_state``: megatron's keys and global shapes, padding
  excluded, one writer per piece);
* ``optimizer``: for every parameter with optimizer state, each state tensor (Adam's
  ``exp_avg`` / ``exp_avg_sq``, megatron's fp32 master weight ``fp32_param``) described
  exactly like its parameter, under ``optimizer.<state>.<parameter key>`` (megatron's
  ``make_sharded_optimizer_tensor``); plain values (Adam's step count, the iteration) are
  common state;

published by ``etp.megatron.checkpoint.publish`` (temporary directory, manifest with a sha256 per file,
atomic rename, ``latest`` last) and read back through its verification and restricted
unpickling. Because every tensor is described by logical position, a checkpoint saved at one
(TP, ETP, EETP, DP) layout loads at any other, ETP = 1 included: the loader builds the same
description for its own layout and torch DCP moves the overlapping boxes.

Optimizers: torch optimizers whose per-parameter state is tensors of the parameter's shape
plus a scalar ``step`` (Adam, AdamW, SGD with momentum), and megatron-core's optimizers
(``ChainedOptimizer`` of ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer`` /
``DistributedOptimizer``). The distributed optimizer steps a 1-D slice of each flattened
param per replicate rank; each slice is written as the boxes of the full logical tensor that
it fills, by its one owner. The files hold the same logical tensors whichever optimizer saved
them: a checkpoint saved with the distributed optimizer loads without it and the other way
round, at any layout. megatron's own distributed-optimizer formats (``dp_reshardable``: DP
resharding only; ``fully_sharded_model_space``: needs ``flattened_range``, which 0.16
removed) are not used.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from .background import host_staged_strategy, start_in_background
from .optimizer_state import _all_step_counts, _optimizer_sharded_state, _param_states
from .publish import LoadedCheckpoint, PendingCheckpoint, begin_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["begin_training_checkpoint", "load_model_checkpoint", "load_training_checkpoint",
           "save_training_checkpoint", "sync_save_strategy"]


def sync_save_strategy():
    """megatron-core's torch_dist format written synchronously in-process.

    megatron-core 0.16.1's default torch_dist writer calls ``torch.cuda.synchronize()``
    unconditionally (CPU-only torch raises), needs psutil and forks writer processes plus a
    multiprocessing Manager (daemonic spawned ranks may not). This strategy writes the same
    files (``__<rank>_0.distcp``, ``.metadata``) with torch DCP's synchronous
    ``FileSystemWriter`` and megatron's save planner, on CPU and GPU alike.

    Example::

        dist_checkpointing.save(state, directory, sharded_strategy=sync_save_strategy())
    """
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class SyncTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                       flatten_state_dict=False)
            dcp.save(mcore_to_pyt_state_dict(state, False), planner=planner,
                     storage_writer=dcp.FileSystemWriter(checkpoint_dir, thread_count=1))

    return SyncTorchDistSave("torch_dist", 1)



def _validate_on_every_rank(state: dict, loading: bool = False) -> None:
    """megatron validates a checkpoint's sharding on rank 0 only and raises there, while the
    other ranks go on into the save's (or load's) collectives and wait forever. Validating
    first and sharing the verdict makes every rank fail together (nothing written or read)."""
    from megatron.core.dist_checkpointing.state_dict_utils import (
        load_preprocess,
        save_preprocess,
    )
    from megatron.core.dist_checkpointing.validation import (
        determine_global_metadata,
        validate_sharding_integrity,
    )

    error = None
    try:
        if loading:  # on a copy: the request keeps its factories for the merge after loading
            sharded, _, _ = load_preprocess(state)
            validate_sharding_integrity(determine_global_metadata(sharded)[1])
        else:
            save_preprocess(state, validate_access_integrity=True)  # builds factories in place
    except Exception as exc:  # noqa: BLE001 - shared with every rank below, then raised
        error = f"{type(exc).__name__}: {exc}"
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"the checkpoint's sharding is invalid (rank {rank}; nothing saved or loaded): {message}")


def _etp_groups(model: torch.nn.Module):
    """The model's ETP groups, None for a model without ETP weights."""
    from ...wrap import _runtime_of

    runtime = _runtime_of(model)
    return runtime.groups if runtime is not None else None


def _model_sharded_state_dict(model: torch.nn.Module):
    """(the model inside DDP / Float16Module wrappers, its ETP sharded state dict)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    from .model_state import etp_sharded_state_dict

    inner = model
    while isinstance(inner, (DistributedDataParallel, Float16Module)):
        inner = inner.module
    if not hasattr(type(inner), "sharded_state_dict"):
        raise ValueError(f"{type(model).__name__} has no megatron-core sharded_state_dict to checkpoint")
    return inner, etp_sharded_state_dict(inner)


def save_training_checkpoint(root: str | Path, iteration: int, model: torch.nn.Module, optimizer,
                             metadata: dict | None = None) -> Path:
    """Saves model and optimizer state as ``<root>/iter_<iteration>`` and publishes it as
    ``latest`` (a collective: every rank calls it); ``optimizer`` None saves the model and the
    iteration alone (``no_save_optim``). See [Note: ETP training checkpoints].

    Raises:
        ValueError: an unsupported optimizer (megatron-core's precision-aware optimizer).
        etp.megatron.checkpoint.CheckpointError: the save failed on some rank (nothing published).

    Example::

        save_training_checkpoint("ckpt", 100, model, optimizer, {"recipe": "moe.yaml"})
    """
    from megatron.core import dist_checkpointing

    state = _training_state(model, optimizer, iteration)

    def save_fn(directory: Path) -> None:
        _validate_on_every_rank(state)
        dist_checkpointing.save(state, str(directory), sharded_strategy=sync_save_strategy(),
                                validate_access_integrity=False)  # done above, on every rank

    return save_checkpoint(root, iteration, save_fn, metadata or {})


def _training_state(model: torch.nn.Module, optimizer, iteration: int) -> dict:
    """The sharded state dict a training checkpoint holds ([Note: ETP training checkpoints]);
    without an optimizer, the model's and the iteration."""
    inner, model_sd = _model_sharded_state_dict(model)
    if optimizer is None:
        return {"model": model_sd, "iteration": iteration}
    opt_sd, steps = _optimizer_sharded_state(model_sd, _param_states(optimizer), _etp_groups(inner))
    return {"model": model_sd, "optimizer": opt_sd, "iteration": iteration, "optimizer_steps": _all_step_counts(steps)}


def begin_training_checkpoint(root: str | Path, iteration: int, model: torch.nn.Module, optimizer,
                              metadata: dict | None = None) -> PendingCheckpoint:
    """``save_training_checkpoint``'s checkpoint, written in the background ([Note: async
    saves]): returns once this rank's tensors are copied to host, so the next step may change
    them; the same files, published as ``latest`` by the returned ``PendingCheckpoint``'s
    ``publish()`` (a collective) once every rank's write finished. A collective.

    Example::

        pending = begin_training_checkpoint("ckpt", 100, model, optimizer, {"recipe": "moe.yaml"})
        ...                        # training steps
        path = pending.publish()   # ckpt/iter_0000100, now latest
    """
    from megatron.core import dist_checkpointing

    state = _training_state(model, optimizer, iteration)

    def start_fn(directory: Path):
        _validate_on_every_rank(state)
        request = dist_checkpointing.save(state, str(directory), sharded_strategy=host_staged_strategy(),
                                          validate_access_integrity=False, async_sharded_save=True)
        return start_in_background(request)

    return begin_checkpoint(root, iteration, start_fn, metadata or {})


def load_training_checkpoint(root: str | Path, model: torch.nn.Module, optimizer,
                             iteration: int | None = None) -> LoadedCheckpoint:
    """Loads the checkpoint ``iteration`` (default: ``latest``) of ``root`` into ``model`` and
    ``optimizer`` at their current layout, whatever layout saved it (a collective), and
    whichever optimizer saved it (distributed or not). Tensors load in place into the
    parameters and the optimizer state: no second copy of either is allocated. FP8 shard
    copies are re-quantized. Returns ``(iteration, metadata, None)``.

    Raises:
        etp.megatron.checkpoint.CheckpointError: no checkpoint, or a corrupt / partial / tampered one.

    Example::

        iteration, metadata, _ = load_training_checkpoint("ckpt", model, optimizer)
    """
    from megatron.core import dist_checkpointing

    from ...quant import quantize_shards

    inner, model_sd = _model_sharded_state_dict(model)
    opt_sd, steps = _optimizer_sharded_state(model_sd, _param_states(optimizer), _etp_groups(inner))
    targets = {key: [box.data for box in entry] if isinstance(entry, list) else [entry.data]
               for key, entry in opt_sd.items()}

    def load_fn(directory: Path):
        request = {"model": model_sd, "optimizer": opt_sd, "iteration": None, "optimizer_steps": None}
        _validate_on_every_rank({"model": model_sd, "optimizer": opt_sd}, loading=True)
        return dist_checkpointing.load(request, str(directory), validate_access_integrity=False)

    loaded = load_checkpoint(root, load_fn, iteration)
    state = loaded.result
    with torch.no_grad():
        inner.load_state_dict(state["model"])
        for key, value in state["optimizer"].items():
            for target, loaded_value in zip(targets[key], value if isinstance(value, list) else [value], strict=True):
                target.copy_(loaded_value)
        for key, step_state in steps.items():
            if "step" in step_state and key in state["optimizer_steps"]:
                step_state["step"].fill_(state["optimizer_steps"][key])
    quantize_shards(inner)
    return LoadedCheckpoint(state["iteration"], loaded.metadata, None)


def load_model_checkpoint(root: str | Path, model: torch.nn.Module, iteration: int | None = None) -> LoadedCheckpoint:
    """Loads only the model weights of checkpoint ``iteration`` (default: ``latest``) of
    ``root`` into ``model`` at its current layout (a collective): a training checkpoint's
    optimizer state and iteration are left in the files, and a weights-only checkpoint
    (``etp-convert import-hf``'s) loads the same way. Tensors load in place; FP8 shard copies
    are re-quantized. An optimizer built before this call still holds the old weights in its
    main (fp32) copies: refresh them (megatron-core's ``reload_model_params``). Returns
    ``(iteration, metadata, None)``.

    Raises:
        etp.megatron.checkpoint.CheckpointError: no checkpoint, or a corrupt / partial / tampered one.

    Example::

        iteration, metadata, _ = load_model_checkpoint("imported", model)
    """
    from megatron.core import dist_checkpointing

    from ...quant import quantize_shards

    inner, model_sd = _model_sharded_state_dict(model)

    def load_fn(directory: Path):
        _validate_on_every_rank({"model": model_sd}, loading=True)
        return dist_checkpointing.load({"model": model_sd}, str(directory), validate_access_integrity=False)

    loaded = load_checkpoint(root, load_fn, iteration)
    with torch.no_grad():
        inner.load_state_dict(loaded.result["model"])
    quantize_shards(inner)
    return LoadedCheckpoint(loaded.iteration, loaded.metadata, None)
