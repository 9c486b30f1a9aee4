"""megatron-core ColumnParallelLinear / RowParallelLinear under ETP: TP=1 at ETP sizes 1, 2, 4
and TP=2 x ETP=2 (with and without sequence parallelism), against an unsharded float64 MLP.

The ETP group is megatron's data-parallel group (orthogonal to TP): TP peers see the same
tokens, ETP peers different ones. See tests/parity.py for the tolerance.
"""
import functools
import os

import pytest
import torch
import torch.nn.functional as F
from harness import backend, run_distributed
from parity import assert_close

pytest.importorskip("megatron.core")

SIZES = [int(s) for s in os.environ.get("ETP_TEST_SIZES", "1,2,4").split(",")]
HIDDEN, FFN, SEQ, BATCH = 12, 20, 8, 3


def _mlp_parity(ctx, tp: int, sequence_parallel: bool, etp_alone: bool = False):
    """``etp_alone``: ETP 1 inside the data-parallel group (every rank its own ETP group, on
    the data of the first), as on a single rank."""
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    import etp.megatron  # noqa: F401  (registers megatron-core's TP linears with the wrapping helper)
    from etp import ETPConfig, ETPGroups, ETPShardedParam, finalize_grads, wrap_module_params_etp

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dp_group = parallel_state.get_data_parallel_group()
        if etp_alone:
            dp_group = [torch.distributed.new_group([r]) for r in range(ctx.world_size)][ctx.rank]
        etp_size = torch.distributed.get_world_size(dp_group)
        dp_rank = torch.distributed.get_rank(dp_group)
        config = ModelParallelConfig(
            tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
            params_dtype=torch.float64, use_cpu_initialization=True,
        )
        init = functools.partial(torch.nn.init.normal_, std=0.3)
        col = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=init, bias=True,
                                   gather_output=False)
        row = RowParallelLinear(FFN, HIDDEN, config=config, init_method=init, bias=True,
                                input_is_parallel=True, skip_bias_add=False)

        # The reference: full weights, identical on every rank; TP slices copied into megatron.
        gen = torch.Generator().manual_seed(5)
        w1 = torch.randn(FFN, HIDDEN, generator=gen, dtype=torch.float64)
        b1 = torch.randn(FFN, generator=gen, dtype=torch.float64)
        w2 = torch.randn(HIDDEN, FFN, generator=gen, dtype=torch.float64)
        b2 = torch.randn(HIDDEN, generator=gen, dtype=torch.float64)
        w1, b1, w2, b2 = (t.to(ctx.device) for t in (w1, b1, w2, b2))
        col.to(ctx.device), row.to(ctx.device)
        cut = slice(tp_rank * FFN // tp, (tp_rank + 1) * FFN // tp)
        with torch.no_grad():
            col.weight.copy_(w1[cut])
            col.bias.copy_(b1[cut])
            row.weight.copy_(w2[:, cut])
            row.bias.copy_(b2)
        reference = [t.clone().requires_grad_(True) for t in (w1, b1, w2, b2)]

        cfg = ETPConfig(etp_size=etp_size, expert_etp_size=etp_size)
        groups = ETPGroups.from_process_groups(dense=dp_group)
        module = torch.nn.ModuleDict({"col": col, "row": row})
        summary = wrap_module_params_etp(module, cfg, groups)
        if etp_size > 1:
            assert summary.wrapped == ["col.weight", "row.weight"], summary.wrapped
            assert isinstance(col.weight, ETPShardedParam) and col.weight.tensor_model_parallel
            assert col.weight.partition_dim == 0 and row.weight.partition_dim == 1

        def data(d):
            g = torch.Generator().manual_seed(100 + d)
            return (torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64).to(ctx.device),
                    torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64).to(ctx.device))

        def reference_forward(x):
            return F.linear(F.gelu(F.linear(x, reference[0], reference[1])), reference[2], reference[3])

        ref_losses = [(reference_forward(x) * proj).sum() for x, proj in map(data, range(etp_size))]
        torch.stack(ref_losses).mean().backward()

        x, proj = data(dp_rank)
        y_full_ref = reference_forward(x).detach()
        if sequence_parallel:
            chunk = slice(tp_rank * SEQ // tp, (tp_rank + 1) * SEQ // tp)
            x, proj, y_full_ref = x[chunk], proj[chunk], y_full_ref[chunk]
        x = x.clone().requires_grad_(True)
        h, _ = col(x)
        y, _ = row(F.gelu(h))
        (y * proj).sum().backward()
        finalize_grads(module, cfg, groups)

        assert_close(y, y_full_ref, "output")
        for param, ref, sl in ((col.weight, reference[0], cut), (row.weight, reference[2], (slice(None), cut))):
            want = ref.grad[sl]
            got = param.grad
            if isinstance(param, ETPShardedParam):
                want = param.etp_layout.shard_of(want.contiguous())
            assert_close(got, want, "weight grad")
        assert_close(col.bias.grad, reference[1].grad[cut], "column bias grad")
        if not sequence_parallel:
            # With SP the row bias grad is partial per TP rank until megatron's own
            # finalize_model_grads all-reduces sequence-parallel params over TP.
            assert_close(row.bias.grad, reference[3].grad, "row bias grad")
        return summary.params_wrapped
    finally:
        parallel_state.destroy_model_parallel()


def _tp1_etp2_and_etp1(ctx):
    return _mlp_parity(ctx, 1, False), _mlp_parity(ctx, 1, False, etp_alone=True)


@pytest.fixture(scope="module")
def two_ranks():
    """ETP 2 and (each rank alone) ETP 1 at TP 1 in one 2-rank spawn: {size: per-rank results}."""
    results = run_distributed(_tp1_etp2_and_etp1, 2)
    return {2: [r[0] for r in results], 1: [r[1] for r in results]}


# 4 ranks repeat the 2-rank property (each rank a shard, megatron's linears intact): slow.
@pytest.mark.parametrize("size", [pytest.param(s, marks=(pytest.mark.slow,) if s == 4 else ()) for s in SIZES])
def test_megatron_linears_tp1(request, size):
    if size in (1, 2) and 2 in SIZES:  # ETP 1 runs in the 2-rank spawn, one rank per ETP group
        wrapped = request.getfixturevalue("two_ranks")[size]
    else:
        wrapped = run_distributed(_mlp_parity, size, 1, False)
    assert wrapped == [0 if size == 1 else 2] * len(wrapped)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_megatron_linears_tp2_etp2(tmp_path_factory, sequence_parallel):
    if sequence_parallel and backend() != "nccl":
        pytest.skip("megatron's sequence-parallel gather allocates on CUDA: GPU run only "
                    "(ETP_TEST_BACKEND=nccl)")
    if sequence_parallel:
        results = run_distributed(_mlp_parity, 4, 2, sequence_parallel)
    else:  # in test_megatron_ddp's shared 4-rank spawn (one start-up less)
        from test_megatron_ddp import shared_body

        results = shared_body(tmp_path_factory, "linears_tp2")
    assert results == [2] * 4
