"""megatron-core dist_checkpointing of ETP models (etp.megatron.checkpoint.model_state).

A CPU-built GPTModel with a dense SwiGLU layer (ColumnParallelLinear / RowParallelLinear,
megatron's gate / up factory) and an MoE layer (etp's grouped experts, or stock SequentialMLP)
is saved at one (TP, ETP) layout and loaded at others, including unwrapped stock megatron-core
models at ETP = 1; every full weight is compared bit for bit. Shapes are chosen so that
shards need padding, whole ranks hold only padding (linear_proj: 20 rows over 4 ranks of 8)
and shards straddle experts (fc1: 4 x 12 rows over 4 ranks of 16).
"""
import itertools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_distributed

pytest.importorskip("megatron.core")

HIDDEN, HEADS, FFN, MOE_FFN, EXPERTS, VOCAB, SEQ, ALIGN = 20, 4, 24, 6, 4, 64, 16, 8


def _sync_save_strategy():
    from etp.megatron.checkpoint import sync_save_strategy  # see its docstring

    return sync_save_strategy()


def _model(kind: str, seed: int, tp: int = 1, etp: int = 1, expert_etp: int | None = None):
    """GPTModel: layer 0 dense SwiGLU, layer 1 MoE with ``kind`` experts ("grouped": etp's,
    "sequential": stock). ETP applied when a size > 1; padding filled with 7 (load must
    zero it). The etp sharded state dict is installed except on the unwrapped stock model."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from etp import ETPConfig, ETPShardedParam
    from etp.megatron.checkpoint.model_state import install_etp_sharded_state_dict
    from etp.megatron.model import apply_etp, etp_gpt_layer_spec

    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=MOE_FFN,
        use_cpu_initialization=True, gated_linear_unit=True, add_bias_linear=False,
        activation_func=F.silu, moe_token_dispatcher_type="allgather", init_method_std=0.5,
        tensor_model_parallel_size=tp, sequence_parallel=False, expert_tensor_parallel_size=1,
        moe_layer_freq=[0, 1],  # tells megatron the layers differ: per-layer checkpoint keys
    )
    dense = get_gpt_layer_local_spec()
    moe = etp_gpt_layer_spec(num_experts=EXPERTS) if kind == "grouped" else get_gpt_layer_local_spec(num_experts=EXPERTS)
    spec = TransformerBlockSubmodules(layer_specs=[dense, moe], layer_norm=dense.submodules.input_layernorm)
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=False)
    expert_etp = expert_etp or etp
    if etp > 1 or expert_etp > 1:
        apply_etp(model, ETPConfig(etp_size=etp, expert_etp_size=expert_etp, pad_for_alignment=ALIGN))
        with torch.no_grad():
            for p in model.parameters():
                if isinstance(p, ETPShardedParam):
                    p.data[p.etp_layout.valid_rows :] = 7.0
    if kind == "grouped" or etp > 1 or expert_etp > 1:
        install_etp_sharded_state_dict(model)
    return model


def _weights(model) -> dict[str, torch.Tensor]:
    """Full logical weights (collective over ETP groups); SequentialMLP experts stacked under
    the grouped experts' names so that both kinds compare."""
    from etp import ETPShardedParam

    out, stacks = {}, {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, ETPShardedParam) else p.detach().clone()
        if ".local_experts." in name:  # decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight
            head, tail = name.split(".local_experts.")
            index, layer = tail.split(".", 1)
            stacks.setdefault(f"{head}.experts.{layer[len('linear_'):-len('.weight')]}_weight", {})[int(index)] = full
        else:
            out[name] = full
    for name, parts in stacks.items():
        out[name] = torch.stack([parts[i] for i in range(len(parts))])
    return out


def _padding_is_zero(model) -> bool:
    from etp import ETPShardedParam

    return all(
        not p.data[p.etp_layout.valid_rows :].any()
        for p in model.parameters() if isinstance(p, ETPShardedParam)
    )


def _save(model, path):
    _save_dict(model.sharded_state_dict(), path)


