"""ETP weights in megatron-core ``dist_checkpointing``: pieces of the full logical weights.

[Note: ETP checkpoint pieces]
megatron-core 0.16 describes a checkpointed tensor per rank with ``ShardedTensor`` boxes of
the global tensor; ``flattened_range`` is gone (constructing one raises), but a key may be
cut into *irregular* boxes (``axis_fragmentations=None``: any offsets and sizes, several boxes
per rank), which torch DCP stores as chunks and reshards on load by box intersection. So a
checkpoint holds each weight under megatron's own key and global shape whatever the layout
that saved it, and a checkpoint saved at one (TP, ETP) layout loads at any other, including
ETP = 1 (stock megatron-core modules) and stock checkpoints into ETP models.

An ETP shard holds a contiguous range of the TP-local weight's flattened rows (see
[Note: ETP shard layout]); megatron's stock description of that TP-local weight is a list of
*segments*: contiguous element ranges of it, each filling a box of the global tensor in
row-major order (one segment for a ColumnParallelLinear / RowParallelLinear weight, two for
a SwiGLU ``linear_fc1`` whose gate and up halves lie apart globally, one per expert stack).
The shard's valid range is intersected with every segment and each intersection is cut into
at most ``2 * ndim - 1`` boxes (partial row, whole rows, partial row, ... for every axis), so
a shard that straddles experts or the gate / up boundary becomes a handful of boxes. Padding
rows are in no box: never written, and left zero by loading.

Replica ids: an ETP shard is replicated only across ETP groups (the ranks of megatron's
data-parallel group, with context parallelism, at the same ETP position); the shard is the
main replica on the ETP group holding the data-parallel group's first rank, so each piece is
written exactly once. Replicated parameters (norms, biases, routers) keep megatron's ids:
ETP peers are data-parallel ranks, so only data-parallel rank 0 is main.

``ETPGroupedExperts`` weights are saved under ``SequentialMLP``'s keys
(``<mlp>.experts.experts.linear_fc1.weight``: ``[E, 2 * ffn, hidden]`` per layer with gate rows
first, ``...linear_fc2.weight``: ``[E, hidden, ffn]``; the expert axis global under EP), so
its checkpoints load into stock megatron-core MoE layers and back.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...param import ETPShardedParam
from ...wrap import is_expert_param

__all__ = [
    "ETPPieces",
    "etp_sharded_state_dict",
    "etp_sharded_tensors",
    "install_etp_sharded_state_dict",
    "pieces_of",
    "to_etp_sharded_state_dict",
]

_TEMPLATE, _SPANS, _PIECES = "etp_template", "etp_spans", "pieces"
# ETPGroupedExperts' weights (``<experts>.experts.fc1_weight``) -> SequentialMLP's checkpoint
# keys (``<experts>.experts.linear_fc1.weight``: SequentialMLP renames ``local_experts.<i>.``
# to ``experts.`` and puts the expert index on a global axis).
_GROUPED_KEYS = {"fc1_weight": "linear_fc1.weight", "fc2_weight": "linear_fc2.weight"}


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


# ----------------------------------------------------------------- stock descriptions
def _segments_of_tensor(sh_ten, logical: tuple[int, ...]) -> tuple[_Segment, ...]:
    """megatron's ShardedTensor for a weight, rebuilt for its logical TP-local shape: it was
    made from the shard, but ``from_rank_offsets`` sets each offset to chunk x local size,
    so the chunk indices (TP rank, expert index) survive."""
    p = sh_ten.prepend_axis_num
    local = sh_ten.local_shape
    frags = sh_ten.axis_fragmentations
    if frags is None:
        raise ValueError(f"'{sh_ten.key}' already has an irregular sharding; etp cannot re-cut it")
    frags = frags[p:]
    if all(f == 1 for f in frags):  # replicated over TP: the whole weight, at the origin
        shape, offset = logical, (0,) * len(logical)
    elif len(local) == len(logical):
        offset = tuple((o // n) * d for o, n, d in zip(sh_ten.global_offset[p:], local, logical))
        shape = tuple(f * d for f, d in zip(frags, logical))
    else:
        raise ValueError(
            f"'{sh_ten.key}': a {len(logical)}-D weight sharded by megatron along "
            f"{frags} cannot be described from its 2-D ETP shard; keep that module out of ETP "
            "(apply_etp's filter_fn)"
        )
    return (_Segment(0, "", sh_ten.global_shape[:p] + shape, sh_ten.global_offset[:p] + offset,
                     (1,) * p + tuple(logical), sh_ten.allow_shape_mismatch),)


def _segments_of_factory(factory, logical: tuple[int, ...]) -> tuple[_Segment, ...]:
    """Runs megatron's factory (e.g. SwiGLU's gate / up split) on a meta tensor of the
    logical TP-local shape and reads where each ShardedTensor's data lies in it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    placeholder = torch.empty(logical, dtype=factory.data.dtype, device="meta")
    built = factory.build_fn(factory.key, placeholder, factory.replica_id, None)
    built = built if isinstance(built, (dict, list)) else [built]
    segments = []
    for sh_ten in nested_values(built):
        if not isinstance(sh_ten, ShardedTensor):
            continue
        data = sh_ten.data
        if not (data is placeholder or data._base is placeholder) or not data.is_contiguous():
            raise ValueError(
                f"megatron's factory for '{factory.key}' transforms the weight beyond contiguous "
                "slices; etp cannot map its shards onto it: keep that module out of ETP"
            )
        if not sh_ten.key.startswith(factory.key):
            raise ValueError(f"factory '{factory.key}' builds an unrelated key '{sh_ten.key}'")
        p = sh_ten.prepend_axis_num
        segments.append(_Segment(
            data.storage_offset() - placeholder.storage_offset(), sh_ten.key[len(factory.key):],
            sh_ten.global_shape, sh_ten.global_offset, (1,) * p + tuple(sh_ten.local_shape),
            sh_ten.allow_shape_mismatch,
        ))
    segments.sort(key=lambda s: s.start)
    covered = 0
    for seg in segments:
        if seg.start != covered:
            break
        covered += seg.numel
    if covered != math.prod(logical):
        raise ValueError(f"megatron's factory for '{factory.key}' does not cover the weight exactly once")
    return tuple(segments)


