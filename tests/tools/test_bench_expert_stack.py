"""tools/bench_expert_stack.py --cpu-smoke on 2 gloo ranks: every variant runs or is skipped for
a reason, the bf16 variants compute what ``replicated`` does, a variant's figure is the mean of
its rounds (not the best), and the JSON carries its provenance."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from expert_stack.variants import VARIANTS  # noqa: E402

VARIANT_SUBSET = "replicated,replicated_fp8,ddp,etp_sync,etp_default,etp_fp8_wgrad,etp_graphed"


def test_the_variants_are_one_table_of_at_most_twelve():
    assert 1 <= len(VARIANTS) <= 12
    assert {"replicated", "replicated_fp8", "ddp", "fsdp2"} <= set(VARIANTS)  # the peers
    assert all(v.kind in ("replicated", "ddp", "fsdp2", "etp") and v.what for v in VARIANTS.values())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("stack") / "stack.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the torch references: faster
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tools" / "bench_expert_stack.py"), "--cpu-smoke", "--rounds", "2",
           "--variants", VARIANT_SUBSET, "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_cpu_smoke_runs_every_variant_or_says_why_not(smoke):
    report, stdout = smoke
    statuses = {name: r["status"] for name, r in report["results"].items()}
    assert list(statuses) == VARIANT_SUBSET.split(",")
    assert statuses.pop("etp_graphed").startswith("skipped: CUDA graphs")
    assert set(statuses.values()) == {"ok"}
    assert "| etp_default |" in stdout


def test_bf16_variants_compute_what_replicated_computes(smoke):
    results = smoke[0]["results"]
    base = results["replicated"]["check"]
    for name in ("ddp", "etp_sync", "etp_default"):
        for key in ("output_sum", "grad_norm"):
            assert results[name]["check"][key] == pytest.approx(base[key], rel=1e-5), (name, key)
    fp8 = results["etp_fp8_wgrad"]["check_rel_diff_vs_replicated"]
    assert 0 < fp8["grad_norm"] < 0.05  # FP8 rounding, not a different computation


def test_step_time_is_the_mean_of_every_round_not_the_best(smoke):
    for r in smoke[0]["results"].values():
        if r["status"] != "ok":
            continue
        assert len(r["round_step_ms"]) == 2 and len(r["step_ms_all"]) == 2 * 2
        assert r["step_ms"] == pytest.approx(statistics.fmean(r["step_ms_all"]))
        assert r["step_ms"] == pytest.approx(statistics.fmean(r["round_step_ms"]))
        spread = (max(r["round_step_ms"]) - min(r["round_step_ms"])) / r["step_ms"]
        assert r["round_spread"] == pytest.approx(spread)


def test_the_json_says_where_it_came_from(smoke):
    prov = smoke[0]["provenance"]
    assert prov["command"].startswith("torchrun --standalone --nproc-per-node=2 ")
    assert "tools/bench_expert_stack.py --cpu-smoke" in prov["command"]
    assert prov["world_size"] == 2 and prov["gpu_count"] == 0
    assert {"commit", "dirty", "date", "torch", "python", "gpu_name"} <= set(prov)


def test_the_gather_section_times_etps_gather_beside_raw_nccl(smoke):
    section = smoke[0]["gather_bandwidth"]
    assert section["status"] == "ok"
    statuses = {key: entry["status"] for key, entry in section["entries"].items()}
    assert statuses == dict.fromkeys(("etp_fp8", "etp_bf16", "raw_uint8", "raw_bf16"), "ok")
    fp8, bf16 = section["entries"]["etp_fp8"], section["entries"]["etp_bf16"]
    assert fp8["shard_bytes"] * 4 == bf16["shard_bytes"]  # float32 weights in the smoke; one byte each in FP8
