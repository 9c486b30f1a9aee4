#!/usr/bin/env python
"""etp-train's language-model loss against megatron-core's on one GPU (BENCHMARKS.md, "The
language-model loss"): forward + backward time and the memory each keeps and peaks at, for the
logits of a micro-batch.

Both take the same bf16 logits ``[s, b, V]`` from a leaf tensor (as the output layer hands
them over) and are differentiated with a per-token gradient of ones:

* megatron: ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (tensor-parallel
  size 1), as megatron-core's ``GPTModel`` computes its loss without fusion;
* etp: ``etp.megatron.cross_entropy.vocab_cross_entropy``.

Per implementation: ms of forward + backward (mean of ``--iters`` after 3 warm-ups, CUDA
events), the bytes the loss keeps between forward and backward beyond the logits ("kept"), and
the peak allocated from the forward to the end of the backward beyond the logits ("peak": the
gradient handed on to the output layer included, the size of the logits for both), in GiB;
the largest difference of the losses and of the gradients between the two. JSON to ``--out``
with a ``provenance`` block.

Example::

    python3 tools/bench_cross_entropy.py --shapes 4096x4x151936,4096x1x129280 --out ce.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: bench_provenance

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path

from etp.megatron.cross_entropy import vocab_cross_entropy  # noqa: E402

GIB = 2**30


def _megatron():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1)
    return vocab_parallel_cross_entropy


def _measure(fn, logits, labels, iters):
    """(ms per forward + backward, GiB kept between them, GiB peak beyond the logits, loss, grad)."""
    x = logits.clone().requires_grad_(True)
    for _ in range(3):
        fn(x * 1, labels).sum().backward()
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    y = x * 1  # the output layer's logits: a fresh tensor the loss may keep or overwrite
    after_logits = torch.cuda.memory_allocated()
    loss = fn(y, labels)
    kept = torch.cuda.memory_allocated() - after_logits
    loss.sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - after_logits
    result_loss, result_grad = loss.detach().float(), x.grad.float()
    del y, loss
    x.grad = None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(x * 1, labels).sum().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, kept / GIB, peak / GIB, result_loss, result_grad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x4x151936,4096x2x151936,2048x8x32000",
                        help="comma-separated s x b x V")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cross_entropy: needs a CUDA GPU", file=sys.stderr)
        return 2
    impls = {"megatron": _megatron(), "etp": vocab_cross_entropy}
    rows = []
    for shape in args.shapes.split(","):
        s, b, v = (int(n) for n in shape.lower().split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = (4 * torch.randn(s, b, v, device="cuda", generator=g)).to(torch.bfloat16)
        labels = torch.randint(0, v, (s, b), device="cuda", generator=g)
        row, outputs = {"s": s, "b": b, "vocab": v, "logits_gib": logits.numel() * 2 / GIB}, {}
        for name, fn in impls.items():
            ms, kept, peak, loss, grad = _measure(fn, logits, labels, args.iters)
            row[name] = {"ms": ms, "kept_gib": kept, "peak_gib": peak}
            outputs[name] = (loss, grad)
            torch.cuda.empty_cache()
        row["max_loss_diff"] = (outputs["etp"][0] - outputs["megatron"][0]).abs().max().item()
        row["max_grad_diff"] = (outputs["etp"][1] - outputs["megatron"][1]).abs().max().item()
        rows.append(row)
        print(f"{s}x{b}x{v}: logits {row['logits_gib']:.2f} GiB | " + " | ".join(
            f"{n} {row[n]['ms']:.2f} ms, kept {row[n]['kept_gib']:.2f}, peak {row[n]['peak_gib']:.2f} GiB"
            for n in impls) + f" | max diff loss {row['max_loss_diff']:.2e}, grad {row['max_grad_diff']:.2e}",
            flush=True)
        del logits, labels, outputs
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"provenance": provenance(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
