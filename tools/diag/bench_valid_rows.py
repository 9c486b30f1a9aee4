"""The experts' row-local kernels over a padded receive buffer, bounded to its valid rows or not.

Captured expert parallelism hands the experts a ``[capacity, h]`` buffer of which only the
first ``valid`` rows hold tokens ([Note: valid rows] in ``etp.kernels.blockwise``). Each
kernel between the grouped GEMMs is timed three ways on one GPU: over the capacity with no
bound (what ran before the bound existed), over the capacity with ``valid_rows`` (what runs
now), and over a buffer of exactly ``valid`` rows (the floor). Defaults: the flagship recipe's
layer at EP 4 and micro-batch 4 (8192 tokens per rank, top-4 of 64 experts: capacity
4 x 8192 x 4 rows, a quarter of them valid on average), h 2048, ffn 1408.

    python3 tools/diag/bench_valid_rows.py --out valid_rows.json

Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: bench_provenance

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacity", type=int, default=4 * 8192 * 4)
    p.add_argument("--valid", type=int, default=8192 * 4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=str, default=None)
    return p.parse_args(argv)


def device_ms(fn, iters: int) -> float:
    """Median device time of one call (CUDA events around each)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernels(rows: int, args, bound):
    """name -> a call of each row-local kernel on ``rows`` rows (``bound``: their valid_rows)."""
    from etp.kernels import quantize_rowwise, swiglu, swiglu_backward

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    x = torch.randn(rows, args.hidden, device=dev, dtype=bf16)
    gate_up = torch.randn(rows, 2 * args.ffn, device=dev, dtype=bf16)
    grad_h = torch.randn(rows, args.ffn, device=dev, dtype=bf16)
    probs = torch.rand(rows, device=dev)
    amax = torch.empty(rows, device=dev)
    return {
        "quantize_rowwise (fc1 input, fc2 output grad)":
            lambda: quantize_rowwise(x, amax_out=amax, inverse=True, valid_rows=bound),
        "swiglu forward + FP8": lambda: swiglu(gate_up, probs, quantize=True, amax_out=amax, valid_rows=bound),
        "swiglu output (rebuilt in backward)": lambda: swiglu(gate_up, probs, valid_rows=bound),
        "swiglu backward + FP8": lambda: swiglu_backward(gate_up, grad_h, probs, probs_grad=True, quantize=True,
                                                        amax_out=amax, valid_rows=bound),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_valid_rows needs CUDA")
    if not 0 < args.valid <= args.capacity:
        raise SystemExit(f"--valid {args.valid}: expected 1..--capacity ({args.capacity})")
    bound = torch.tensor([args.valid], dtype=torch.int32, device="cuda")
    arms = {"capacity, unbounded": kernels(args.capacity, args, None),
            "capacity, valid_rows": kernels(args.capacity, args, bound),
            "valid rows only": kernels(args.valid, args, None)}
    rows = []
    for name in arms["valid rows only"]:
        row = {"kernel": name, **{arm: device_ms(fns[name], args.iters) for arm, fns in arms.items()}}
        rows.append(row)
        print(f"{name:48s} " + "  ".join(f"{arm}: {row[arm]:.3f} ms" for arm in arms), flush=True)
    totals = {arm: sum(r[arm] for r in rows) for arm in arms}
    # A layer's forward and backward run the rowwise quantization twice (fc1's input, fc2's
    # output gradient) and each SwiGLU kernel once.
    per_layer = {arm: totals[arm] + next(r[arm] for r in rows if r["kernel"].startswith("quantize")) for arm in arms}
    print("per layer (fwd + bwd): " + "  ".join(f"{arm}: {ms:.3f} ms" for arm, ms in per_layer.items()))
    report = {"shape": vars(args) | {"out": None}, "kernels": rows, "per_layer_ms": per_layer,
              "device": torch.cuda.get_device_name(), "provenance": provenance(argv)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
