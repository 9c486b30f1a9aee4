"""Probe: can torch reach NCCL's zero-CTA (copy-engine) all-gather, window registration and
per-communicator CTA caps? Run on 2+ GPUs of one host; every step is tried on its own and
reported (a failure is a finding, not an abort).

Steps:

1. versions: torch, NCCL built / loaded; ``ProcessGroupNCCL.Options().config`` fields;
   whether ``ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO`` exists; whether
   ``torch.distributed._symmetric_memory.set_backend`` / ``get_mem_pool`` exist.
2. ``max_ctas``: a communicator with ``config.max_ctas = 4`` runs a reduce-scatter; the
   profiler's kernel ``grid`` says how many CTAs NCCL launched.
3. zero-CTA policy, ordinary buffers: a communicator with ``cta_policy = ZERO`` runs an
   all-gather; kernels vs memcpys in the profile.
4. zero-CTA policy + NCCL symmetric memory (``set_backend("NCCL")``, the output from
   ``get_mem_pool``, rendezvoused: torch registers it as an NCCL window): the same.

Per step: kernel names with their grids, memcpy count, median ms of the gather of an
fc1-sized shard (``--mb`` MB gathered). JSON to ``--out``.

    torchrun --nproc-per-node=2 tools/diag/probe_nccl_ce.py --out $OUT/probe_nccl_ce.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: bench_provenance

from bench_provenance import provenance  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/diag/
from bench_overlap import median_call_ms  # noqa: E402 - one timing loop for the diag tools


def profile_kernels(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path, encoding="utf-8") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [(e["name"][:80], e.get("args", {}).get("grid")) for e in events if e.get("cat") == "kernel"]
    memcpy = [e["name"] for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset") or "Memcpy" in e.get("name", "")]
    return {"kernels": kernels, "memcpy": len(memcpy), "memcpy_names": sorted(set(memcpy))[:5]}


def step(report, name, fn):
    try:
        report[name] = {"ok": True, **fn()}
    except Exception as exc:  # noqa: BLE001 - a probe reports every failure
        report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                        "trace": traceback.format_exc()[-1500:]}


def _write(report: dict, out: str | None) -> None:
    """One line per probe step on stdout; the whole report as JSON to ``out``."""
    for key, value in report.items():
        if isinstance(value, dict) and "ok" in value:
            brief = {k: v for k, v in value.items() if k != "trace"}
            print(f"[probe] {key}: {json.dumps(brief)[:700]}")
        else:
            print(f"[probe] {key}: {value}")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


def main(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=402.7, help="MB gathered (fc1 bf16 = 402.7)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=3))
    world, rank = dist.get_world_size(), dist.get_rank()
    report: dict = {"provenance": provenance(), "world": world}
    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)

    def versions():
        options = pg_nccl.Options()
        config = getattr(options, "config", None)
        import torch.distributed._symmetric_memory as symm_mem

        return {
            "nccl_built": ".".join(map(str, torch.cuda.nccl.version())),
            "config_fields": sorted(a for a in dir(config) if not a.startswith("_")) if config is not None else None,
            "NCCL_CTA_POLICY_ZERO": getattr(pg_nccl, "NCCL_CTA_POLICY_ZERO", None),
            "symm_set_backend": hasattr(symm_mem, "set_backend"),
            "symm_get_mem_pool": hasattr(symm_mem, "get_mem_pool"),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM"))},
        }

    step(report, "versions", versions)
    numel = int(args.mb * 1e6 / 2 / world)  # bf16 shard elements
    shard = torch.randn(numel, device=device).to(torch.bfloat16)
    out = torch.empty(numel * world, dtype=torch.bfloat16, device=device)

    def capped():
        options = pg_nccl.Options()
        options.config.max_ctas = 4
        group = dist.new_group(list(range(world)), backend="nccl", pg_options=options)
        full = torch.randn(numel * world, device=device).to(torch.bfloat16)
        part = torch.empty(numel, dtype=torch.bfloat16, device=device)
        fn = lambda: dist.reduce_scatter_tensor(part, full, group=group)  # noqa: E731
        fn()
        return {"profile": profile_kernels(fn), "ms": median_call_ms(fn, 10)}

    step(report, "max_ctas_4_reduce_scatter", capped)
    zero_group = {}

    def zero_plain():
        options = pg_nccl.Options()
        options.config.cta_policy = pg_nccl.NCCL_CTA_POLICY_ZERO
        zero_group["g"] = group = dist.new_group(list(range(world)), backend="nccl", pg_options=options)
        fn = lambda: dist.all_gather_into_tensor(out, shard, group=group)  # noqa: E731
        fn()
        return {"profile": profile_kernels(fn), "ms": median_call_ms(fn, 10)}

    step(report, "zero_cta_plain_buffers", zero_plain)

    def zero_symm():
        import torch.distributed._symmetric_memory as symm_mem

        group = zero_group["g"]
        symm_mem.set_backend("NCCL")
        dist.barrier(group=group)
        with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
            window = torch.empty(numel * world, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(window, group=group.group_name)
        mine = window[rank * numel : (rank + 1) * numel]
        mine.copy_(shard)
        fn = lambda: dist.all_gather_into_tensor(window, mine, group=group)  # noqa: E731  in place
        fn()
        ok = torch.equal(window[rank * numel : (rank + 1) * numel], shard)
        return {"profile": profile_kernels(fn), "ms": median_call_ms(fn, 10), "own_rows_intact": ok}

    step(report, "zero_cta_nccl_symmetric_window", zero_symm)
    report["baseline_default_all_gather_ms"] = median_call_ms(lambda: dist.all_gather_into_tensor(out, shard), 10)
    if rank == 0:
        _write(report, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
