"""Expert-parallel dispatch / combine benchmark (torchrun, any GPU count).

Per backend: prepare, dispatch and combine forward and backward times (median over
``--iters``) and effective bandwidth = bytes of the (token, expert) rows leaving the rank
(pairs routed to other ranks x H x element size) / time, side by side with NCCL
``all_to_all_single`` of the same bytes (the same split sizes) in the same run.

``--sweep`` instead times forward dispatch and combine of each symm backend over a grid of
the copy kernels' launch parameters (``--sweep-ctas`` x ``--sweep-rows`` x
``--sweep-warps`` x ``--sweep-stages``; see [Note: row tiles] in ``etp.kernels.ep_move``),
one dispatcher per backend re-tuned in place, and prints one table row per setting and the
best one per move. Each (rows, warps, stages) compiles the kernels anew: keep the grid small.

    torchrun --nproc-per-node=2 tools/bench_ep.py --out ep.json --benchmarks-md ep.md
    torchrun --nproc-per-node=2 tools/bench_ep.py --workloads sonicmoe --backends symm_dedup --sweep
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from etp import ep  # noqa: E402

WORKLOADS = {
    # SonicMoE's shape; DeepSeek-V3-like (T chosen so every backend's buffers fit at 2 GPUs).
    "sonicmoe": dict(tokens=32768, hidden=4096, topk=8, experts=128),
    "deepseek_v3": dict(tokens=16384, hidden=7168, topk=8, experts=256),
}


def _time(fn, iters, warmup):
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
    return float(t)


def _time_a2a(splits_in, splits_out, hidden, args):
    a2a_in = torch.empty(sum(splits_in), hidden, dtype=torch.bfloat16, device="cuda")
    a2a_out = torch.empty(sum(splits_out), hidden, dtype=torch.bfloat16, device="cuda")
    return _time(lambda: dist.all_to_all_single(a2a_out, a2a_in, splits_out, splits_in), args.iters, args.warmup)


@torch.no_grad()
def _time_backend(disp, idx, weights, x, args):
    """Forward and backward moves of one dispatcher (backward: the moves autograd runs)."""
    state = {"handle": disp.prepare(idx)}

    def prepare():
        state["handle"] = disp.prepare(idx)

    grad = torch.randn_like(x)
    times = {"prepare_s": _time(prepare, args.iters, args.warmup)}
    handle, recv_x = state["handle"], disp._recv_x
    times["dispatch_s"] = _time(lambda: disp.dispatch(x, weights, handle), args.iters, args.warmup)
    times["combine_s"] = _time(lambda: disp.combine(recv_x, handle), args.iters, args.warmup)
    times["dispatch_bwd_s"] = _time(lambda: disp._move_combine(recv_x, handle, backward=True), args.iters,
                                    args.warmup)
    times["combine_bwd_s"] = _time(lambda: disp._move_dispatch(grad, None, handle, backward=True), args.iters,
                                   args.warmup)
    disp.check()
    return times


@torch.no_grad()
def _sweep_backend(disp, idx, weights, x, bytes_out, t_a2a, args):
    """Forward dispatch and combine times of one dispatcher at every grid point."""
    handle = disp.prepare(idx)
    backends = {id(b): b for b in (disp.dispatch_backend, disp.combine_backend)}.values()
    rows = []
    for num_ctas, tile_rows, num_warps, num_stages in itertools.product(
            _ints(args.sweep_ctas), _ints(args.sweep_rows), _ints(args.sweep_warps), _ints(args.sweep_stages)):
        setting = dict(num_ctas=num_ctas, tile_rows=tile_rows or None, num_warps=num_warps, num_stages=num_stages)
        for backend in backends:
            backend.tune(**setting)
        t_disp = _time(lambda: disp.dispatch(x, weights, handle), args.iters, args.warmup)
        t_comb = _time(lambda: disp.combine(disp._recv_x, handle), args.iters, args.warmup)
        rows.append(dict(backend=disp.backend, **setting, dispatch_s=t_disp, combine_s=t_comb,
                         dispatch_GBps=bytes_out / t_disp / 1e9, combine_GBps=bytes_out / t_comb / 1e9,
                         vs_a2a_dispatch=t_a2a / t_disp, vs_a2a_combine=t_a2a / t_comb))
        if dist.get_rank() == 0:
            print(json.dumps(rows[-1]), flush=True)
    disp.check()
    return rows


def _ints(csv):
    return [int(v) for v in csv.split(",")]


def bench_workload(name, spec, backends, args):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ep.EPConfig(num_experts=spec["experts"], topk=spec["topk"], hidden_size=spec["hidden"],
                      max_tokens_per_rank=spec["tokens"], dtype=torch.bfloat16, capacity_factor=args.capacity_factor,
                      num_ctas=args.num_ctas, tile_rows=args.tile_rows or None, num_warps=args.num_warps,
                      num_stages=args.num_stages, validate=False)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    scores = torch.rand(spec["tokens"], spec["experts"], generator=gen, device="cuda")
    weights, idx = scores.topk(spec["topk"], dim=1)
    x = torch.randn(spec["tokens"], spec["hidden"], generator=gen, device="cuda").to(torch.bfloat16)
    elem = 2
    local = spec["experts"] // world
    dest = idx // local
    send_rows = torch.bincount(dest.reshape(-1), minlength=world)
    remote_rows = int(send_rows.sum() - send_rows[rank])
    bytes_out = remote_rows * spec["hidden"] * elem
    # NCCL all_to_all_single of the same rows (same split sizes).
    splits_all = [torch.zeros_like(send_rows) for _ in range(world)]
    dist.all_gather(splits_all, send_rows)
    t_a2a = _time_a2a(send_rows.tolist(), [int(s[rank]) for s in splits_all], spec["hidden"], args)
    rows = [dict(workload=name, backend="nccl all_to_all_single (same bytes)", dispatch_s=t_a2a, combine_s=t_a2a,
                 dispatch_GBps=bytes_out / t_a2a / 1e9, combine_GBps=bytes_out / t_a2a / 1e9)]
    for backend in backends:
        if args.sweep and not backend.startswith("symm_"):
            continue  # only the symm backends have launch parameters to sweep
        try:
            disp = ep.ExpertDispatcher(replace(cfg, backend=backend), name=f"bench:{backend}")
        except (ValueError, RuntimeError, torch.OutOfMemoryError) as exc:
            rows.append(dict(workload=name, backend=backend, error=str(exc)[:200]))
            continue
        if args.sweep:
            swept = _sweep_backend(disp, idx, weights, x, bytes_out, t_a2a, args)
            rows += [dict(workload=name, **row) for row in swept]
            disp = None
            torch.cuda.empty_cache()
            continue
        times = _time_backend(disp, idx, weights, x, args)
        rows.append(dict(workload=name, backend=disp.backend, **times,
                         dispatch_GBps=bytes_out / times["dispatch_s"] / 1e9,
                         combine_GBps=bytes_out / times["combine_s"] / 1e9,
                         vs_a2a_dispatch=t_a2a / times["dispatch_s"], vs_a2a_combine=t_a2a / times["combine_s"]))
        disp = None
        torch.cuda.empty_cache()
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    return dict(workload=name, world_size=world, bytes_leaving_rank=bytes_out, **spec), rows


def _markdown(results, command):
    lines = [f"### EP dispatch / combine, {results['world_size']}x {results['device']}", "", f"`{command}`", "",
             "| workload | backend | prepare ms | dispatch ms | combine ms | dispatch bwd ms | combine bwd ms |"
             " dispatch GB/s | combine GB/s | x a2a (disp / comb) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ms = lambda r, k: f"{r[k] * 1e3:.3f}" if k in r else "-"  # noqa: E731
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['workload']} | {row['backend']} | error: {row['error']} |")
            continue
        ratio = (f"{row['vs_a2a_dispatch']:.2f} / {row['vs_a2a_combine']:.2f}" if "vs_a2a_dispatch" in row else "1")
        lines.append(f"| {row['workload']} | {row['backend']} | {ms(row, 'prepare_s')} | {ms(row, 'dispatch_s')} | "
                     f"{ms(row, 'combine_s')} | {ms(row, 'dispatch_bwd_s')} | {ms(row, 'combine_bwd_s')} | "
                     f"{row['dispatch_GBps']:.1f} | {row['combine_GBps']:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def _sweep_markdown(results, command):
    lines = [f"### EP launch-parameter sweep, {results['world_size']}x {results['device']}", "", f"`{command}`", "",
             "| workload | backend | num_ctas | tile_rows | num_warps | num_stages | dispatch ms | combine ms |"
             " dispatch GB/s | combine GB/s | x a2a (disp / comb) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['workload']} | {row['backend']} | error: {row['error']} |")
        elif "num_ctas" not in row:  # the NCCL all-to-all of the same bytes
            lines.append(f"| {row['workload']} | {row['backend']} | | | | | {row['dispatch_s'] * 1e3:.3f} | "
                         f"{row['combine_s'] * 1e3:.3f} | {row['dispatch_GBps']:.1f} | {row['combine_GBps']:.1f} | 1 |")
        else:
            lines.append(f"| {row['workload']} | {row['backend']} | {row['num_ctas']} | {row['tile_rows'] or 'auto'} | "
                         f"{row['num_warps']} | {row['num_stages']} | {row['dispatch_s'] * 1e3:.3f} | "
                         f"{row['combine_s'] * 1e3:.3f} | {row['dispatch_GBps']:.1f} | {row['combine_GBps']:.1f} | "
                         f"{row['vs_a2a_dispatch']:.2f} / {row['vs_a2a_combine']:.2f} |")
    lines.append("")
    swept = [row for row in results["rows"] if "num_ctas" in row]
    for move in ("dispatch", "combine"):
        for key in sorted({(row["workload"], row["backend"]) for row in swept}):
            best = min((row for row in swept if (row["workload"], row["backend"]) == key),
                       key=lambda row: row[f"{move}_s"])
            lines.append(f"- best {move}, {key[0]} {key[1]}: num_ctas={best['num_ctas']} "
                         f"tile_rows={best['tile_rows'] or 'auto'} num_warps={best['num_warps']} "
                         f"num_stages={best['num_stages']}: {best[f'{move}_s'] * 1e3:.3f} ms, "
                         f"{best[f'vs_a2a_{move}']:.2f}x a2a")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="sonicmoe,deepseek_v3")
    parser.add_argument("--backends", default="nccl,symm_push,symm_allgather,symm_dedup")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--num-ctas", type=int, default=132, help="EPConfig.num_ctas (132)")
    parser.add_argument("--tile-rows", type=int, default=0, help="EPConfig.tile_rows (0: automatic)")
    parser.add_argument("--num-warps", type=int, default=8)
    parser.add_argument("--num-stages", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="time the symm backends over the grid below instead")
    # num_ctas costs no compile; every (rows, warps, stages) compiles each kernel once.
    parser.add_argument("--sweep-ctas", default="32,64,132")
    parser.add_argument("--sweep-rows", default="0,8", help="0: automatic")
    parser.add_argument("--sweep-warps", default="8")
    parser.add_argument("--sweep-stages", default="2,3,4")
    parser.add_argument("--out", default=None)
    parser.add_argument("--benchmarks-md", default=None)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    results = dict(device=torch.cuda.get_device_name(), world_size=dist.get_world_size(), torch=torch.__version__,
                   args=vars(args), workloads=[], rows=[])
    for name in args.workloads.split(","):
        info, rows = bench_workload(name, WORKLOADS[name], args.backends.split(","), args)
        results["workloads"].append(info)
        results["rows"] += rows
    if dist.get_rank() == 0:
        command = "torchrun --nproc-per-node={} tools/bench_ep.py {}".format(dist.get_world_size(), " ".join(sys.argv[1:]))
        md = (_sweep_markdown if args.sweep else _markdown)(results, command)
        print(md)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        if args.benchmarks_md:
            Path(args.benchmarks_md).write_text(md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
