#!/usr/bin/env python
"""Per-document causal attention (``reset_attention_mask``) on one GPU: the candidate kernels,
forward + backward, against plain causal attention at the same shape, each checked against a
float64 per-document reference.

Candidates, all on ``[b, heads, s, d]`` bf16 with documents of log-normal lengths per row:

* ``sdpa_causal``: ``scaled_dot_product_attention(is_causal=True)``, the floor (no documents);
* ``sdpa_mask``: SDPA under the boolean block-diagonal causal mask (what etp-train runs
  where FlexAttention does not, ``etp.data.batch.document_attention_mask``);
* ``flex``: what etp-train runs on CUDA (``etp.megatron.document_attention``): compiled
  ``flex_attention`` under the block mask etp builds from the document ids (skips the tiles no
  document spans, runs the single-document ones unmasked);
* ``sdpa_per_document``: one causal SDPA call per document (a variable-length emulation:
  exact, its host loop the cost).

    python3 tools/bench_doc_attention.py --out doc_attention.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_provenance import provenance  # noqa: E402


def document_ids(b: int, s: int, median: int, seed: int = 0) -> torch.Tensor:
    """``[b, s]`` int: each position's document index within its row."""
    rng = random.Random(seed)
    rows = []
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < s:
            n = max(8, int(rng.lognormvariate(math.log(median), 0.8)))
            ids += [doc] * n
            doc += 1
        rows.append(ids[:s])
    return torch.tensor(rows)


def reference(q, k, v, docs) -> torch.Tensor:
    """float64 per-document causal attention, one row and head at a time."""
    b, h, s, d = q.shape
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    for i in range(b):
        allowed = causal & (docs[i][:, None] == docs[i][None, :])
        for j in range(h):
            scores = (q[i, j].double() @ k[i, j].double().T) / math.sqrt(d)
            out[i, j] = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v[i, j].double()
    return out


def _time(fn, q, k, v, grad, iters: int) -> float:
    for _ in range(3):
        fn(q, k, v).backward(grad)
    if q.device.type != "cuda":  # --cpu-smoke: checks the script, times nothing
        return float("nan")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(q, k, v).backward(grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def candidates(docs: torch.Tensor, s: int) -> dict:
    device = docs.device
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    allowed = (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]  # [b, 1, s, s], True = attend
    fns = {"sdpa_causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
           "sdpa_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)}
    try:
        from etp.megatron.document_attention import document_attention, ineligible_reason

        ids = docs.to(torch.int32).contiguous()
        reason = ineligible_reason(device.type, 0.0, s, s)
        if reason is not None:
            raise RuntimeError(f"etp runs SDPA under the mask here: {reason}")
        fns["flex"] = lambda q, k, v: document_attention(q, k, v, ids, scale=q.shape[-1] ** -0.5)
    except Exception as exc:  # noqa: BLE001 - reported, the others still run
        fns["flex"] = exc
    bounds = []
    for row in docs.tolist():
        starts = [0] + [i for i in range(1, s) if row[i] != row[i - 1]] + [s]
        bounds.append(list(zip(starts[:-1], starts[1:])))

    def per_document(q, k, v):
        rows = []
        for i, spans in enumerate(bounds):
            rows.append(torch.cat([F.scaled_dot_product_attention(q[i:i + 1, :, a:e], k[i:i + 1, :, a:e],
                                                                  v[i:i + 1, :, a:e], is_causal=True)
                                   for a, e in spans], dim=2))
        return torch.cat(rows)

    fns["sdpa_per_document"] = per_document
    return fns


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--median-doc", type=int, default=700)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: checks the script")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if args.cpu_smoke:
        args.batch, args.heads, args.seq, args.head_dim, args.median_doc, args.iters = 2, 2, 256, 16, 40, 1
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in "qkv")
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    docs = document_ids(args.batch, args.seq, args.median_doc).to(device)
    # The reference on one row and two heads: float64 on the GPU, exact to bf16's rounding.
    want = reference(q[:1, :2].detach(), k[:1, :2].detach(), v[:1, :2].detach(), docs[:1])
    rows = {}
    for name, fn in candidates(docs, args.seq).items():
        if isinstance(fn, Exception):
            rows[name] = {"error": f"{type(fn).__name__}: {fn}"[:300]}
            continue
        try:
            with torch.no_grad():
                got = fn(q, k, v)[:1, :2].double()
            error = None if name == "sdpa_causal" else float((got - want).abs().max())
            rows[name] = {"ms_fwd_bwd": _time(fn, q, k, v, grad, args.iters), "max_abs_error_vs_float64": error}
        except Exception as exc:  # noqa: BLE001
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(name, rows[name], flush=True)
    floor = rows["sdpa_causal"].get("ms_fwd_bwd")
    for row in rows.values():
        if floor and row.get("ms_fwd_bwd"):
            row["against_causal"] = row["ms_fwd_bwd"] / floor
    report = {"shape": dict(batch=args.batch, heads=args.heads, seq=args.seq, head_dim=args.head_dim),
              "documents_per_row": [int(d.max()) + 1 for d in docs], "median_document": args.median_doc,
              "rows": rows, "provenance": provenance()}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("| kernel | ms fwd+bwd | against causal | max error vs float64 |\n|---|---:|---:|---:|")
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | failed: {row['error'][:80]} | | |")
        else:
            err = "–" if row["max_abs_error_vs_float64"] is None else f"{row['max_abs_error_vs_float64']:.1e}"
            print(f"| {name} | {row['ms_fwd_bwd']:.3f} | {row.get('against_causal', 0):.2f}x | {err} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
