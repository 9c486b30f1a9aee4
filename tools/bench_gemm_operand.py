"""Does a grouped GEMM slow down because of *where its weight lives*, or because of what the
peer does meanwhile? (issue 14: the expert stack's bf16 GEMMs run 5-7% slower under ETP than
in ``replicated`` even with no copy beside them; BENCHMARKS.md, sessions 11 and 15.)

One forward grouped GEMM of the expert stack (``torch._grouped_mm``, x [E*T, H] bf16, weight
[E, F, H]), timed back to back with its weight operand in:

* ``plain``: a tensor of torch's caching allocator (what ``replicated`` reads);
* ``vmm``: one virtual range over ``world`` separate cuMemCreate allocations, the layout of an
  aliased gather buffer ([Note: aliased own rows], ``etp.transport.vmm.Mapping``);
* ``plain_after_copy``: the plain tensor, rewritten by a device-to-device copy (copy engine)
  before each round, as a gather rewrites its ticket buffer;
* ``vmm_one``: one cuMemCreate allocation behind one mapping (VMM itself, without the pieces);

and, with 2+ ranks, ``plain_peer_pulls``: the plain weight while every peer pulls from this
rank's memory over NVLink on its copy engines (the traffic a peer's gather and push put on this
GPU's HBM), timed on rank 0.

Rounds of ``--gemms`` GEMMs per case are interleaved and rotated (A B C, B C A, ...), each case
preceded by ``--settle`` untimed GEMMs on its own operand (before the case's copy or pulls), and
the median round per case is reported: a single figure drifts by 10-30% within a run
(BENCHMARKS.md, step (u)), and a fixed order let the GPU's power and clock state ramp across a
round's cases (this tool's first version, step (am), ranked its cases in their order of
execution). Then ``--interleaved`` rounds of one GEMM per local case, back to back, each
compared with the same round's ``plain`` GEMM: neighbours share the power and clock state.

    torchrun --standalone --nproc-per-node 2 tools/bench_gemm_operand.py --out gemm_operand.json

Writes JSON (``--out``) and prints a table; needs CUDA (``torch._grouped_mm``, sm90+).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--tokens-per-expert", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--out-features", type=int, default=3072, help="fc1's 2*ffn")
    p.add_argument("--gemms", type=int, default=20, help="GEMMs per round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--settle", type=int, default=10, help="untimed GEMMs before each timed case")
    p.add_argument("--interleaved", type=int, default=100, metavar="N",
                   help="then N rounds of one GEMM per local case, back to back, each timed alone: "
                        "neighbours share the GPU's power and clock state, so their ratio cancels it")
    p.add_argument("--out", type=str, default=None)
    return p.parse_args(argv)


def _timed(fn, gemms: int) -> float:
    """Mean microseconds of one GEMM over ``gemms`` back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(gemms):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / gemms


