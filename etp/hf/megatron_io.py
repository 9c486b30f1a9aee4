"""The etp checkpoint side of a conversion: megatron-core's description of etp's ``GPTModel``
at one rank (built on the meta device: no weight is allocated), weights written into the
reshardable checkpoint format box by box as they are read, and read back box by box.

See [Note: Hugging Face checkpoints] in ``etp/hf/__init__.py``.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from etp.hf.adapter import ConversionError, Piece

__all__ = ["MegatronTensor", "check_layout", "checkpoint_tensors", "model_tensors", "one_rank_recipe",
           "read_boxes", "single_process", "write_weights"]


@contextlib.contextmanager
def single_process():
    """A one-rank gloo process group and megatron-core's parallel state at TP = PP = EP = 1 for
    the duration (what a conversion runs under); a caller's own initialized state is left as
    it is.

    Example::

        with single_process():
            tensors = model_tensors(recipe)
    """
    from megatron.core import parallel_state as ps

    own_group = not dist.is_initialized()
    with tempfile.TemporaryDirectory(prefix="etp_convert_") as scratch:
        if own_group:
            store = dist.FileStore(os.path.join(scratch, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        elif dist.get_world_size() != 1:
            raise ConversionError(f"etp-convert runs as one process (this one is rank {dist.get_rank()} of "
                                  f"{dist.get_world_size()}): run it without torchrun")
        own_state = not ps.model_parallel_is_initialized()
        if own_state:
            ps.initialize_model_parallel()
        try:
            yield
        finally:
            if own_state:
                ps.destroy_model_parallel()
            if own_group:
                dist.destroy_process_group()


@dataclass(frozen=True)
class MegatronTensor:
    """One tensor of etp's ``GPTModel`` at one rank: its state-dict name, shape and megatron-core
    sharded entry (``ShardedTensor`` or factory; ``pieces`` says where its elements lie in the
    checkpoint's global tensors)."""

    name: str
    shape: tuple[int, ...]
    entry: object

    @property
    def pieces(self):
        from etp.megatron.checkpoint.stock_segments import pieces_of

        return pieces_of(self.entry)


def one_rank_recipe(recipe):
    """The recipe at one rank with megatron-core's model layout: TP = PP = EP = CP = 1 (the
    vocabulary padded as the recipe's TP pads it) and etp's grouped experts (whose checkpoint
    keys are SequentialMLP's too)."""
    tp = recipe.parallel.tensor_model_parallel_size
    return recipe.replace(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        expert_tensor_parallel_size=1, context_parallel_size=1, sequence_parallel=False, world_size=None,
        make_vocab_size_divisible_by=recipe.model.make_vocab_size_divisible_by * tp, moe_grouped_gemm=True,
        moe_token_dispatcher_type="allgather", use_torch_fsdp2=False, use_megatron_fsdp=False,
        use_distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False)


def model_tensors(recipe, model_builder) -> tuple[dict[str, MegatronTensor], dict]:
    """(state-dict name -> ``MegatronTensor`` of every tensor, the other entries of the sharded
    state dict: megatron-core's ``_extra_state`` objects) of etp's ``GPTModel`` for ``recipe``
    at one rank. ``model_builder(recipe)`` builds it (etp-train's own model building,
    ``etp.train.convert_command.etp_model``), here on the meta device: no weight is allocated.
    Under ``single_process``.

    Example::

        tensors, objects = model_tensors(recipe, etp_model)
        tensors["decoder.layers.0.self_attention.linear_qkv.weight"].shape
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from etp.megatron.checkpoint.model_state import etp_sharded_state_dict

    with torch.device("meta"):
        model = model_builder(one_rank_recipe(recipe))
    tensors, objects = {}, {}
    for name, entry in etp_sharded_state_dict(model).items():
        if isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
            tensors[name] = MegatronTensor(name, tuple(entry.data.shape), entry)
        else:
            objects[name] = entry
    return tensors, objects


def _boxes(tensor: MegatronTensor, piece: Piece, data: torch.Tensor):
    """The checkpoint boxes of ``piece`` (``ShardedTensor`` views of ``data``, the piece's
    elements flattened) with the spans of ``data`` each holds."""
    first, stop = piece.megatron_span(tensor.shape)
    entry = tensor.entry
    return tensor.pieces.sharded_tensors(data, entry.key, entry.replica_id, slice(first, stop))


#: produces one box's data: (piece, first element in the piece, elements, box shape) -> tensor
BoxSource = Callable[[Piece, int, int, tuple], torch.Tensor]


def _lazy_strategy(producers: dict):
    """megatron-core's torch_dist format written synchronously (``sync_save_strategy``'s
    writer) whose planner makes each box's data when DCP writes it: the boxes of the state
    dict are meta tensors, ``producers[(key, global offset)]()`` the real ones."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class LazyPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            produce = producers.pop((write_item.index.fqn, tuple(write_item.index.offset or ())), None)
            if produce is None:
                return super().resolve_data(write_item)
            return produce()

    class LazySave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            planner = LazyPlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False)
            dcp.save(mcore_to_pyt_state_dict(state, False), planner=planner,
                     storage_writer=dcp.FileSystemWriter(checkpoint_dir, thread_count=1))

    return LazySave("torch_dist", 1)