def _segments_of_grouped_experts(sh_ten, logical: tuple[int, ...], suffix: str):
    """ETPGroupedExperts' stacked ``[E_local, rows, cols]`` weight as SequentialMLP's global
    ``[E, rows, cols]`` tensor, this rank's experts at its expert-parallel offset."""
    from megatron.core import parallel_state

    ep_size = parallel_state.get_expert_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    if not sh_ten.key.endswith(suffix):
        raise ValueError(f"'{sh_ten.key}': expected an ETPGroupedExperts key ending in '{suffix}'")
    p = sh_ten.prepend_axis_num
    key = sh_ten.key[: -len(suffix)] + _GROUPED_KEYS[suffix]
    segment = _Segment(
        0, "", sh_ten.global_shape[:p] + (logical[0] * ep_size, *logical[1:]),
        sh_ten.global_offset[:p] + (logical[0] * ep_rank, 0, 0), (1,) * p + tuple(logical),
    )
    return key, (segment,)


def pieces_of(entry) -> ETPPieces:
    """The ``ETPPieces`` of any parameter entry of a sharded state dict: an ETP factory's own,
    or one built from megatron's stock ``ShardedTensor`` / factory (the whole param, starting
    at element 0), so that a 1-D slice of any flattened param (the distributed optimizer's
    state) can be described as boxes of the global tensor.

    Example::

        boxes, _ = pieces_of(entry).sharded_tensors(exp_avg_slice, "optimizer.exp_avg." + entry.key,
                                                    entry.replica_id, slice(start, stop))
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        if isinstance(entry.build_fn, ETPPieces):
            return entry.build_fn
        logical = tuple(entry.data.shape)
        return ETPPieces(entry.key, 0, math.prod(logical), _segments_of_factory(entry, logical))
    logical = tuple(entry.data.shape)
    return ETPPieces(entry.key, 0, math.prod(logical), _segments_of_tensor(entry, logical))


# ----------------------------------------------------------------- replica ids
def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else (dist.get_rank(),)


def _replica_index(shard_ranks: tuple[int, ...], domain: tuple[int, ...], name: str) -> int:
    """0 on the ranks that write a shard, else this rank's position in ``domain`` (the ranks
    that hold the same model slice). ETP groups partition the domain, so exactly one of them
    holds ``domain[0]``; its members are the writers, one per ETP position."""
    if not set(shard_ranks) <= set(domain):
        raise ValueError(
            f"'{name}' is sharded over ranks {list(shard_ranks)}, which are not all in its "
            f"data-parallel group {list(domain)}: build the ETP groups with "
            "etp.megatron.groups.build_megatron_etp_groups (ETP inside data parallelism)"
        )
    return 0 if domain[0] in shard_ranks else domain.index(dist.get_rank())


def _with_replica(replica_id, index: int):
    """megatron's (PP, TP, DP) replica id with the data-parallel coordinate replaced."""
    if isinstance(replica_id, int):
        return (replica_id, index)
    return (*replica_id[:-1], index)


