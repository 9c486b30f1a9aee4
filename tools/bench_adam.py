#!/usr/bin/env python
"""The optimizer step's two passes over a rank's fp32 state (BENCHMARKS.md, "The optimizer
step") on one GPU: torch's fused AdamW followed by megatron's fp32 -> bf16 weight copy, against
etp's fused AdamW (``etp.kernels.multi_tensor_adamw``), which writes the bf16 weights in the
same pass ([Note: fused AdamW]).

The tensors are a rank's shards of a recipe at ETP ``--etp`` (``--recipe``: every parameter of
its megatron-core model, each dim-0 sharded ``1/etp``, as etp-train steps them), fp32 masters,
gradients and moments, bf16 model weights. Per variant: ms per step (mean of ``--iters`` after
3 warm-ups, CUDA events), the bytes it must move (28 per element for AdamW, 6 more for a
separate copy, 2 more for a fused one) and their rate, against a copy of one 2 GiB buffer into
another (``copy``: read + write, the rate the others can at best reach). JSON to ``--out`` with a
``provenance`` block.

Example::

    python3 tools/bench_adam.py --recipe recipes/qwen3_30b_a3b.yaml --etp 4 --out adam.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: bench_provenance

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path
from diag.bench_overlap import back_to_back_ms  # noqa: E402 - one CUDA-event loop timer for the tools

from etp.kernels import multi_tensor_adamw  # noqa: E402

HYPER = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def shard_sizes(recipe_path: str, etp: int) -> list[int]:
    """Elements of every parameter a rank steps at world size and ETP ``etp`` (the memory
    audit's inventory: each sharded weight's padded shard, each replicated one whole)."""
    from etp.audit.inventory import weights_on_rank
    from etp.recipe import Recipe
    from etp.train.auto import Machine, resolve_auto

    recipe = Recipe.from_yaml(recipe_path, world_size=etp, etp={"etp_size": etp, "expert_etp_size": etp})
    recipe, _ = resolve_auto(recipe, Machine(etp, etp))
    return [numel for _, _, numel in weights_on_rank(recipe, recipe.etp)]


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return back_to_back_ms(fn, iters)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/qwen3_30b_a3b.yaml")
    parser.add_argument("--etp", type=int, default=4, help="ranks each weight is sharded over")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_adam.py times GPU kernels: run it on a CUDA machine")
    sizes = [n for n in shard_sizes(args.recipe, args.etp) if n]
    total = sum(sizes)
    print(f"{len(sizes)} tensors, {total / 1e9:.3f} G elements per rank", flush=True)
    # Laid out as in a megatron-core run: bf16 weights and fp32 gradients each views of one
    # buffer (DDP's), fp32 masters cloned one by one, the moments made per param in turn (torch
    # AdamW's first step: exp_avg, then exp_avg_sq).
    bounds = [0, *itertools.accumulate(sizes)]
    views = lambda flat: [flat[a:b] for a, b in zip(bounds, bounds[1:])]  # noqa: E731
    weights = views(torch.empty(total, device="cuda", dtype=torch.bfloat16))
    grads = views(torch.randn(total, device="cuda") * 1e-2)
    params = [torch.randn(n, device="cuda") * 1e-2 for n in sizes]
    m, v = [], []
    for n in sizes:
        m.append(torch.randn(n, device="cuda") * 1e-3)
        v.append(torch.rand(n, device="cuda") * 1e-4)
    masters = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(masters, grads):
        p.grad = g
    torch_adam = torch.optim.AdamW(masters, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                   eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], fused=True)
    for p, mm, vv in zip(masters, m, v):
        torch_adam.state[p].update(step=torch.tensor(1.0, device="cuda"), exp_avg=mm, exp_avg_sq=vv)
    scale = torch.tensor([1.25], device="cuda")
    torch_adam.grad_scale = scale  # the clip, as etp-train's sync-free step hands it over

    def torch_step():
        torch_adam.step()
        torch._foreach_copy_(weights, [p.detach() for p in masters])  # megatron's master -> model copy

    def torch_update_only():
        torch_adam.step()

    def etp_step():
        multi_tensor_adamw(params, grads, m, v, **HYPER, step=5, grad_scale=scale, out=weights)

    src, dst = (torch.empty(2**29, device="cuda") for _ in range(2))  # 2 GiB each: the copy's rate
    rows = {"copy": {"ms": _time(lambda: dst.copy_(src), args.iters), "bytes": 2 * src.numel() * 4}}
    rows["torch_fused_adamw"] = {"ms": _time(torch_update_only, args.iters), "bytes": 28 * total}
    rows["torch_fused_adamw_then_copy"] = {"ms": _time(torch_step, args.iters), "bytes": 34 * total}
    rows["etp_fused_adamw"] = {"ms": _time(etp_step, args.iters), "bytes": 30 * total}
    for name, row in rows.items():
        row["gb_per_s"] = row["bytes"] / row["ms"] / 1e6
        print(f"{name:40s} {row['ms']:8.2f} ms  {row['gb_per_s']:7.0f} GB/s", flush=True)
    report = {"recipe": args.recipe, "etp": args.etp, "tensors": len(sizes), "elements": total, "rows": rows,
              "provenance": provenance(sys.argv)}
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