def _load(model, path):
    """Loads with padding rows made non-zero first (loading must zero them) and checks that
    ETP weights load in place: megatron's merged values are the parameters themselves."""
    from megatron.core import dist_checkpointing

    from etp import ETPShardedParam

    sharded = [p for p in model.parameters() if isinstance(p, ETPShardedParam)]
    with torch.no_grad():
        for param in sharded:
            param.data[param.etp_layout.valid_rows :] = 7.0
    loaded = dist_checkpointing.load(model.sharded_state_dict(), path)
    assert all(any(value is param for value in loaded.values()) for param in sharded)
    model.load_state_dict(loaded)


def _coverage(model) -> dict[str, torch.Tensor]:
    """How many ranks write each element of each checkpointed tensor (main replicas).
    A key may have holes: megatron stacks layers on one axis, and layer 0 has no router."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        apply_factories,
        is_main_replica,
    )

    sd = model.sharded_state_dict()
    apply_factories(sd)
    mine = [
        (t.key, t.global_shape, t.global_offset, (1,) * t.prepend_axis_num + t.local_shape)
        for t in nested_values(sd)
        if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id)
    ]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    counts: dict[str, torch.Tensor] = {}
    for key, shape, offset, size in itertools.chain(*everyone):
        count = counts.setdefault(key, torch.zeros(shape, dtype=torch.int32))
        count[tuple(slice(o, o + s) for o, s in zip(offset, size))] += 1
    return counts


def _assert_written_like(model, stock):
    """``model`` writes exactly the elements that the unwrapped ``stock`` model writes, under
    the same keys, each element exactly once."""
    got, want = _coverage(model), _coverage(stock)
    assert got.keys() == want.keys(), f"keys differ from stock megatron-core's: {sorted(got.keys() ^ want.keys())}"
    for key, count in want.items():
        assert int(count.max()) == 1, f"stock writes '{key}' more than once?"
        assert torch.equal(got[key], count), (
            f"'{key}': elements written {int((got[key] > 1).sum())} times too often, "
            f"{int(((got[key] == 0) & (count == 1)).sum())} missing"
        )


def _assert_same(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{what}: {name} differs"


def _tp1_layouts(ctx, root):
    """ETP=4 checkpoint -> ETP 4, 2, 1 (grouped experts) and stock SequentialMLP at ETP 1 and
    2; stock checkpoint -> ETP models."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    try:
        reference = _weights(_model("grouped", seed=0))
        saved = _model("grouped", seed=0, etp=4)
        _assert_same(_weights(saved), reference, "wrapped model")
        stock = _model("sequential", seed=5)
        _assert_written_like(saved, stock)
        # ETP = 2 of DP = 4: two copies of every shard, one of them written.
        _assert_written_like(_model("grouped", seed=0, etp=2), stock)
        _assert_written_like(_model("grouped", seed=0), stock)
        etp_dir, stock_dir = os.path.join(root, "etp4"), os.path.join(root, "stock")
        _save(saved, etp_dir)
        _save(stock, stock_dir)
        for kind, etp in (("grouped", 4), ("grouped", 2), ("grouped", 1), ("sequential", 1), ("sequential", 2)):
            model = _model(kind, seed=1, etp=etp)
            _load(model, etp_dir)
            _assert_same(_weights(model), reference, f"ETP=4 checkpoint into {kind} ETP={etp}")
            assert _padding_is_zero(model), f"padding not zero after loading into {kind} ETP={etp}"
        stock_weights = _weights(stock)
        for kind, etp in (("grouped", 4), ("sequential", 2)):
            model = _model(kind, seed=1, etp=etp)
            _load(model, stock_dir)
            _assert_same(_weights(model), stock_weights, f"stock checkpoint into {kind} ETP={etp}")
            assert _padding_is_zero(model)
        _optimizer_state(saved, reference, os.path.join(root, "optim"))
        return True
    finally:
        ps.destroy_model_parallel()


