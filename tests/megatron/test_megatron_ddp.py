"""ETPDistributedDataParallel + etp.megatron.finalize_model_grads on 4 CPU ranks (gloo).

World 4 = data parallel 4; dense ETP 2 (x replicate 2), expert ETP 4 (replicate 1): the
dense and expert buffers reduce over different replicate groups. A model of a megatron-core
ColumnParallelLinear, RowParallelLinear, a replicated scale vector and etp grouped experts
(rows padded and straddling experts) runs one mean-loss step per rank on rank-specific data;
every ``main_grad`` after finalize must equal the float64 gradient of the unsharded model on
all ranks' data (independent autograd reference), with ``overlap_grad_reduce`` off and on,
either ETP reduction (DDP's scaling adapts), and megatron's per-token loss (sums divided by
the global token count in finalize) with different token counts per rank.
With overlap on, DDP's grad-ready must only be fired for an ETP weight once its
reduce-scattered gradient is in ``main_grad``.

megatron-core's DDP allocates its buffers on ``torch.cuda.current_device()``; on CPU the
test points that at "cpu" (DDP's collectives are plain torch.distributed calls), and
``torch.cuda.current_stream()`` at a stream with nothing to wait for.
"""
import contextlib
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from parity import assert_close

pytest.importorskip("megatron.core")

HIDDEN, FFN, EXPERTS, EFFN, SEQ, BATCH = 8, 12, 3, 5, 4, 2


def _reference(device):
    g = torch.Generator().manual_seed(11)
    return {
        "col": torch.randn(FFN, HIDDEN, generator=g, dtype=torch.float64) * 0.3,
        "row": torch.randn(HIDDEN, FFN, generator=g, dtype=torch.float64) * 0.3,
        "scale": 1 + 0.1 * torch.randn(HIDDEN, generator=g, dtype=torch.float64),
        "fc1": torch.randn(EXPERTS, 2 * EFFN, HIDDEN, generator=g, dtype=torch.float64) * 0.3,
        "fc2": torch.randn(EXPERTS, HIDDEN, EFFN, generator=g, dtype=torch.float64) * 0.3,
    }


def _data(rank, uneven=False):
    g = torch.Generator().manual_seed(200 + rank)
    batch = 1 + rank % BATCH if uneven else BATCH  # uneven: ranks hold different token counts
    x = torch.randn(SEQ, batch, HIDDEN, generator=g, dtype=torch.float64)
    counts = torch.tensor([3, 0, SEQ * batch - 3])  # an expert with no tokens
    return x, counts


def _loss(out, per_token):
    """Mean loss (megatron's default), or the per-token loss's *sum* (its per-token path)."""
    return out.square().mean(-1).sum() if per_token else out.square().mean()


def _forward(w, x, counts, experts, per_token=False):
    h = F.linear(F.gelu(F.linear(x, w["col"])), w["row"]) * w["scale"]
    flat = h.reshape(-1, HIDDEN)
    return _loss(flat + experts(flat, counts), per_token)


def _reference_experts(w):
    def run(flat, counts):
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            t = flat[start : start + n]
            gate, up = F.linear(t, w["fc1"][e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w["fc2"][e]))
            start += n
        return torch.cat(outs)

    return run


def _owned(ddp, param):
    """The [lo, hi) ranges of ``param.main_grad`` (flattened) that this rank's distributed-
    optimizer shard of each bucket covers: the only part megatron reduces there."""
    ranges = []
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        group_rank, group_size = buffer.data_parallel_group.rank(), buffer.data_parallel_group.size()
        for bucket in buffer.buckets:
            if param not in bucket.params:
                continue
            item = bucket.grad_data.element_size()
            offset = (param.main_grad.data_ptr() - bucket.grad_data.data_ptr()) // item
            shard = bucket.grad_data.numel() // group_size
            lo = max(group_rank * shard, offset) - offset
            hi = min((group_rank + 1) * shard, offset + param.main_grad.numel()) - offset
            if lo < hi:
                ranges.append((lo, hi))
    return ranges


