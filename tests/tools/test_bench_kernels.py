"""tools/bench_kernels.py --dry-run on CPU: every kernel measured beside its reference, each with
its device time and its host wall time per call, results exact, provenance in the JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_reports_device_and_host_time_and_exact_results(tmp_path):
    out = tmp_path / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the torch references: fast
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_kernels.py"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["correctness"]["all_exact"], report["correctness"]
    assert set(report["targets"]) == {"amax", "cast"}
    fused = report["amax"]["fused"]
    assert fused["device_ms"] > 0 and fused["host_wall_ms_per_call"] > 0 and "min_ms" not in fused
    assert "| device ms (mean) | host wall ms / call |" in done.stdout
    assert report["provenance"]["command"].endswith("tools/bench_kernels.py --dry-run --out " + str(out))