def _optimizer_state(saved, reference, path):
    """Adam-moment-like state (2 x weight) of the ETP=4 model, described with
    etp_sharded_tensors, loads into an ETP=2 model through megatron's own optimizer helper
    (make_sharded_optimizer_tensor on the model's entries) and into a stock ETP=1 model."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from etp import ETPShardedParam
    from etp.megatron.checkpoint.model_state import (
        etp_sharded_tensors,
        to_etp_sharded_state_dict,
    )

    prefix = "optimizer.state.exp_avg"
    model_sd = saved.sharded_state_dict()
    assert to_etp_sharded_state_dict(saved, model_sd) is model_sd  # idempotent
    state = {}
    for name, p in saved.named_parameters():
        if isinstance(p, ETPShardedParam):
            pieces = etp_sharded_tensors(p, 2 * p.detach(), model_sd, prefix)
            if pieces:  # all padding here: leave it out (an empty list would be common state)
                state[name] = pieces
    _save_dict(state, path)

    def expected(name):
        return 2 * reference[name]

    for kind, etp in (("grouped", 2), ("sequential", 1)):
        model = _model(kind, seed=1, etp=etp)
        params = dict(model.named_parameters())
        model_sd = model.sharded_state_dict()
        by_param = {id(e.data): e for e in _nested(model_sd)}
        names = [n for n, p in params.items() if isinstance(p, ETPShardedParam) or "experts" in n]
        request = {n: make_sharded_optimizer_tensor(by_param[id(params[n])], torch.full_like(params[n], 7.0), prefix)
                   for n in names}
        loaded = dist_checkpointing.load(request, path)
        got = {}
        for name in names:
            p, value = params[name], loaded[name]
            if isinstance(p, ETPShardedParam):
                assert not value[p.etp_layout.valid_rows :].any(), "optimizer state padding not zero"
                value = p.etp_layout.unpad(_gather_rows(value, p))
            got[name] = value
        for name, value in got.items():
            if ".local_experts." in name:
                head, tail = name.split(".local_experts.")
                index, layer = tail.split(".", 1)
                want = expected(f"{head}.experts.{layer[len('linear_'):-len('.weight')]}_weight")[int(index)]
            else:
                want = expected(name)
            assert torch.equal(value, want), f"optimizer state {name} into {kind} ETP={etp}"


def _nested(sd):
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return list(nested_values(sd))


def _gather_rows(shard, param):
    parts = [torch.empty_like(shard) for _ in param.etp_group.ranks]
    dist.all_gather(parts, shard.contiguous(), group=param.etp_group.ag_group)
    return torch.cat(parts)


def _save_dict(state, path):
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    dist_checkpointing.save(state, path, sharded_strategy=_sync_save_strategy())


def _tp2_to_tp1(root):
    """TP=2 x ETP=2 (experts ETP=4 across TP peers) -> TP=1 x ETP=4 and TP=1 x ETP=1, against
    the same weights saved at TP=2 without ETP."""
    from megatron.core import parallel_state as ps

    etp_dir, plain_dir = os.path.join(root, "tp2etp2"), os.path.join(root, "tp2")
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
    try:
        saved = _model("grouped", seed=0, tp=2, etp=2, expert_etp=4)
        plain = _model("grouped", seed=0, tp=2)
        _assert_written_like(saved, plain)
        _assert_written_like(_model("grouped", seed=0, tp=2, etp=2, expert_etp=2), plain)
        _save(saved, etp_dir)
        _save(plain, plain_dir)
    finally:
        ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    try:
        reference = _model("grouped", seed=2)
        _load(reference, plain_dir)
        reference = _weights(reference)
        for etp in (4, 1):
            model = _model("grouped", seed=1, etp=etp)
            _load(model, etp_dir)
            _assert_same(_weights(model), reference, f"TP=2 x ETP=2 checkpoint into TP=1 x ETP={etp}")
            assert _padding_is_zero(model)
    finally:
        ps.destroy_model_parallel()


def _ep2_to_ep1(root):
    """EP=2 x expert ETP=2 (2 local experts per rank, shards straddling them) -> EP=1 x
    ETP=4: the expert axis of the checkpoint is global."""
    from megatron.core import parallel_state as ps

    path = os.path.join(root, "ep2")
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        saved = _model("grouped", seed=0, etp=2, expert_etp=2)
        reference = _weights(saved)
        ep_group = ps.get_expert_model_parallel_group()
        for name in [n for n in reference if ".experts.experts." in n]:
            parts = [torch.empty_like(reference[name]) for _ in range(dist.get_world_size(ep_group))]
            dist.all_gather(parts, reference[name], group=ep_group)
            reference[name] = torch.cat(parts)  # all experts, in expert-parallel rank order
        _save(saved, path)
    finally:
        ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    try:
        model = _model("grouped", seed=1, etp=4)
        _load(model, path)
        _assert_same(_weights(model), reference, "EP=2 checkpoint into EP=1 x ETP=4")
        assert _padding_is_zero(model)
    finally:
        ps.destroy_model_parallel()


def _other_layouts(ctx, root):
    _tp2_to_tp1(root)
    _ep2_to_ep1(root)
    return True


def _spawn(fn):
    with tempfile.TemporaryDirectory() as root:
        assert run_distributed(fn, 4, root) == [True] * 4


def test_checkpoint_across_etp_sizes_and_stock_models(tmp_path_factory):
    # _tp1_layouts runs in test_checkpoint_train's shared 4-rank spawn (one start-up less).
    from test_checkpoint_train import shared_body

    assert shared_body(tmp_path_factory, "model_layouts") == [True] * 4


@pytest.mark.slow  # TP 2 x ETP 2 resharding runs by default in test_checkpoint_train's tp2xetp2 case
def test_checkpoint_tp2_etp2_and_ep2_load_at_tp1_ep1():
    _spawn(_other_layouts)


def test_boxes_cover_flat_ranges_in_order():
    from etp.megatron.checkpoint.pieces import _boxes

    shape = (3, 4, 5)
    index = torch.arange(60).view(shape)
    for start, stop in itertools.combinations(range(61), 2):
        boxes = _boxes(shape, start, stop)
        assert len(boxes) <= 2 * len(shape) - 1
        got = [index[tuple(slice(o, o + s) for o, s in zip(offset, size))].flatten() for offset, size in boxes]
        assert torch.equal(torch.cat(got), torch.arange(start, stop)), (start, stop, boxes)


def test_pieces_of_a_flattened_range():
    """The distributed optimizer's convention: data is a 1-D slice of the flattened shard."""
    from etp.megatron.checkpoint.pieces import ETPPieces, _Segment

    glob = torch.arange(6 * 4 * 5, dtype=torch.float32).view(6, 4, 5)
    logical = glob[3:]  # this TP rank's [3, 4, 5] weight sits at offset 3 of the global one
    # shard rows 5..10 of the [12, 5] view: rows 5..11 valid (7 rows), one padding row
    pieces = ETPPieces("w", 5 * 5, 7 * 5, (_Segment(0, "", (6, 4, 5), (3, 0, 0), (3, 4, 5)),))
    shard = torch.zeros(8, 5)
    shard[:7] = logical.reshape(12, 5)[5:]
    for first, stop in ((0, 40), (7, 30), (33, 40), (12, 13)):
        data = shard.reshape(-1)[first:stop]
        tensors, spans = pieces.sharded_tensors(data, "w", 0, slice(first, stop))
        assert sum(t.data.numel() for t in tensors) == max(0, min(stop, 35) - first)
        for t, (at, _count) in zip(tensors, spans):
            box = tuple(slice(o, o + n) for o, n in zip(t.global_offset, t.local_shape))
            assert torch.equal(t.data, glob[box]) and t.data.data_ptr() == data[at:].data_ptr()
    with pytest.raises(ValueError, match="pass the slice the tensor was cut from"):
        pieces.sharded_tensors(shard.reshape(-1)[:10], "w", 0, slice(0, 12))


def test_replica_index_rejects_etp_groups_outside_data_parallelism():
    from etp.megatron.checkpoint.model_state import _replica_index

    with pytest.raises(ValueError, match="build_megatron_etp_groups"):
        _replica_index((0, 5), (0, 1, 2, 3), "w")


def test_install_rejects_plain_modules():
    pytest.importorskip("megatron.core")
    from etp.megatron.checkpoint.model_state import install_etp_sharded_state_dict

    with pytest.raises(ValueError, match="no sharded_state_dict"):
        install_etp_sharded_state_dict(torch.nn.Linear(2, 2))