class _HostStream:
    """What ``torch.cuda.current_stream()`` answers on CPU ranks: megatron-core 0.19's gradient
    reduce makes the current stream wait for CUDA-graph gradient events (none on CPU)."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


_HOST_STREAM = _HostStream()


def _ddp_step(ctx, overlap: bool, reduction: str, per_token: bool = False, distopt: bool = False):
    torch.cuda.current_device = lambda: "cpu"  # megatron-core DDP buffers on CPU, see the doc
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM  # 0.19's reduce waits on it
    from megatron.core import ModelParallelConfig
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from etp import ETPConfig, ETPShardedParam, GroupedSwiGLUExperts
    from etp.megatron.ddp import ETPDistributedDataParallel
    from etp.megatron.finalize import finalize_model_grads
    from etp.megatron.model import apply_etp

    ps.initialize_model_parallel()
    try:
        w = _reference(ctx.device)
        ref = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        losses = [_forward(ref, *_data(r, per_token), _reference_experts(ref), per_token)
                  for r in range(ctx.world_size)]
        names = ["col", "row", "fc1", "fc2"]
        per_rank = [torch.autograd.grad(loss, [ref[n] for n in names], retain_graph=True) for loss in losses]
        if per_token:  # the global per-token mean over all ranks' tokens
            tokens = sum(_data(r, True)[0].shape[0] * _data(r, True)[0].shape[1] for r in range(ctx.world_size))
            (torch.stack(losses).sum() / tokens).backward()
        else:
            torch.stack(losses).mean().backward()  # a mean loss: megatron's default convention

        mp = ModelParallelConfig(params_dtype=torch.float64, use_cpu_initialization=True)
        init = torch.nn.init.zeros_
        model = torch.nn.Module()
        model.col = ColumnParallelLinear(HIDDEN, FFN, config=mp, init_method=init, bias=False,
                                         gather_output=False)
        model.row = RowParallelLinear(FFN, HIDDEN, config=mp, init_method=init, bias=False,
                                      input_is_parallel=True, skip_bias_add=True)
        model.scale = torch.nn.Parameter(w["scale"].clone())
        model.experts = GroupedSwiGLUExperts(EXPERTS, HIDDEN, EFFN, dtype=torch.float64)
        with torch.no_grad():
            model.col.weight.copy_(w["col"]); model.row.weight.copy_(w["row"])  # noqa: E702
            model.experts.fc1_weight.copy_(w["fc1"]); model.experts.fc2_weight.copy_(w["fc2"])  # noqa: E702
        for p in model.experts.parameters():
            p.is_expert = True
        apply_etp(model, ETPConfig(etp_size=2, expert_etp_size=4, reduction=reduction))
        assert isinstance(model.experts.fc1_weight, ETPShardedParam)

        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1,
                                   calculate_per_token_loss=per_token,
                                   params_dtype=torch.float64, use_cpu_initialization=True)
        ddp = ETPDistributedDataParallel(config, DistributedDataParallelConfig(
            overlap_grad_reduce=overlap, bucket_size=40 if overlap else None,
            use_distributed_optimizer=distopt), model)
        at_ready = {}  # id(param) -> main_grad when DDP was told it is ready
        ready_calls = {}  # id(param) -> grad-ready calls in the last microbatch of an iteration
        if overlap:
            for param in model.parameters():
                if isinstance(param, ETPShardedParam):
                    bucket_group = ddp.param_to_bucket_group[param]
                    original = bucket_group.register_grad_ready

                    def spy(p, *a, _original=original, _group=bucket_group, **k):
                        if isinstance(p, ETPShardedParam) and _group.is_last_microbatch:
                            at_ready[id(p)] = p.main_grad.clone()
                            ready_calls[id(p)] = ready_calls.get(id(p), 0) + 1
                        return _original(p, *a, **k)

                    bucket_group.register_grad_ready = spy
        module = ddp.module
        x, counts = _data(ctx.rank, per_token)
        # Two iterations of two microbatches each (the first under no_sync), the same data
        # twice at half weight: DDP's first-batch bookkeeping and its later checks both see
        # ETP's grad-ready calls, and the gradient equals one full microbatch's.
        for _ in range(2):
            ready_calls.clear()
            ddp.zero_grad_buffer()
            for micro in range(2):
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    h = module.row(F.gelu(module.col(x)[0]))[0] * module.scale
                    flat = h.reshape(-1, HIDDEN)
                    (_loss(flat + module.experts(flat, counts), per_token) / 2).backward()
            # float64: megatron scales by 1.0 / num_tokens, in num_tokens' precision
            num_tokens = torch.tensor(float(x.shape[0] * x.shape[1]), dtype=torch.float64) if per_token else None
            finalize_model_grads([ddp], num_tokens=num_tokens)  # megatron sums it over DP
            if overlap:  # exactly once per ETP weight, in the last microbatch (DDP counts them)
                etp_ids = {id(p) for p in model.parameters() if isinstance(p, ETPShardedParam)}
                assert ready_calls == dict.fromkeys(etp_ids, 1), sorted(ready_calls.values())

        for index, (name, param, full) in enumerate([("col", module.col.weight, ref["col"]), ("row", module.row.weight, ref["row"]),
                                  ("fc1", module.experts.fc1_weight, ref["fc1"]),
                                  ("fc2", module.experts.fc2_weight, ref["fc2"])]):
            layout = param.etp_layout
            start, valid = param.row_range[0], layout.valid_rows
            expected = full.grad.reshape(-1, full.shape[-1])[start : start + valid]
            if distopt:  # only this rank's chunk of each bucket is reduced
                padded = torch.zeros_like(param.main_grad)
                padded[:valid] = expected
                for lo, hi in _owned(ddp, param):
                    assert_close(param.main_grad.flatten()[lo:hi], padded.flatten()[lo:hi], f"{name} chunk")
                continue
            assert_close(param.main_grad[:valid], expected, name)
            if overlap:  # when DDP heard "ready": the ETP-group sum of local grads, unscaled
                local = sum(per_rank[r][index] for r in param.etp_group.ranks)  # both halves
                local = local / (param.etp_group.size if reduction == "mean" else 1)
                local = local.reshape(-1, full.shape[-1])[start : start + valid]
                assert_close(at_ready[id(param)][:valid], local, f"{name} at grad-ready")
            assert torch.count_nonzero(param.main_grad[layout.valid_rows :]) == 0, f"{name} padding"
        if distopt:
            owned = _owned(ddp, module.scale)
            for lo, hi in owned:
                assert_close(module.scale.main_grad[lo:hi], ref["scale"].grad[lo:hi], "scale chunk")
            return sum(hi - lo for lo, hi in owned)
        assert_close(module.scale.main_grad, ref["scale"].grad, "scale (replicated)")
        return True
    finally:
        ps.destroy_model_parallel()


# ------------------------------------------------------------------------------------------
# The default 4-rank bodies of test_megatron_groups, test_megatron_linears and this module
# share one spawn (starting 4 ranks with megatron-core costs ~14 s here, more than any of
# these bodies): each sets up and destroys its own model-parallel state. A body that finishes
# leaves a file per rank; when a later one fails the spawn, the tests of the finished bodies
# still pass and the others report its traceback.

# (overlap, reduction, per_token, distributed optimizer) of this module's default tests:
# overlap_grad_reduce with the sum reduction, the synchronous path with a per-token loss over
# uneven token counts (mean reduction), and the distributed optimizer's chunks (synchronous).
DDP_CONFIGS = {"overlap_sum": (True, "sum", False), "sync_per_token": (False, "mean", True),
               "distopt_sync": (False, "mean", False, True)}
# In this order: DDP's bodies last (they point torch.cuda.current_device / current_stream at the CPU).
SHARED_BODIES = ("groups_layout", "linears_tp2", *DDP_CONFIGS)
_shared_outcome: dict = {}  # filled by the first test that asks, in whichever module


def _shared_bodies(ctx, root):
    from test_megatron_groups import SHARED_LAYOUT, _layout
    from test_megatron_linears import _mlp_parity

    results = {}
    for name in SHARED_BODIES:
        if name == "groups_layout":
            results[name] = _layout(ctx, *SHARED_LAYOUT)
        elif name == "linears_tp2":
            results[name] = _mlp_parity(ctx, 2, False)
        else:
            results[name] = _ddp_step(ctx, *DDP_CONFIGS[name])
        (Path(root) / f"{name}.done{ctx.rank}").write_bytes(pickle.dumps(results[name]))
    return results


def shared_body(tmp_path_factory, name: str) -> list:
    """The per-rank results of body ``name`` in the shared 4-rank spawn (run once per session,
    on first use)."""
    if not _shared_outcome:
        root = tmp_path_factory.mktemp("megatron_shared")
        try:
            results = run_distributed(_shared_bodies, 4, str(root), timeout=300)
            _shared_outcome.update({n: [r[n] for r in results] for n in SHARED_BODIES})
        except AssertionError as exc:
            for n in SHARED_BODIES:
                files = [root / f"{n}.done{rank}" for rank in range(4)]
                _shared_outcome[n] = ([pickle.loads(f.read_bytes()) for f in files] if all(f.exists() for f in files)
                                      else f"the shared 4-rank spawn failed before {n} finished:\n{exc}")
    outcome = _shared_outcome[name]
    if isinstance(outcome, str):
        pytest.fail(outcome, pytrace=False)
    return outcome


def test_etp_ddp_gradients_equal_unsharded_reference(tmp_path_factory):
    """overlap_grad_reduce with the sum reduction, and the synchronous path with a per-token
    loss over uneven token counts (mean reduction)."""
    assert shared_body(tmp_path_factory, "overlap_sum") == [True] * 4
    assert shared_body(tmp_path_factory, "sync_per_token") == [True] * 4


@pytest.mark.slow  # the synchronous path and the mean reduction also run in the per-token case
def test_etp_ddp_gradients_equal_unsharded_reference_sync_mean():
    assert run_distributed(_ddp_step, 4, False, "mean", False) == [True] * 4


# The overlapped hooks are covered by test_etp_ddp_gradients_equal_unsharded_reference; the
# chunk layout by the synchronous case here (in the shared spawn): the overlapped one is slow.
@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "overlap_grad_reduce"])
def test_etp_ddp_distributed_optimizer_chunks(tmp_path_factory, overlap):
    """Reduce-scatter buckets (distributed optimizer) over the replicate group: each rank's
    chunk is exact, including replicated params completed over the ETP group afterwards
    (ETP peers own the same chunk position)."""
    if overlap:
        owned = run_distributed(_ddp_step, 4, overlap, "mean", False, True)
    else:
        owned = shared_body(tmp_path_factory, "distopt_sync")
    # The replicated vector's chunks: split between the 2 replicas, the same on ETP peers.
    assert sum(owned) == 2 * HIDDEN and owned[0] == owned[1] and owned[2] == owned[3]