def _interleaved(rounds: int, cases: dict) -> dict:
    """Each round: every case once (its action, then one GEMM between two events), in an order
    rotated per round, with no synchronization between rounds. Returns per case the median
    time and the median of its ratio to the same round's ``plain`` GEMM."""
    names = list(cases)
    events = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, before = cases[name]
            if callable(before):
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    times = {name: [a.elapsed_time(b) * 1e3 for a, b in pairs] for name, pairs in events.items()}
    return {name: {"median_us": statistics.median(t),
                   "median_ratio_to_plain": statistics.median(x / p for x, p in zip(t, times["plain"])),
                   "us": t} for name, t in times.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        print("bench_gemm_operand: needs CUDA and torch._grouped_mm; nothing to do")
        return 0
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    from etp.transport.vmm import Mapping, granularity

    e, t, h, f = args.experts, args.tokens_per_expert, args.hidden, args.out_features
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(e * t, h, device=device, dtype=torch.bfloat16, generator=gen)
    offs = torch.cumsum(torch.full((e,), t, device=device, dtype=torch.int32), 0, dtype=torch.int32)
    plain = torch.randn(e, f, h, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    nbytes = plain.numel() * plain.element_size()
    pieces = max(world, 2)
    gran = granularity(device)
    piece = -(-nbytes // pieces // gran) * gran
    mapping = Mapping(device, [(None, piece)] * pieces)
    vmm = mapping.tensor(torch.bfloat16, plain.shape)
    vmm.copy_(plain)
    whole = Mapping(device, [(None, piece * pieces)])  # one allocation behind one mapping
    vmm_one = whole.tensor(torch.bfloat16, plain.shape)
    vmm_one.copy_(plain)
    source = plain.clone()  # what the "gather" copies from
    copy_stream = torch.cuda.Stream(device)

    def gemm(w):
        return lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def after_copy():
        with torch.cuda.stream(copy_stream):
            plain.copy_(source)  # a device-to-device copy: the copy engine
        torch.cuda.current_stream().wait_stream(copy_stream)

    cases = {"plain": (gemm(plain), None), "vmm": (gemm(vmm), None), "plain_after_copy": (gemm(plain), after_copy)}
    peer = None
    if world > 1:
        import torch.distributed._symmetric_memory as symm_mem

        shared = symm_mem.empty(nbytes // 2, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(shared, dist.group.WORLD.group_name)
        landing = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        peer = handle.get_buffer((rank + 1) % world, (nbytes // 2,), torch.uint8)
        cases["plain_peer_pulls"] = (gemm(plain), "peer")

    for fn, _ in cases.values():  # warm-up: kernels chosen, clocks up
        _timed(fn, 5)
    results = {name: [] for name in cases}
    names = list(cases)
    for round_index in range(args.rounds):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            fn, before = cases[name]
            for _ in range(args.settle):  # before the case's own action, which must come last
                fn()
            if callable(before):
                before()
            pulls = 0
            if before == "peer":
                # Every rank pulls its neighbour's buffer on a side stream while rank 0 times;
                # the other ranks time nothing (their own GEMMs would add nothing to rank 0).
                dist.barrier()
                with torch.cuda.stream(copy_stream):
                    for _ in range(4 * args.gemms):
                        landing.copy_(peer)
                        pulls += 1
            results[name].append(_timed(fn, args.gemms))
            if before == "peer":
                torch.cuda.synchronize(device)
                dist.barrier()
            else:
                torch.cuda.synchronize(device)
    summary = {name: {"median_us": statistics.median(v), "rounds_us": v} for name, v in results.items()}
    base = summary["plain"]["median_us"]
    for v in summary.values():
        v["vs_plain"] = v["median_us"] / base
    interleaved = _interleaved(args.interleaved, {"plain": (gemm(plain), None), "vmm": (gemm(vmm), None),
                                                  "vmm_one": (gemm(vmm_one), None),
                                                  "plain_after_copy": (gemm(plain), after_copy)})
    if rank == 0:
        flops = 2 * e * t * h * f
        print(f"| weight operand (grouped GEMM {e}x{t} tokens, {h}->{f}, bf16) | median µs | TFLOP/s | × plain |")
        print("|---|---:|---:|---:|")
        for name, v in summary.items():
            print(f"| {name} | {v['median_us']:.0f} | {flops / v['median_us'] / 1e6:.0f} | {v['vs_plain']:.3f} |")
        print(f"\ninterleaved, one GEMM per case per round, {args.interleaved} rounds:")
        print("| weight operand | median µs | median ratio to the round's plain GEMM |")
        print("|---|---:|---:|")
        for name, v in interleaved.items():
            print(f"| {name} | {v['median_us']:.0f} | {v['median_ratio_to_plain']:.3f} |")
        out = args.out or os.path.join(os.environ.get("OUT", "."), "bench_gemm_operand.json")
        record = {"benchmark": "gemm_operand", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "command": " ".join(["torchrun", f"--nproc-per-node={world}", *sys.argv]) if distributed
                  else " ".join(["python3", *sys.argv]),
                  "gpu": torch.cuda.get_device_name(device), "world": world, "config": vars(args),
                  "results": summary, "interleaved": interleaved}
        Path(out).write_text(json.dumps(record, indent=1))
        print(f"JSON: {out}")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