# ----------------------------------------------------------------- conversion
def _drop_extra_state_keys(module, incompatible_keys) -> None:
    """load_state_dict post-hook: the placeholder ``_extra_state`` entries below come back from
    a load but are no state of the module (megatron's GroupedMLP does the same)."""
    unexpected = incompatible_keys.unexpected_keys
    for key in [k for k in unexpected if k.endswith("._extra_state")]:
        unexpected.remove(key)


def _grouped_expert_params(model: torch.nn.Module) -> dict[int, str]:
    """id -> attribute name of every ETPGroupedExperts weight; hooks those modules' loading."""
    from ..model import ETPGroupedExperts

    found = {}
    for module in model.modules():
        if isinstance(module, ETPGroupedExperts):
            found[id(module.experts.fc1_weight)] = "fc1_weight"
            found[id(module.experts.fc2_weight)] = "fc2_weight"
            if not getattr(module, "_etp_extra_state_hook", False):
                module.register_load_state_dict_post_hook(_drop_extra_state_keys)
                module._etp_extra_state_hook = True
    return found


def _expert_extra_states(dict_key: str, sh_ten, suffix: str, num_local: int, replica_id) -> dict:
    """Empty ``_extra_state`` objects of every expert's linear, as SequentialMLP saves them
    (and megatron's GroupedMLP fakes them): without them a stock MoE layer cannot load our
    checkpoints."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    ep_size = parallel_state.get_expert_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    p = sh_ten.prepend_axis_num
    linear = _GROUPED_KEYS[suffix].split(".")[0]  # linear_fc1
    key = f"{sh_ten.key[: -len(suffix)]}{linear}._extra_state"
    dict_prefix = dict_key[: -len(f"experts.{suffix}")]
    objects = {}
    for local in range(num_local):
        expert = ep_rank * num_local + local
        objects[f"{dict_prefix}expert{expert}.{linear}._extra_state"] = ShardedObject(
            key, None, (*sh_ten.global_shape[:p], num_local * ep_size),
            (*sh_ten.global_offset[:p], expert), replica_id,
        )
    return objects


def to_etp_sharded_state_dict(model: torch.nn.Module, sharded_state_dict: dict, metadata: dict | None = None) -> dict:
    """Rewrites, in place, a sharded state dict that megatron-core made for ``model`` so that
    ETP weights are described as pieces of their full logical weights (see
    [Note: ETP checkpoint pieces]); returns it. Idempotent.

    Each ETP weight (and each ``ETPGroupedExperts`` weight, sharded or not) becomes a
    ``ShardedTensorFactory`` under megatron's key whose data is the parameter: megatron's
    optimizers match it by identity and ``make_sharded_optimizer_tensor`` reuses it for
    optimizer state. Loading returns the shard with padding rows zero. ``ETPGroupedExperts``
    also gets the per-expert ``_extra_state`` placeholders SequentialMLP expects, and a
    load_state_dict hook that ignores them coming back.

    Raises:
        ValueError: an ETP group reaches outside its data-parallel group, or a megatron
            module describes a sharded weight in a way etp cannot map.

    Example::

        sd = to_etp_sharded_state_dict(model, model.sharded_state_dict())
    """
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )

    grouped = _grouped_expert_params(model)
    dp_group = (metadata or {}).get("dp_cp_group")
    if dp_group is None:
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    domains = {False: _ranks(dp_group), True: _ranks(parallel_state.get_expert_data_parallel_group())}

    def convert(entry):
        factory = isinstance(entry, ShardedTensorFactory)
        if factory and isinstance(entry.build_fn, ETPPieces):
            return entry  # converted already
        if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
            return entry
        param = entry.data
        sharded = isinstance(param, ETPShardedParam)
        if not sharded and id(param) not in grouped:
            return entry
        logical = tuple(param.logical_shape) if sharded else tuple(param.shape)
        key = entry.key
        if id(param) in grouped:
            if factory:
                raise ValueError(f"'{key}': unexpected factory for an ETPGroupedExperts weight")
            key, segments = _segments_of_grouped_experts(entry, logical, grouped[id(param)])
        elif factory:
            segments = _segments_of_factory(entry, logical)
        else:
            segments = _segments_of_tensor(entry, logical)
        expert = id(param) in grouped or is_expert_param(param)
        shard_ranks = param.etp_group.ranks if sharded else (dist.get_rank(),)
        index = _replica_index(tuple(shard_ranks), domains[expert], key)
        replica_id = (0, 0, index) if id(param) in grouped else _with_replica(entry.replica_id, index)
        if sharded:
            layout = param.etp_layout
            pieces = ETPPieces(key, layout.row_start * layout.cols, layout.valid_rows * layout.cols, segments)
        else:
            pieces = ETPPieces(key, 0, param.numel(), segments)
        return ShardedTensorFactory(key, param, pieces, _merge, replica_id)

    def walk(node):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            if isinstance(v, (dict, list)):
                walk(v)
                continue
            node[k] = convert(v)
            if isinstance(node, dict) and node[k] is not v and id(v.data) in grouped:
                suffix = grouped[id(v.data)]
                num_local = (v.data.logical_shape if isinstance(v.data, ETPShardedParam) else v.data.shape)[0]
                # Replicated over the whole expert-data-parallel group, ETP peers included.
                replica_id = (0, 0, domains[True].index(dist.get_rank()))
                node.update(_expert_extra_states(k, v, suffix, num_local, replica_id))

    walk(sharded_state_dict)
    return sharded_state_dict


def etp_sharded_state_dict(model: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
    """``model``'s megatron-core sharded state dict with ETP weights described as pieces of
    their full logical weights (megatron's keys and global shapes, padding excluded).

    Example::

        sd = etp_sharded_state_dict(model)
        dist_checkpointing.save(sd, ckpt_dir)
        model.load_state_dict(dist_checkpointing.load(etp_sharded_state_dict(model), ckpt_dir))
    """
    stock = type(model).sharded_state_dict(model, prefix, sharded_offsets, metadata)
    return to_etp_sharded_state_dict(model, stock, metadata)


def install_etp_sharded_state_dict(model: torch.nn.Module) -> torch.nn.Module:
    """Makes ``model.sharded_state_dict(...)`` return ``etp_sharded_state_dict(model, ...)``,
    so that Megatron-LM's checkpointing and megatron-core's optimizers, which call it, save
    and load ETP weights correctly. Idempotent; returns ``model``.

    Call it on the bare megatron-core model (``GPTModel``), after or before ``apply_etp``
    (the conversion happens at each call), and before wrapping in ``Float16Module`` / DDP
    (wrappers forward to the inner model's method).

    Raises:
        ValueError: ``model`` has no megatron-core ``sharded_state_dict``.

    Example::

        apply_etp(model, config)
        install_etp_sharded_state_dict(model)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    """
    if getattr(type(model), "sharded_state_dict", None) is None:
        raise ValueError(
            f"{type(model).__name__} has no sharded_state_dict: install on the megatron-core "
            "model itself (e.g. the GPTModel), not on a plain torch module"
        )
    # A bound method (not a closure) so that deepcopy rebinds it to the copy.
    model.sharded_state_dict = types.MethodType(etp_sharded_state_dict, model)
    return model


def etp_sharded_tensors(param: torch.Tensor, tensor: torch.Tensor, model_sharded_state_dict: dict,
                        prefix: str, replica_id=None, flattened_range: slice | None = None) -> list:
    """ShardedTensors for ``tensor``'s valid part (views of it), for optimizer state.

    ``tensor`` has ``param``'s shard shape (an Adam moment, an fp32 master copy), or is the
    1-D slice ``flattened_range`` of it. The keys are the weight's keys with
    ``f"{prefix}."`` in front (megatron's optimizer convention, e.g.
    ``optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight``); loading writes into
    ``tensor``'s valid rows and leaves its padding untouched. Empty on a rank whose shard is
    all padding: leave that entry out of the state dict (megatron would store an empty list
    as common state). ``replica_id`` defaults to the weight's (written once per ETP
    position). megatron's own ``make_sharded_optimizer_tensor(entry, tensor, prefix)`` on the
    model's entry gives the same pieces as a factory whose load returns a zero-padded tensor.

    Raises:
        ValueError: ``param`` is not described by ``model_sharded_state_dict`` (make it with
            ``etp_sharded_state_dict`` or an installed ``model.sharded_state_dict()``).

    Example::

        model_sd = model.sharded_state_dict()
        state = etp_sharded_tensors(param, opt.state[param]["exp_avg"], model_sd,
                                    "optimizer.state.exp_avg")
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for entry in nested_values(model_sharded_state_dict):
        if isinstance(entry, ShardedTensorFactory) and entry.data is param and isinstance(entry.build_fn, ETPPieces):
            key = f"{prefix}.{entry.key}" if prefix else entry.key
            replica = entry.replica_id if replica_id is None else replica_id
            return entry.build_fn.sharded_tensors(tensor, key, replica, flattened_range)[0]
    raise ValueError(
        "the parameter has no ETP entry in this sharded state dict: make it with "
        "etp_sharded_state_dict(model) (or install_etp_sharded_state_dict(model) first)"
    )
