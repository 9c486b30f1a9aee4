"""tools/trace_gaps.py on a hand-made chrome trace: overlapping kernels count once, the gap is
found with the host op open at its start, runtime calls are summed."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import trace_gaps  # noqa: E402


def test_gaps_busy_time_and_host_ops(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 5, "dur": 10},  # overlaps a: busy 15, not 20
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy", "ts": 100, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::slow", "ts": 10, "dur": 90},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 12, "dur": 80},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 95, "dur": 4},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = trace_gaps.analyse(str(path), min_gap_us=20, top=5)
    assert r["device_busy_us"] == 25 and r["device_window_us"] == 110 and r["idle_us"] == 85
    assert [(g["gap_us"], g["host"]) for g in r["gaps"]] == [(85, ["aten::slow"])]
    assert r["runtime_calls"] == [{"name": "cudaStreamSynchronize", "total_us": 84.0, "count": 2}]
