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

import types

import torch
import torch.distributed as dist

from ...param import ETPShardedParam
from ...wrap import is_expert_param
from .pieces import ETPPieces, _merge
from .stock_segments import (
    _GROUPED_KEYS,
    _segments_of_factory,
    _segments_of_grouped_experts,
    _segments_of_tensor,
    pieces_of,
)

__all__ = [
    "ETPPieces",
    "etp_sharded_state_dict",
    "etp_sharded_tensors",
    "install_etp_sharded_state_dict",
    "pieces_of",
    "to_etp_sharded_state_dict",
]


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
