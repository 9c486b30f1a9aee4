"""``tools/bench_ep.py`` end to end on 2 gloo ranks (``--cpu-smoke``): every backend row has
its four moves, the bytes each says it moves against counts taken from the routing, and the
JSON records its provenance. (The figures are the GPU run's; this checks the script.)"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from harness import run_distributed

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _smoke(ctx, out):
    sys.path.insert(0, str(TOOLS))
    import bench_ep

    backends = "reference,nccl,nccl@chunks=3,nccl_padded,hierarchical@ranks_per_host=1"
    bench_ep.main(["--cpu-smoke", "--backends", backends, "--out", out])
    spec = bench_ep.WORKLOADS["smoke"]
    return spec


def test_bench_ep_cpu_smoke(tmp_path):
    out = tmp_path / "ep.json"
    spec = run_distributed(_smoke, 2, str(out))[0]
    results = json.loads(out.read_text())
    assert results["provenance"]["command"] and results["world_size"] == 2
    [info] = results["workloads"]
    rows = {row["backend"]: row for row in results["rows"]}
    assert set(rows) == {"reference", "nccl", "nccl@chunks=3", "nccl_padded", "hierarchical@ranks_per_host=1"}, rows
    for name, row in rows.items():
        assert "error" not in row, row
        for move in ("dispatch", "combine", "dispatch_bwd", "combine_bwd"):
            assert row[f"{move}_ms"] > 0 and row[f"{move}_a2a_ms"] > 0 and row[f"{move}_MB"] >= 0, (name, move)
    # Every pair's row to the other rank, as the routing has it: the non-deduplicating backends.
    for name in ("reference", "nccl", "nccl@chunks=3"):
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