def write_weights(root: Path, tensors: dict[str, MegatronTensor], objects: dict, pieces: list[Piece],
                  dtypes: dict[str, torch.dtype], source: BoxSource, metadata: dict) -> Path:
    """Writes a weights-only etp checkpoint (iteration 0) of ``tensors`` filled by ``pieces``
    into ``root`` and publishes it (etp.megatron.checkpoint.publish). A box's data is made by
    ``source`` when the writer reaches it and dropped once written: memory holds one box.
    ``dtypes``: each tensor's dtype. Returns the checkpoint directory.

    Example::

        write_weights(Path("ckpt"), tensors, objects, pieces, dtypes, source, {"kind": "weights"})
    """
    from megatron.core import dist_checkpointing

    from etp.megatron.checkpoint import save_checkpoint

    boxes: dict[str, list] = {name: [] for name in tensors}
    producers = {}
    for piece in pieces:
        tensor = tensors[piece.megatron]
        first, stop = piece.megatron_span(tensor.shape)
        placeholder = torch.empty(stop - first, dtype=dtypes[piece.megatron], device="meta")
        built, spans = _boxes(tensor, piece, placeholder)
        for box, (start, count) in zip(built, spans):
            producers[(box.key, tuple(box.global_offset))] = (
                lambda p=piece, s=start, c=count, shape=box.local_shape: source(p, s, c, shape))
        boxes[piece.megatron] += built
    state = {"model": {**boxes, **objects}, "iteration": 0}

    def save_fn(directory: Path) -> None:
        dist_checkpointing.save(state, str(directory), sharded_strategy=_lazy_strategy(producers))
        if producers:  # every box was planned, so DCP asked for each one
            raise ConversionError(f"{len(producers)} boxes were never written (etp-convert's plan and torch DCP's "
                                  "disagree): report this")

    return save_checkpoint(root, 0, save_fn, metadata)


def checkpoint_tensors(directory: Path) -> dict:
    """key -> (global shape, dtype) of every tensor in a checkpoint directory (torch DCP's
    metadata, read under ``etp.megatron.checkpoint.safe_unpickling``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata()
    return {key: (tuple(md.size), md.properties.dtype) for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def check_layout(tensors: dict[str, MegatronTensor], stored: dict, checkpoint: str, recipe: str) -> None:
    """Refuses a checkpoint whose tensors are not the recipe model's (keys and global shapes;
    the vocabulary's padding may differ, megatron-core's embedding allows it)."""
    for tensor in tensors.values():
        for segment in tensor.pieces.segments:
            key = tensor.entry.key + segment.suffix
            if key not in stored:
                raise ConversionError(f"{checkpoint} has no {key}, which the model of {recipe} has: export it with "
                                      "the recipe it was trained with")
            shape = stored[key][0]
            same = shape[1:] == segment.shape[1:] if segment.allow_shape_mismatch else shape == segment.shape
            if not same:
                raise ConversionError(f"{checkpoint}'s {key} is {list(shape)}, the model of {recipe} has "
                                      f"{list(segment.shape)}: export it with the recipe it was trained with")


def read_boxes(directory: Path, tensors: dict[str, MegatronTensor], wanted: list[tuple[Piece, torch.Tensor]]) -> None:
    """Loads each piece of ``wanted`` into its tensor (the piece's Hugging Face rows, a
    contiguous view) from the checkpoint ``directory``: one ``dist_checkpointing.load`` for the
    batch, each box read where the checkpoint holds it, whatever layout saved it. Runs inside
    ``load_checkpoint``'s verification and safe unpickling.

    The pieces of one megatron tensor are read as one span (from its first piece's first
    element to its last piece's last) and then copied out: torch DCP's reader loads a stored
    chunk whole for every request that touches it, and etp-train saves a layer's grouped experts
    as one chunk, so a request per expert would load that chunk once per expert (256 times a
    layer for Qwen3-30B-A3B's 128 experts). Memory holds the span beside the pieces' tensors:
    at most the largest megatron tensor more.

    Example::

        buffer = torch.empty(4096, 2048, dtype=torch.bfloat16)
        read_boxes(directory, tensors, [(piece, buffer)])
    """
    from megatron.core import dist_checkpointing

    by_tensor: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for piece, rows in wanted:
        by_tensor.setdefault(piece.megatron, []).append((piece, rows))
    request, targets, spans = [], [], []
    for name, pieces in by_tensor.items():
        tensor = tensors[name]
        bounds = [piece.megatron_span(tensor.shape) for piece, _ in pieces]
        first, stop = min(b[0] for b in bounds), max(b[1] for b in bounds)
        span = torch.empty(stop - first, dtype=pieces[0][1].dtype)
        entry = tensor.entry
        built, _ = tensor.pieces.sharded_tensors(span, entry.key, entry.replica_id, slice(first, stop))
        request += built
        targets += [box.data for box in built]
        spans.append((span, first, [(rows, b) for (_, rows), b in zip(pieces, bounds)]))
    loaded = dist_checkpointing.load({"boxes": request}, str(directory), validate_access_integrity=False)["boxes"]
    with torch.no_grad():
        for target, value in zip(targets, loaded, strict=True):
            if value.data_ptr() != target.data_ptr():
                target.copy_(value)
        for span, first, pieces in spans:
            for rows, (start, end) in pieces:
                rows.view(-1).copy_(span[start - first:end - first])
