"""tools/diag/trace_gaps.py on a hand-made chrome trace: overlapping kernels count once, the gap is
found with the host op open at its start, runtime calls are summed."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "diag"))

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


def test_compute_stream_waits_name_the_gather_a_gemm_waited_for():
    k = lambda name, tid, ts, dur, cat="kernel": {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts,  # noqa: E731
                                                  "dur": dur}
    events = [
        k("cutlass_gemm", 7, 0, 100), k("cutlass_gemm", 7, 150, 100),  # waits 50 us for the copy below
        k("Memcpy PtoP", 18, 90, 60, "gpu_memcpy"),
        k("sum_kernel", 7, 260, 20),  # 10 us gap: under min_gap_us
        k("cutlass_gemm", 7, 300, 100),  # 20 us gap with nothing beside
        k("elementwise", 22, 0, 5),  # a kernel elsewhere, not in any gap
    ]
    w = trace_gaps.compute_stream_waits(events, pattern="cutlass", min_gap_us=15, steps=2)
    assert w["compute_stream"] == 7
    assert w["busy_ms_per_step"] == (100 + 100 + 20 + 100) / 2 / 1e3
    assert w["idle_ms_per_step"] == (400 - 320) / 2 / 1e3
    assert w["waits"] == [
        {"next": "gemm", "beside": "18:copy", "gaps": 1, "ms_per_step": 50 / 2 / 1e3},
        {"next": "gemm", "beside": "nothing", "gaps": 1, "ms_per_step": 20 / 2 / 1e3},
    ]
    # the first gap ends exactly as the copy does; the 20 us gap ends with no copy ending
    assert w["ended_by"] == [{"copy": "Memcpy PtoP", "stream": 18, "gaps": 1, "ms_per_step": 50 / 2 / 1e3}]


def test_gaps_held_by_a_local_copy_are_counted_by_the_copy_that_ended_them():
    k = lambda name, tid, ts, dur, cat="kernel": {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts,  # noqa: E731
                                                  "dur": dur}
    events = [
        k("prepare_grouped_gemm", 7, 0, 2), k("cutlass_gemm", 7, 133, 500),  # held 131 us by the DtoD
        k("Memcpy DtoD (Device -> Device)", 18, 2, 131, "gpu_memcpy"),
        k("Memcpy PtoP (Device -> Device)", 18, 133, 500, "gpu_memcpy"),  # ends with no gap after it
        k("cutlass_gemm", 7, 700, 100),  # a 67 us gap that ends 67 us after the PtoP: not held by it
    ]
    w = trace_gaps.compute_stream_waits(events, pattern="cutlass", min_gap_us=15, steps=1)
    assert w["ended_by"] == [{"copy": "Memcpy DtoD (Device -> Device)", "stream": 18, "gaps": 1,
                              "ms_per_step": 131 / 1e3}]
