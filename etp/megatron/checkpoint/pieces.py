"""The geometry of an ETP weight in a megatron-core checkpoint: a shard's valid elements cut
into ``ShardedTensor`` boxes of the full logical weight (``ETPPieces``, the factory's
``build_fn``) and put back on load (``_merge``, its ``merge_fn``). See
[Note: ETP checkpoint pieces] in ``etp/megatron/checkpoint/model_state.py``."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ETPPieces"]

_TEMPLATE, _SPANS, _PIECES = "etp_template", "etp_spans", "pieces"


def _boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The row-major element range ``[start, stop)`` of a tensor of ``shape`` as boxes
    ``(offset, size)``, in order: a partial leading slice, whole slices, a partial trailing
    slice, recursively (at most ``2 * len(shape) - 1`` boxes).

    Example::

        _boxes((3, 4), 2, 11)   # [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    first, last = start // inner, stop // inner
    rest = tuple(shape[1:])
    zeros = (0,) * len(rest)
    if start % inner == 0 and stop % inner == 0:
        return [((first, *zeros), (last - first, *rest))]
    if first == last:
        return [((first, *o), (1, *s)) for o, s in _boxes(rest, start % inner, stop % inner)]
    out = []
    whole_from = first
    if start % inner:
        out += [((first, *o), (1, *s)) for o, s in _boxes(rest, start % inner, inner)]
        whole_from = first + 1
    if last > whole_from:
        out.append(((whole_from, *zeros), (last - whole_from, *rest)))
    if stop % inner:
        out += [((last, *o), (1, *s)) for o, s in _boxes(rest, 0, stop % inner)]
    return out


@dataclass(frozen=True)
class _Segment:
    """Elements ``[start, start + numel)`` of the TP-local weight fill the box ``box`` at
    ``offset`` of the global tensor ``key + suffix`` (of ``shape``) in row-major order."""

    start: int
    suffix: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    box: tuple[int, ...]
    allow_shape_mismatch: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.box)


@dataclass(frozen=True)
class ETPPieces:
    """How one ETP shard (or any tensor of its shape) maps onto the full logical weight.

    It is the ``build_fn`` of the ``ShardedTensorFactory`` that stands for the parameter in an
    ETP model's sharded state dict, so megatron-core's optimizers (``make_sharded_optimizer_tensor``
    replaces the factory's key and data) describe optimizer state the same way.

    Attributes:
        key: megatron-core's checkpoint key of the weight.
        start: element of the TP-local logical weight held by element 0 of the shard.
        valid: elements of the shard that hold logical data (padding excluded).
        segments: megatron's description of the TP-local weight, see [Note: ETP checkpoint pieces].
    """

    key: str
    start: int
    valid: int
    segments: tuple[_Segment, ...]

    def sharded_tensors(self, data: torch.Tensor, key: str, replica_id, flattened_range: slice | None = None):
        """The ``ShardedTensor`` boxes of ``data``'s valid part (views of ``data``) and their
        element spans ``(first, count)`` in ``data``; empty on a rank holding only padding.

        ``data`` has the shard's shape (or is the 1-D slice ``flattened_range`` of the
        flattened shard, megatron's distributed-optimizer convention).
        """
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        flat = data.reshape(-1)  # a view: loading writes into ``data`` in place
        first = 0
        if flattened_range is not None:
            first = flattened_range.start
            if flattened_range.stop - first != flat.numel():
                raise ValueError(
                    f"flattened_range {flattened_range} holds {flattened_range.stop - first} elements "
                    f"but the tensor has {flat.numel()}: pass the slice the tensor was cut from"
                )
        elif flat.numel() < self.valid:
            raise ValueError(
                f"a tensor of {flat.numel()} elements cannot hold the {self.valid} valid elements of "
                f"'{self.key}': pass a tensor of the parameter's shard shape"
            )
        base = self.start + first  # logical element held by flat[0]
        stop = base + max(0, min(flat.numel(), self.valid - first))
        pieces, spans = [], []
        for seg in self.segments:
            lo, hi = max(base, seg.start), min(stop, seg.start + seg.numel)
            cursor = lo - base
            for offset, size in _boxes(seg.box, lo - seg.start, hi - seg.start):
                count = math.prod(size)
                piece = flat[cursor : cursor + count].view(size)
                pieces.append(ShardedTensor(
                    key + seg.suffix, piece, piece.dtype, tuple(size), seg.shape,
                    tuple(o + b for o, b in zip(seg.offset, offset)), None, replica_id,
                    allow_shape_mismatch=seg.allow_shape_mismatch,
                ))
                spans.append((cursor, count))
                cursor += count
        return pieces, spans

    def __call__(self, key: str, data: torch.Tensor, replica_id, flattened_range: slice | None = None):
        """megatron's ``build_fn`` contract. ``data`` also comes back on load (a non-persistent
        template): the merge needs its shape and dtype, and a rank holding only padding
        would otherwise have nothing to merge."""
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

        pieces, spans = self.sharded_tensors(data, key, replica_id, flattened_range)
        if not pieces:  # only padding here: nothing to save, zeros to load
            return LocalNonpersistentObject(data)
        return {
            _TEMPLATE: LocalNonpersistentObject(data),
            _SPANS: LocalNonpersistentObject(tuple(spans)),
            _PIECES: pieces,
        }


def _merge(loaded) -> torch.Tensor:
    """megatron's ``merge_fn``: the shard-shaped tensor with the loaded pieces in place and
    padding rows zero. It is the loading tensor itself (the parameter, the optimizer state):
    megatron loads each piece in place into its ``data``, a view of that tensor, so loading
    needs no second copy of the model and optimizer state; a piece that is not a view
    (a non-contiguous template) is copied in."""
    template = loaded[_TEMPLATE] if isinstance(loaded, dict) else loaded
    with torch.no_grad():
        if not isinstance(loaded, dict):  # only padding on this rank
            return template.zero_()
        contiguous = template.is_contiguous()
        flat = template.view(-1) if contiguous else template.reshape(-1).clone()
        covered = 0
        for (first, count), piece in sorted(zip(loaded[_SPANS], loaded[_PIECES]), key=lambda item: item[0][0]):
            flat[covered:first].zero_()  # padding (or a gap) before this piece
            target = flat[first : first + count]
            if piece.data_ptr() != target.data_ptr():
                target.copy_(piece.reshape(-1))
            covered = first + count
        flat[covered:].zero_()
        if not contiguous:
            template.copy_(flat.view(template.shape))
    return template
