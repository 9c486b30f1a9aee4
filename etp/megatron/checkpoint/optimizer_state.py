"""Optimizer state of ETP models in checkpoints: every state tensor (Adam moments, fp32 masters)
described exactly like its parameter, including the distributed optimizer's flat slices.
See [Note: ETP training checkpoints] in ``training.py``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class _ParamState:
    """The optimizer state of one model parameter on this rank: tensors shaped like the
    stepped param (Adam's moments, the fp32 master copy), the torch state dict (its ``step``),
    and which slice of the flattened model param they cover (None: all of it)."""

    param: torch.Tensor
    tensors: dict[str, torch.Tensor]
    state: dict
    flattened_range: slice | None = None
    instance: int = 0  # megatron's distributed-optimizer instance: only instance 0 writes


def _param_states(optimizer) -> dict[int, _ParamState]:
    """id(model param) -> its optimizer state; created (zero) when the optimizer has not
    stepped yet, so that a fresh optimizer can be loaded into."""
    from ..optimizer import inner_optimizers, param_pairs

    if isinstance(optimizer, torch.optim.Optimizer):
        pairs = [(p, p, optimizer, None, 0) for g in optimizer.param_groups for p in g["params"]]
    else:
        pairs = []
        for opt in inner_optimizers(optimizer):
            if getattr(getattr(opt, "config", None), "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
                raise ValueError("checkpointing megatron-core's precision-aware optimizer is not supported: "
                                 "set use_precision_aware_optimizer=False")
            instance = getattr(opt, "distributed_optimizer_instance_id", 0)
            pairs += [(*pair, instance) for pair in param_pairs(opt)]
    result: dict[int, _ParamState] = {}
    for model_param, main_param, torch_opt, flattened_range, instance in pairs:
        state = torch_opt.state[main_param]
        if not state:  # Adam before its first step: create what its first step would
            # torch keeps the step on the param's device for fused / capturable Adam (etp's
            # megatron_fallbacks: fast switches it to fused), on the host otherwise.
            on_device = any((g.get("fused") or g.get("capturable")) and any(q is main_param for q in g["params"])
                            for g in torch_opt.param_groups)
            state["step"] = torch.zeros((), dtype=torch.float32, device=main_param.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(main_param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(main_param, memory_format=torch.preserve_format)
        tensors = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == main_param.shape}
        # A master copy of its own (mixed precision); the fp32 optimizers step the model's
        # own storage (the param, or a slice of it under the distributed optimizer).
        if main_param.untyped_storage().data_ptr() != model_param.untyped_storage().data_ptr():
            tensors["fp32_param"] = main_param.data
        result[id(model_param)] = _ParamState(model_param, tensors, state, flattened_range, instance)
    return result


def _model_entries(model_sd: dict) -> dict[int, tuple[str, Any]]:
    """id(parameter) -> (its path in the sharded state dict, its entry). The path, not the
    entry's checkpoint key, names it uniquely: megatron stacks the layers of a block under
    one key (``decoder.layers.<...>``, the layer index being an offset of a prepended axis)."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )

    found: dict[int, tuple[str, Any]] = {}

    def walk(node, path: str) -> None:
        for name, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{path}{name}.")
            elif isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                found[id(value.data)] = (f"{path}{name}", value)

    walk(model_sd, "")
    return found


def _optimizer_sharded_state(model_sd: dict, states: dict[int, _ParamState], groups) -> tuple[dict, dict]:
    """(sharded optimizer state, {path: optimizer state dict, to put steps back into}).

    A whole-param state tensor is described exactly like its param (megatron's
    ``make_sharded_optimizer_tensor``). A distributed-optimizer slice becomes the boxes of
    the full logical weight that its valid elements fill (``etp.megatron.checkpoint.
    stock_segments.pieces_of``), written by this rank unless an equal copy elsewhere writes it: each rank of
    a replicate group owns a distinct slice, ETP peers own equal slices of replicated params
    (``etp_copy_index``). So the checkpoint holds the same logical tensors whichever
    optimizer saved it, and either kind loads it."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from ..optimizer import etp_copy_index
    from .model_state import _with_replica
    from .stock_segments import pieces_of

    entries = _model_entries(model_sd)
    sharded, steps = {}, {}
    for pid, record in states.items():
        if pid not in entries:
            raise ValueError("an optimized parameter has no entry in the model's sharded state dict")
        path, entry = entries[pid]
        steps[path] = record.state
        if record.flattened_range is None:
            for name, tensor in record.tensors.items():
                sharded[f"{name}.{path}"] = make_sharded_optimizer_tensor(entry, tensor, f"optimizer.{name}")
            continue
        pieces = pieces_of(entry)
        index = etp_copy_index(record.param, groups) + record.instance * dist.get_world_size()
        replica_id = _with_replica(entry.replica_id, index)
        for name, tensor in record.tensors.items():
            boxes, _ = pieces.sharded_tensors(tensor, f"optimizer.{name}.{entry.key}", replica_id,
                                              record.flattened_range)
            if boxes:  # none when this slice is all padding rows
                sharded[f"{name}.{path}"] = boxes
    return sharded, steps


def _all_step_counts(steps: dict) -> dict[str, float]:
    """Every rank's Adam step counts by param path (a collective): common state is written
    by rank 0 alone, which under the distributed optimizer steps only some params."""
    local = {path: float(state["step"]) for path, state in steps.items() if "step" in state}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    merged: dict[str, float] = {}
    for counts in everyone:
        merged.update(counts)
    return merged


