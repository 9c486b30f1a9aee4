"""tools/diag/trace_kernels_compare.py on hand-made traces: kernels paired in start order, split by
whether a copy covers them, short and non-matching kernels ignored, mismatched traces refused."""
import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "diag"))

import trace_kernels_compare  # noqa: E402


def _write(path, events, zipped=False):
    text = json.dumps({"traceEvents": events})
    if zipped:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_pairs_split_by_copy_overlap(tmp_path):
    a = _write(tmp_path / "a.json", [_kernel("cutlass_gemm", 0, 100), _kernel("cutlass_gemm", 200, 100),
                                     _kernel("cutlass_prepare", 150, 2), _kernel("elementwise", 400, 100)])
    b = _write(tmp_path / "b.json.gz", [
        _kernel("cutlass_gemm", 0, 110),  # a copy covers 80% of it
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 10, "dur": 88},
        _kernel("cutlass_gemm", 300, 120),  # nothing beside it
        _kernel("cutlass_prepare", 150, 3), _kernel("elementwise", 500, 200)], zipped=True)
    r = trace_kernels_compare.compare(a, b, pattern="cutlass", min_us=50, overlap=0.3, steps=2)
    assert r["kernels"] == 2
    assert r["ms_per_step_a"] == pytest.approx(0.1) and r["ms_per_step_b"] == pytest.approx(0.115)
    assert r["with_copy_beside"] == {"kernels": 1, "median_ratio": pytest.approx(1.1)}
    assert r["without_copy_beside"] == {"kernels": 1, "median_ratio": pytest.approx(1.2)}


def test_refuses_traces_of_different_programs(tmp_path):
    a = _write(tmp_path / "a.json", [_kernel("gemm", 0, 100)])
    b = _write(tmp_path / "b.json", [_kernel("gemm", 0, 100), _kernel("gemm", 200, 100)])
    with pytest.raises(ValueError, match="1 matching kernels.*but 2"):
        trace_kernels_compare.compare(a, b)
