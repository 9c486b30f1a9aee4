"""``tools/bench_ep.py`` end to end on 2 gloo ranks (``--cpu-smoke``): every backend row has
its four moves, the bytes each says it moves against counts taken from the routing, each
callable it times computes the move it is named after, and the JSON records its provenance.
(The figures are the GPU run's; this checks the script.)"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from harness import run_distributed

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _smoke(ctx, out):
    sys.path.insert(0, str(TOOLS))
    import bench_ep

    backends = "reference,nccl,nccl@kernels=torch,nccl_padded,hierarchical@ranks_per_host=1"
    bench_ep.main(["--cpu-smoke", "--backends", backends, "--out", out])
    spec = bench_ep.WORKLOADS["smoke"]
    return spec, _moves_timed(bench_ep, spec)


def _moves_timed(bench_ep, spec):
    """What each callable the benchmark times returns, against what its move must compute
    (identity experts): dispatch then combine gives K x each token; dispatch's backward of the
    dispatched rows gives K x each token and its routing weights; combine's backward of g gives
    rows that combine to K x g."""
    from etp import ep

    gen = torch.Generator().manual_seed(dist.get_rank())
    T, H, K, E = spec["tokens"], spec["hidden"], spec["topk"], spec["experts"]
    cfg = ep.EPConfig(num_experts=E, topk=K, hidden_size=H, max_tokens_per_rank=T, dtype=torch.float64,
                      weight_dtype=torch.float64, backend="reference", capacity_factor=None)
    disp = ep.ExpertDispatcher(cfg)
    weights, idx = torch.rand(T, E, generator=gen, dtype=torch.float64).topk(K, dim=1)
    x, grad = (torch.randn(T, H, generator=gen, dtype=torch.float64) for _ in range(2))
    wrong = []
    with torch.no_grad():
        handle = disp.prepare(idx)
        fns = bench_ep._move_fns(disp, x, weights, grad, handle)
        if not torch.allclose(disp.combine(fns["dispatch"]()[0], handle), K * x):
            wrong.append("dispatch")
        if not torch.allclose(fns["combine"](), K * x):
            wrong.append("combine")
        grad_x, grad_w = fns["dispatch_bwd"]()
        if not (torch.allclose(grad_x, K * x) and torch.equal(grad_w, weights)):
            wrong.append("dispatch_bwd")
        if not torch.allclose(disp.combine(fns["combine_bwd"]().clone(), handle), K * grad):
            wrong.append("combine_bwd")
    disp.check()
    return wrong


def test_bench_ep_cpu_smoke(tmp_path):
    out = tmp_path / "ep.json"
    (spec, wrong), *others = run_distributed(_smoke, 2, str(out))
    assert not wrong and not any(w for _, w in others), (wrong, others)
    results = json.loads(out.read_text())
    assert results["provenance"]["command"] and results["world_size"] == 2
    [info] = results["workloads"]
    rows = {row["backend"]: row for row in results["rows"]}
    assert set(rows) == {"reference", "nccl", "nccl@kernels=torch", "nccl_padded", "hierarchical@ranks_per_host=1"}, rows
    for name, row in rows.items():
        assert "error" not in row, row
        for move in ("dispatch", "combine", "dispatch_bwd", "combine_bwd"):
            assert row[f"{move}_ms"] > 0 and row[f"{move}_a2a_ms"] > 0 and row[f"{move}_MB"] >= 0, (name, move)
    # Every pair's row to the other rank, as the routing has it: the non-deduplicating backends.
    for name in ("reference", "nccl", "nccl@kernels=torch"):
        assert math.isclose(rows[name]["dispatch_MB"], info["every_pair_MB"]), name
        assert math.isclose(rows[name]["dedup"], 1.0)
    # nccl_padded moves its whole per-peer capacity: ceil(1.25 x T x K / W) rows of H fp32.
    capacity = math.ceil(1.25 * spec["tokens"] * spec["topk"] / 2)
    assert math.isclose(rows["nccl_padded"]["dispatch_MB"], capacity * spec["hidden"] * 4 / 1e6)
    # hierarchical over 2 hosts x 1: a row per token with an expert on the other host, fewer.
    assert rows["hierarchical@ranks_per_host=1"]["dedup"] > 1.0
    # The targets report over that JSON and two etp-train results.
    sys.path.insert(0, str(TOOLS))
    import bench_ep

    for name, ms in (("ep4_etp", 200.0), ("ep4_alltoall", 300.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"ms_per_iter": ms}))
    lines = bench_ep.targets([f"cpu2={out}", f"ep4_etp={tmp_path / 'ep4_etp.json'}",
                              f"ep4_alltoall={tmp_path / 'ep4_alltoall.json'}"])
    assert "- ep4_alltoall / ep4_etp = 1.500 (target >= 1.3: yes)" in lines
    nccl = [line for line in lines if line.startswith("| smoke | nccl | dispatch |")]
    assert len(nccl) == 1 and "x a2a >= 0.85" in nccl[0]
    hier = [line for line in lines if line.startswith("| smoke | hierarchical@ranks_per_host=1 | combine |")]
    assert len(hier) == 1 and "<= nccl" in hier[0]


def test_targets_compare_steady_iterations_only(tmp_path):
    """A run whose first iterations compile (and profile) is compared over its second half."""
    sys.path.insert(0, str(TOOLS))
    import bench_ep

    def run(warm, steady):
        log = [{"iteration": i, "ms_per_iter": warm if i <= 5 else steady} for i in range(1, 16)]
        return {"ms_per_iter": sum(r["ms_per_iter"] for r in log[1:]) / 14, "log": log}

    (tmp_path / "etp.json").write_text(json.dumps(run(700.0, 200.0)))
    (tmp_path / "a2a.json").write_text(json.dumps(run(300.0, 260.0)))
    lines = bench_ep.targets([f"ep4_etp={tmp_path / 'etp.json'}", f"ep4_alltoall={tmp_path / 'a2a.json'}"])
    assert "- recipe ep4_etp: 200.0 ms/iter (median of iterations 8-15, 8 windows)" in lines
    assert "- ep4_alltoall / ep4_etp = 1.300 (target >= 1.3: yes)" in lines
    # Windows of 5 (--log-interval 5): only the last, which starts past the middle, counts.
    five = {"ms_per_iter": 400.0, "log": [{"iteration": i, "ms_per_iter": ms} for i, ms in ((5, 700.0), (10, 500.0),
                                                                                           (15, 250.0))]}
    assert bench_ep.steady_ms(five) == (250.0, "median of iterations 11-15, 1 windows")
