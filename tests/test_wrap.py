"""wrap_module_params_etp: size 1 is a no-op, idempotence, refusals, preserved attributes,
byte accounting."""
import copy

import pytest
import torch
from harness import run_distributed
from torch import nn

from etp import (
    ETPConfig,
    ETPGroups,
    ETPShardedParam,
    GroupedSwiGLUExperts,
    ShardGroup,
    build_etp_groups,
    shard_parameter,
    wrap_module_params_etp,
)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))
    model.add_module("experts", GroupedSwiGLUExperts(4, 8, 6))
    return model


def _size_one_is_noop(ctx):
    model = _model()
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    forwards = [m.forward for m in model]
    summary = wrap_module_params_etp(model, ETPConfig(), build_etp_groups(ETPConfig()))
    assert summary.params_wrapped == 0 and summary.bytes_after == summary.bytes_before
    for name, p in model.named_parameters():
        assert p is before[name][0] and type(p) is nn.Parameter
        assert torch.equal(p, before[name][1])
    assert [m.forward for m in model] == forwards
    assert not any(hasattr(m, "_etp_wrapped") for m in model.modules())


def test_size_one_leaves_model_byte_identical():
    run_distributed(_size_one_is_noop, 1)


def _wrap_checks(ctx):
    config = ETPConfig(etp_size=2, expert_etp_size=2, pad_for_alignment=4)
    groups = build_etp_groups(config)
    model = _model()
    model[0].weight.allreduce = True
    model[0].weight.tensor_model_parallel = True
    model[0].weight.partition_dim = 0
    model[2].weight.requires_grad_(False)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    summary = wrap_module_params_etp(model, config, groups)
    assert summary.wrapped == ["0.weight", "2.weight", "experts.fc1_weight", "experts.fc2_weight"]

    # Attributes and requires_grad survive; expert flags route to the expert group.
    w0 = model[0].weight
    assert isinstance(w0, ETPShardedParam)
    assert (w0.allreduce, w0.tensor_model_parallel, w0.partition_dim) == (True, True, 0)
    assert w0.row_range == (ctx.rank * 16, ctx.rank * 16 + 16)  # 30 rows -> 32 padded -> 16 each
    assert w0.padding_rows == (2 if ctx.rank == 1 else 0)
    assert model[2].weight.requires_grad is False
    assert model.experts.fc1_weight.is_expert and model.experts.fc1_weight.allreduce is False
    assert model[0].bias.__class__ is nn.Parameter

    # Byte accounting by hand: shard rows = rows padded to a multiple of align x N = 8, over N.
    def shard_bytes(rows, cols, align=4, world=2):
        unit = align * world
        return (max(unit, -(-rows // unit) * unit) // world) * cols * 4
    expected_after = (
        shard_bytes(30, 8) + 30 * 4 + shard_bytes(8, 30) + 8 * 4
        + shard_bytes(4 * 12, 8) + shard_bytes(4 * 8, 6)
    )
    expected_before = sum(t.numel() * 4 for t in full.values())
    assert (summary.bytes_before, summary.bytes_after) == (expected_before, expected_after)

    # Idempotent: a second call wraps nothing and replaces nothing.
    params = list(model.parameters())
    again = wrap_module_params_etp(model, config, groups)
    assert again.params_wrapped == 0 and list(model.parameters()) == params

    # A parameter is never sharded twice.
    with pytest.raises(ValueError, match="already ETP-sharded"):
        shard_parameter(w0, groups.dense, config)

    # deepcopy keeps the shard metadata (and shares the process groups).
    clone = copy.deepcopy(model)
    assert clone[0].weight.etp_layout == w0.etp_layout and torch.equal(clone[0].weight, w0)
    assert torch.equal(w0.full_tensor(), full["0.weight"])

    # A weight shared with a module that reads it directly is refused.
    emb = nn.Embedding(30, 8)
    tied = nn.ModuleDict({"emb": emb, "head": nn.Linear(8, 30, bias=False)})
    tied["head"].weight = emb.weight
    with pytest.raises(ValueError, match=r"'emb.weight' is shared .* Embedding reads it directly"):
        wrap_module_params_etp(tied, config, groups)
    # ... unless the sharing layer is excluded.
    kept = wrap_module_params_etp(tied, config, groups, filter_fn=lambda name, m: name != "head")
    assert kept.params_wrapped == 0


def test_wrap_behaviour():
    run_distributed(_wrap_checks, 2)


def _default_groups_match_explicit(ctx):
    # groups=None builds build_etp_groups(config): the same shards as passing them explicitly.
    config = ETPConfig(etp_size=2, expert_etp_size=2, pad_for_alignment=4)
    implicit, explicit = _model(), _model()
    summary = wrap_module_params_etp(implicit, config)  # groups=None
    wrap_module_params_etp(explicit, config, build_etp_groups(config))
    assert summary.params_wrapped == 4
    for (name, a), (_, b) in zip(implicit.named_parameters(), explicit.named_parameters()):
        assert type(a) is type(b) and torch.equal(a, b), name
        if isinstance(a, ETPShardedParam):
            assert a.etp_group.size == 2 and a.etp_group.rank == ctx.rank


def test_wrap_without_groups_builds_the_default_groups():
    run_distributed(_default_groups_match_explicit, 2)


def test_wrap_without_groups_at_size_one_needs_no_process_group():
    model = _model()
    before = [p for p in model.parameters()]
    summary = wrap_module_params_etp(model, ETPConfig())
    assert summary.params_wrapped == 0 and list(model.parameters()) == before


def test_wrap_rejects_groups_of_the_wrong_type():
    with pytest.raises(TypeError, match="ETPGroups"):
        wrap_module_params_etp(_model(), ETPConfig(etp_size=2), groups=object())


def _half_applied(ctx):
    """ETP on for dense weights only: the summary says the experts stayed replicated."""
    model = _model()
    summary = wrap_module_params_etp(model, ETPConfig(etp_size=ctx.world_size))
    return str(summary), summary.replicated_experts


def test_experts_left_replicated_are_named_in_the_summary():
    for text, experts in run_distributed(_half_applied, 2):
        assert experts == ["experts.fc1_weight", "experts.fc2_weight"]
        assert "2 expert weights stay replicated (expert_etp_size=1" in text


def _disagreeing(ctx, which):
    """Rank 1 builds its model from another seed (or changes one replicated bias)."""
    torch.manual_seed(0)
    model = _model()
    if ctx.rank == 1:
        with torch.no_grad():
            if which == "bias":
                model[2].bias[3] += 1.0
            else:
                model[0].weight.mul_(2.0)
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, debug_checks=True)
    try:
        wrap_module_params_etp(model, config)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("which,name", [("bias", "2.bias"), ("weight", "0.weight")])
def test_debug_checks_name_the_first_parameter_that_differs_across_ranks(which, name):
    for message in run_distributed(_disagreeing, 2, which):
        assert message is not None and f"parameter '{name}' differs between the ranks" in message


def test_a_megatron_linear_without_its_integration_is_an_error_not_left_replicated():
    """Without ``import etp.megatron`` a megatron-core TP linear would silently stay replicated:
    wrapping refuses it, naming what to import (a stand-in class from megatron's module)."""
    stand_in = type("ColumnParallelLinear", (nn.Linear,), {"__module__": "megatron.core.tensor_parallel.layers"})
    model = nn.Sequential(stand_in(4, 4))
    group = ShardGroup(None, None, (0, 1), 0)
    groups = ETPGroups(dense=group, expert=group, dense_replicate=None, expert_replicate=None)
    with pytest.raises(ValueError, match="import etp.megatron before wrapping"):
        wrap_module_params_etp(model, ETPConfig(etp_size=2), groups)
