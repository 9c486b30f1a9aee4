"""GPU (NCCL, 2 GPUs): every etp.ep backend against ``reference``, CUDA-graph replay of a
whole forward + backward step (symm_*, nccl_padded), no allocation by the moves, and
``hierarchical`` over hosts declared on one machine (2 GPUs as 2 x 1, 4 as 2 x 2).

Run with ``ETP_TEST_BACKEND=nccl`` on a machine with 2 GPUs (4 for the 2 x 2 test;
``tools/gpu_ep_check.sh``); skipped otherwise.

Tolerances: dispatch is a copy and is compared bit for bit; so is combine for
``reference``, ``nccl``, ``nccl_padded`` and ``symm_push`` (all sum a token's K rows in fp32
in k order).
``symm_dedup`` / ``symm_allgather`` combine sums per rank first and sends bf16 partial
sums: compared within 2 bf16 ulps of the row magnitude (rtol 1.6e-2, atol 1.6e-2 * max).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from harness import backend, run_distributed

from etp import ep

pytestmark = pytest.mark.skipif(backend() != "nccl" or torch.cuda.device_count() < 2,
                                reason="needs ETP_TEST_BACKEND=nccl and 2 GPUs")
EXACT_COMBINE = ("reference", "nccl", "nccl_padded", "symm_push")


def _cfg(**kw):
    base = dict(num_experts=16, topk=4, hidden_size=384, max_tokens_per_rank=600, dtype=torch.bfloat16,
                weight_dtype=torch.float32, num_ctas=8)
    base.update(kw)
    return ep.EPConfig(**base)


def _routing(ctx, case, cfg, tokens, seed=0):
    gen = torch.Generator(device=ctx.device).manual_seed(seed + ctx.rank)
    scores = torch.rand(tokens, cfg.num_experts, generator=gen, device=ctx.device)
    if case == "skewed":
        scores[:, 0] = 2.0
    elif case == "one_rank":
        scores[:, cfg.num_experts // ctx.world_size:] = -1.0
    weights, idx = scores.topk(cfg.topk, dim=1)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen, device=ctx.device).to(cfg.dtype)
    return idx, weights.softmax(1), x


def _step(disp, idx, w, x, scale, grad_out, trim=False):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    handle = disp.prepare(idx)
    recv_x, recv_w, tokens_per_expert = disp.dispatch(x, w, handle, trim=trim)
    if trim:  # the valid rows only: pad the copies back for the comparison with reference
        tokens_per_expert = tokens_per_expert.to(x.device)
    expert_out = (recv_x.float() * scale * recv_w[:, None]).to(recv_x.dtype)  # a per-row "expert"
    out = disp.combine(expert_out, handle)
    grad_x, grad_w = torch.autograd.grad(out, (x, w), grad_out)
    disp.check()
    if trim:
        recv_x = torch.cat([recv_x, recv_x.new_zeros(disp.capacity - recv_x.shape[0], recv_x.shape[1])])
        recv_w = torch.cat([recv_w, recv_w.new_zeros(disp.capacity - recv_w.shape[0])])
    return dict(recv_x=recv_x.detach().clone(), recv_w=recv_w.detach().clone(),
                tokens_per_expert=tokens_per_expert.clone(), out=out.detach().clone(), grad_x=grad_x.clone(),
                grad_w=grad_w.clone())


def _compare(got, want, name, dedup_combine):
    errors = []
    for key in ("tokens_per_expert", "recv_x", "recv_w"):
        if not torch.equal(got[key], want[key]):
            errors.append(f"{name}: {key} differs from reference")
    for key in ("out", "grad_x", "grad_w"):
        a, b = got[key].float(), want[key].float()
        if a.shape != b.shape:
            errors.append(f"{name}: {key} shape {tuple(a.shape)}, reference {tuple(b.shape)}")
        elif not b.numel():  # a rank with zero tokens: nothing to compare (max() of nothing raises)
            continue
        elif not dedup_combine and not torch.equal(a, b):
            errors.append(f"{name}: {key} not bit-identical (max err {(a - b).abs().max():.3g})")
        elif dedup_combine and not torch.allclose(a, b, rtol=1.6e-2, atol=1.6e-2 * b.abs().max().item()):
            errors.append(f"{name}: {key} max err {(a - b).abs().max():.3g}")
    return errors


def _backends_vs_reference(ctx):
    names = ep.available_backends(None)
    pairs = [(n, n) for n in names] + [("symm_dedup", "symm_push"), ("symm_push", "symm_dedup"), ("nccl", "symm_push"),
                                       ("nccl_padded", "symm_dedup")]
    errors = []
    for case, tokens in (("uniform", 600 - 37 * ctx.rank), ("skewed", 512), ("one_rank", 600 * ctx.rank // (ctx.world_size - 1))):
        cfg = _cfg()
        idx, w, x = _routing(ctx, case, cfg, tokens)
        scale = torch.linspace(0.5, 1.5, cfg.hidden_size, device=ctx.device)
        grad_out = torch.randn(tokens, cfg.hidden_size, device=ctx.device).to(cfg.dtype)
        want = _step(ep.ExpertDispatcher(replace(cfg, backend="reference")), idx, w, x, scale, grad_out)
        for d, c in pairs:
            disp = ep.ExpertDispatcher(replace(cfg, backend=f"{d}+{c}"))
            for _ in range(2):
                got = _step(disp, idx, w, x, scale, grad_out)
            # combine's backward is a dispatch (d), dispatch's backward a combine (c).
            errors += _compare(got, want, f"{case} {d}+{c}", c not in EXACT_COMBINE)
            if d == c:  # trimmed: the experts see and return the valid rows only
                got = _step(disp, idx, w, x, scale, grad_out, trim=True)
                errors += _compare(got, want, f"{case} {d}+{c} trim", c not in EXACT_COMBINE)
        del disp
    return errors, names


@pytest.mark.parametrize("world", [2, 4])
def test_every_backend_matches_reference(world):
    for errors, names in run_distributed(_backends_vs_reference, world):
        assert {"symm_push", "symm_dedup", "symm_allgather", "nccl", "nccl_padded"} <= set(names), names
        assert not errors, errors


def _hierarchical_vs_reference(ctx):
    """Hosts declared on one machine: 2 GPUs as 2 hosts x 1, 4 as 2 x 2 (symmetric memory
    within a host, NCCL between)."""
    errors = []
    for case, tokens in (("uniform", 600 - 37 * ctx.rank), ("skewed", 512), ("one_rank", 600 * ctx.rank // (ctx.world_size - 1))):
        cfg = _cfg(ranks_per_host=ctx.world_size // 2)
        idx, w, x = _routing(ctx, case, cfg, tokens)
        scale = torch.linspace(0.5, 1.5, cfg.hidden_size, device=ctx.device)
        grad_out = torch.randn(tokens, cfg.hidden_size, device=ctx.device).to(cfg.dtype)
        want = _step(ep.ExpertDispatcher(replace(cfg, backend="reference")), idx, w, x, scale, grad_out)
        disp = ep.ExpertDispatcher(replace(cfg, backend="hierarchical"))
        if type(disp.dispatch_backend._intra).__name__ != "SymmIntra":
            errors.append("hierarchical does not use symmetric memory within a host")
        for _ in range(2):
            got = _step(disp, idx, w, x, scale, grad_out)
        errors += _compare(got, want, f"{case} hierarchical", True)
        errors += _compare(_step(disp, idx, w, x, scale, grad_out, trim=True), want, f"{case} hierarchical trim", True)
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_hierarchical_over_declared_hosts_matches_reference(world):
    for errors in run_distributed(_hierarchical_vs_reference, world):
        assert not errors, errors


def _graph_replay(ctx, name):
    cfg = _cfg(backend=name, max_tokens_per_rank=512)
    eager_disp, graph_disp = ep.ExpertDispatcher(cfg), ep.ExpertDispatcher(cfg)
    scale = torch.linspace(0.5, 1.5, cfg.hidden_size, device=ctx.device)
    static = [t.clone() for t in _routing(ctx, "uniform", cfg, 512, seed=0)]
    grad_out = torch.randn(512, cfg.hidden_size, device=ctx.device).to(cfg.dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _step(graph_disp, *static, scale, grad_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    x = static[2].clone().requires_grad_(True)
    w = static[1].clone().requires_grad_(True)
    with torch.cuda.graph(graph):
        handle = graph_disp.prepare(static[0])
        recv_x, recv_w, _ = graph_disp.dispatch(x, w, handle)
        out = graph_disp.combine((recv_x.float() * scale * recv_w[:, None]).to(recv_x.dtype), handle)
        grad_x, grad_w = torch.autograd.grad(out, (x, w), grad_out)
    errors = []
    for seed in (1, 2, 3):
        idx, wv, xv = _routing(ctx, "skewed" if seed == 2 else "uniform", cfg, 512, seed=seed)
        static[0].copy_(idx)
        x.data.copy_(xv)
        w.data.copy_(wv)
        graph.replay()
        want = _step(eager_disp, idx, wv, xv, scale, grad_out)
        for key, got in (("out", out), ("grad_x", grad_x), ("grad_w", grad_w), ("recv_x", recv_x)):
            if not torch.equal(got, want[key]):
                errors.append(f"{name} seed {seed}: replayed {key} differs from eager")
    graph_disp.check()
    return errors


@pytest.mark.parametrize("name", ["symm_push", "symm_dedup", "symm_allgather", "nccl_padded"])
def test_cuda_graph_replay_equals_eager(name):
    for errors in run_distributed(_graph_replay, 2, name):
        assert not errors, errors


def _allocations(ctx, name):
    cfg = _cfg(backend=name)
    disp = ep.ExpertDispatcher(cfg)
    idx, w, x = _routing(ctx, "uniform", cfg, 600)
    handle = disp.prepare(idx)
    counts = []
    with torch.no_grad():
        for step in range(4):
            torch.cuda.synchronize()
            before = torch.cuda.memory_stats()["allocation.all.allocated"]
            recv_x, recv_w, _ = disp.dispatch(x, w, handle)
            disp.combine(recv_x, handle)
            disp.combine_backward(x, handle)
            disp.dispatch_backward(recv_x, recv_w, handle)
            torch.cuda.synchronize()
            if step:
                counts.append(torch.cuda.memory_stats()["allocation.all.allocated"] - before)
        reserved = torch.cuda.memory_reserved()
        for _ in range(3):
            handle = disp.prepare(idx)  # the layout allocates its tensors per call: temporaries
        torch.cuda.synchronize()
    return counts, torch.cuda.memory_reserved() - reserved


@pytest.mark.parametrize("name", ["symm_push", "symm_dedup", "symm_allgather", "nccl", "nccl_padded"])
def test_moves_allocate_nothing(name):
    for counts, reserved_growth in run_distributed(_allocations, 2, name):
        assert counts == [0, 0, 0], counts
        assert reserved_growth == 0  # prepare's temporaries come from the cache
