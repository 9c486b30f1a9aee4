"""Expert-parallel moves against two baselines of the same routing, in one run (torchrun, any
GPU count).

For every backend and move (dispatch, combine, dispatch backward, combine backward):

* its time (median over ``--iters``, the slowest rank's), and ``prepare``'s;
* the bytes it actually moves over the interconnect (``Backend.wire_rows``: rows of width H
  leaving / reaching each rank, this rank's own rows excluded; a de-duplicating backend
  counts one row per token and destination rank, ``nccl_padded`` its padding, the routing
  weights' 4 bytes per pair are left out) and their bandwidth (mean bytes per rank / time);
* NCCL ``all_to_all_single`` of exactly those bytes (the same per-peer split sizes, in that
  move's direction), timed in the same run: ``x a2a`` = its time / the move's time;
* megatron-core's ``alltoall`` dispatcher on the same routing, each of its moves timed alone
  (``tools/bench_ep_megatron.py: megatron_moves``): ``x megatron`` = its time / the move's
  (for dispatch, against ``prepare`` + dispatch: megatron's dispatch includes its own count
  exchange and permutation).

De-duplication is reported as what it is: ``dedup`` = bytes of every (token, expert) row to
another rank / the bytes moved, with ``a2a every pair`` the all-to-all of all those rows.

A backend may carry ``tune()`` options and ``EPConfig`` fields, ``/``-separated, in a row of
its own: ``nccl@num_ctas=64``, ``symm_dedup@num_ctas=32/num_warps=4``, ``hierarchical@ranks_per_host=2``
(hosts declared: 2 hosts x 2 on one 4-GPU machine). ``--ranks-per-host`` declares them for
every backend (the ``symm_*`` backends are then unavailable). ``--sweep`` times forward dispatch and combine over a grid of launch
options instead (``--sweep-*``; nccl backends: ``--sweep-ctas`` only).

    torchrun --nproc-per-node=4 tools/bench_ep.py --out ep.json --benchmarks-md ep.md
    torchrun --nproc-per-node=4 tools/bench_ep.py --backends nccl,symm_dedup,hierarchical@ranks_per_host=2
    torchrun --nproc-per-node=4 tools/bench_ep.py --workloads sonicmoe --backends symm_dedup --sweep
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from etp import ep  # noqa: E402
from etp.provenance import run_provenance  # noqa: E402

WORKLOADS = {
    # SonicMoE's shape; DeepSeek-V3-like (T chosen so every backend's buffers fit at 2 GPUs).
    "sonicmoe": dict(tokens=32768, hidden=4096, topk=8, experts=128),
    "deepseek_v3": dict(tokens=16384, hidden=7168, topk=8, experts=256),
    "smoke": dict(tokens=64, hidden=16, topk=4, experts=8),  # --cpu-smoke
}
MOVES = ("dispatch", "combine", "dispatch_bwd", "combine_bwd")
# Which side's traffic a move has: dispatch's backward is a combine, combine's a dispatch.
DIRECTION = {"dispatch": "dispatch", "combine": "combine", "dispatch_bwd": "combine", "combine_bwd": "dispatch"}


DEVICE = torch.device("cuda")  # CPU with --cpu-smoke


def _time(fn, iters, warmup):
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if DEVICE.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            fn()
            seconds = time.perf_counter() - began
        if i >= warmup:
            times.append(seconds)
    t = torch.tensor([statistics.median(times)], device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
    return float(t)


def _gather(vector):
    """Every rank's [W] row counts: matrix[s][d] = rows rank s moves to rank d."""
    t = torch.tensor(vector, dtype=torch.int64, device=DEVICE)
    rows = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, t)
    return [r.tolist() for r in rows]


def _a2a(matrix, hidden, args, cache):
    """NCCL all_to_all_single moving ``matrix`` (rows of ``hidden`` elements of the moves'
    dtype), timed; cached."""
    key = (tuple(map(tuple, matrix)), hidden)
    if key not in cache:
        me = dist.get_rank()
        send, recv = matrix[me], [row[me] for row in matrix]
        inp = torch.empty(sum(send), hidden, dtype=args.dtype, device=DEVICE)
        out = torch.empty(sum(recv), hidden, dtype=args.dtype, device=DEVICE)
        with torch.autograd.profiler.record_function("etp::bench_all_to_all_single"):
            cache[key] = _time(lambda: dist.all_to_all_single(out, inp, recv, send), args.iters, args.warmup)
        del inp, out
    return cache[key]


def _mean_bytes(matrix, hidden, dtype):
    return sum(map(sum, matrix)) / len(matrix) * hidden * dtype.itemsize


CONFIG_FIELDS = frozenset(f.name for f in dataclass_fields(ep.EPConfig))


def _parse_backend(spec):
    """``name@key=value/key=value`` -> (name, EPConfig fields, tune options)."""
    name, _, rest = spec.partition("@")
    fields, options = {}, {}
    for item in filter(None, rest.split("/")):
        key, _, value = item.partition("=")
        value = int(value) if value.lstrip("-").isdigit() else value
        (fields if key in CONFIG_FIELDS else options)[key] = value
    return name, fields, options


def _move_fns(disp, x, weights, grad, handle):
    """Every move of one dispatcher as a callable: the backward moves are the dispatcher's own
    ``dispatch_backward`` / ``combine_backward``, which the autograd nodes call. The rows
    combined (and sent back by dispatch's backward) are ``dispatch``'s receive buffer; ``grad``
    [T, H] is what combine's backward sends."""
    recv_x, recv_w, _ = disp.dispatch(x, weights, handle)
    return {"dispatch": lambda: disp.dispatch(x, weights, handle), "combine": lambda: disp.combine(recv_x, handle),
            "dispatch_bwd": lambda: disp.dispatch_backward(recv_x, recv_w, handle),
            "combine_bwd": lambda: disp.combine_backward(grad, handle)}


@torch.no_grad()
def _time_moves(disp, idx, weights, x, args):
    """Every move of one dispatcher, and ``prepare``."""
    state = {"handle": disp.prepare(idx)}

    def prepare():
        state["handle"] = disp.prepare(idx)

    times = {"prepare_s": _time(prepare, args.iters, args.warmup)}
    handle = state["handle"]
    for move, fn in _move_fns(disp, x, weights, torch.randn_like(x), handle).items():
        times[f"{move}_s"] = _time(fn, args.iters, args.warmup)
    disp.check()
    return times, handle


@torch.no_grad()
def _trace_moves(disp, idx, weights, x, handle, label, top: int = 8):
    """``--trace``: one profiled call of ``prepare`` and of each move; rank 0 prints each one's
    span and its ``top`` kernels (and collectives) by device time: where a move's time goes."""
    from torch.profiler import ProfilerActivity, profile

    moves = {**_move_fns(disp, x, weights, torch.randn_like(x), handle),
             "prepare": lambda: disp.prepare(idx)}  # prepare last
    for move, fn in moves.items():
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            began = time.perf_counter()
            fn()
            issued = time.perf_counter()
            torch.cuda.synchronize()
            ended = time.perf_counter()
        if dist.get_rank() != 0:
            continue
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
        kernels.sort(key=lambda e: -e.self_device_time_total)
        busy = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"trace {label} {move}: host issue {(issued - began) * 1e3:.2f} ms, done {(ended - began) * 1e3:.2f} ms, "
              f"kernels {busy:.2f} ms", flush=True)
        for e in kernels[:top]:
            print(f"    {e.self_device_time_total / 1e3:8.3f} ms  x{e.count:<3d} {e.key[:110]}", flush=True)
    disp.check()


def _wire(disp, handle):
    """Per direction, matrix[s][d] of rows that cross (combine: the transpose of what each
    rank's tokens get back)."""
    dispatch = _gather(disp.dispatch_backend.wire_rows(handle, "dispatch"))
    combine = _gather(disp.combine_backend.wire_rows(handle, "combine"))
    return {"dispatch": dispatch, "combine": [list(col) for col in zip(*combine)]}


def _row(name, spec, times, wire, megatron, args, a2a_cache):
    row = dict(workload=name, backend=spec, prepare_ms=times["prepare_s"] * 1e3)
    for move in MOVES:
        seconds, matrix = times[f"{move}_s"], wire[DIRECTION[move]]
        moved = _mean_bytes(matrix, args.hidden, args.dtype)
        t_a2a = _a2a(matrix, args.hidden, args, a2a_cache)
        row.update({f"{move}_ms": seconds * 1e3, f"{move}_MB": moved / 1e6, f"{move}_GBps": moved / seconds / 1e9,
                    f"{move}_a2a_ms": t_a2a * 1e3, f"{move}_x_a2a": t_a2a / seconds})
        if f"{move}_s" in megatron:
            mine = seconds + (times["prepare_s"] if move == "dispatch" else 0.0)
            row[f"{move}_x_megatron"] = megatron[f"{move}_s"] / mine
    return row


def _megatron(spec, idx, weights, x, args):
    if args.no_megatron:
        return {"error": "--no-megatron"}
    try:
        from bench_ep_megatron import megatron_moves

        return megatron_moves(spec, idx, weights, x, lambda fn: _time(fn, args.iters, args.warmup))
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, the rest goes on
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def _pairs_matrix(idx, experts):
    world, rank = dist.get_world_size(), dist.get_rank()
    counts = torch.bincount((idx // (experts // world)).reshape(-1), minlength=world)
    counts[rank] = 0
    return _gather(counts.tolist())


def bench_workload(name, spec, args):
    rank = dist.get_rank()
    args.hidden = spec["hidden"]
    dtype = args.dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    cfg = ep.EPConfig(num_experts=spec["experts"], topk=spec["topk"], hidden_size=spec["hidden"],
                      max_tokens_per_rank=spec["tokens"], dtype=dtype, capacity_factor=args.capacity_factor,
                      num_ctas=args.num_ctas, tile_rows=args.tile_rows or None, num_warps=args.num_warps,
                      num_stages=args.num_stages, validate=False, ranks_per_host=args.ranks_per_host or None)
    gen = torch.Generator(device=DEVICE).manual_seed(rank)
    scores = torch.rand(spec["tokens"], spec["experts"], generator=gen, device=DEVICE)
    weights, idx = scores.topk(spec["topk"], dim=1)
    x = torch.randn(spec["tokens"], spec["hidden"], generator=gen, device=DEVICE).to(dtype)
    a2a_cache = {}
    pairs = _pairs_matrix(idx, spec["experts"])
    t_pairs = _a2a(pairs, spec["hidden"], args, a2a_cache)
    megatron = _megatron(spec, idx, weights, x, args)
    info = dict(workload=name, **spec, a2a_every_pair_ms=t_pairs * 1e3,
                every_pair_MB=_mean_bytes(pairs, spec["hidden"], dtype) / 1e6,
                megatron_ms={k.replace("_s", "_ms"): v * 1e3 for k, v in megatron.items() if k.endswith("_s")},
                megatron_error=megatron.get("error"))
    rows = []
    for backend in args.backends.split(","):
        base, fields, options = _parse_backend(backend)
        if args.sweep and not (base.startswith("symm_") or base.startswith("nccl")):
            continue
        try:
            disp = ep.ExpertDispatcher(replace(cfg, backend=base, **fields), name=f"bench:{backend}", device=DEVICE)
            for b in {id(b): b for b in (disp.dispatch_backend, disp.combine_backend)}.values():
                b.tune(**options)
        except (ValueError, RuntimeError, TypeError, torch.OutOfMemoryError) as exc:
            rows.append(dict(workload=name, backend=backend, error=str(exc)[:300]))
            continue
        if args.sweep:
            rows += _sweep_backend(disp, backend, name, idx, weights, x, args, a2a_cache)
        else:
            times, handle = _time_moves(disp, idx, weights, x, args)
            rows.append(_row(name, backend, times, _wire(disp, handle), megatron, args, a2a_cache))
            rows[-1]["dedup"] = info["every_pair_MB"] / max(rows[-1]["dispatch_MB"], 1e-9)
            if args.trace and DEVICE.type == "cuda":
                _trace_moves(disp, idx, weights, x, handle, f"{name} {backend}")
        disp = None
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0 and rows:
            print(json.dumps(rows[-1]), flush=True)
    return info, rows


@torch.no_grad()
def _sweep_backend(disp, backend, workload, idx, weights, x, args, a2a_cache):
    """Forward dispatch and combine of one dispatcher at every grid point of its kind."""
    symm = backend.startswith("symm_")
    grid = (dict(num_ctas=_ints(args.sweep_ctas), tile_rows=_ints(args.sweep_rows), num_warps=_ints(args.sweep_warps),
                 num_stages=_ints(args.sweep_stages))
            if symm else dict(num_ctas=_ints(args.sweep_ctas)))
    backends = {id(b): b for b in (disp.dispatch_backend, disp.combine_backend)}.values()
    rows = []
    for values in itertools.product(*grid.values()):
        setting = dict(zip(grid, values))
        if "tile_rows" in setting:
            setting["tile_rows"] = setting["tile_rows"] or None
        for b in backends:
            b.tune(**setting)
        handle = disp.prepare(idx)
        wire = _wire(disp, handle)
        recv_x = disp.dispatch(x, weights, handle)[0]
        row = dict(workload=workload, backend=backend, **setting)
        for move, fn in (("dispatch", lambda h=handle: disp.dispatch(x, weights, h)),
                         ("combine", lambda h=handle, rows=recv_x: disp.combine(rows, h))):
            seconds, t_a2a = _time(fn, args.iters, args.warmup), _a2a(wire[move], args.hidden, args, a2a_cache)
            row.update({f"{move}_ms": seconds * 1e3, f"{move}_x_a2a": t_a2a / seconds,
                        f"{move}_GBps": _mean_bytes(wire[move], args.hidden, args.dtype) / seconds / 1e9})
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    disp.check()
    return rows


def _ints(csv):
    return [int(v) for v in csv.split(",")]


def _markdown(results, command):
    lines = [f"### EP moves, {results['world_size']}x {results['device']}", "", f"`{command}`", ""]
    for info in results["workloads"]:
        mega = info["megatron_ms"]
        lines += [f"**{info['workload']}** (T {info['tokens']}, H {info['hidden']}, K {info['topk']}, E "
                  f"{info['experts']}): all-to-all of every (token, expert) row to another rank "
                  f"{info['every_pair_MB']:.1f} MB/rank in {info['a2a_every_pair_ms']:.3f} ms; megatron alltoall "
                  + (", ".join(f"{k} {v:.3f}" for k, v in mega.items()) + " ms" if mega else
                     f"not run ({info['megatron_error']})"), "",
                  "| backend | move | ms | MB/rank moved | GB/s | a2a same bytes ms | x a2a | x megatron | dedup |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in (r for r in results["rows"] if r["workload"] == info["workload"]):
            if "error" in row:
                lines.append(f"| {row['backend']} | error: {row['error']} | | | | | | | |")
                continue
            for move in MOVES:
                xm = row.get(f"{move}_x_megatron")
                lines.append(f"| {row['backend']} | {move} | {row[f'{move}_ms']:.3f} | {row[f'{move}_MB']:.1f} | "
                             f"{row[f'{move}_GBps']:.0f} | {row[f'{move}_a2a_ms']:.3f} | {row[f'{move}_x_a2a']:.2f} | "
                             f"{'-' if xm is None else f'{xm:.2f}'} | {row['dedup']:.2f} |")
            lines.append(f"| {row['backend']} | prepare | {row['prepare_ms']:.3f} | | | | | | |")
        lines.append("")
    return "\n".join(lines)


def _sweep_markdown(results, command):
    rows = [r for r in results["rows"] if "error" not in r]
    keys = [k for k in rows[0] if k not in ("workload", "backend") and not k.endswith(("_ms", "_x_a2a", "_GBps"))] \
        if rows else []
    lines = [f"### EP launch sweep, {results['world_size']}x {results['device']}", "", f"`{command}`", "",
             "| workload | backend | " + " | ".join(keys) + " | dispatch ms | combine ms | x a2a (disp / comb) |",
             "|---|---|" + "---|" * len(keys) + "---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['backend']} | " + " | ".join(str(r.get(k)) for k in keys)
                     + f" | {r['dispatch_ms']:.3f} | {r['combine_ms']:.3f} | {r['dispatch_x_a2a']:.2f} / "
                     f"{r['combine_x_a2a']:.2f} |")
    return "\n".join(lines) + "\n"


TARGETS = {"symm_": ("x a2a >= 1.1 and x megatron >= 1.5", lambda r, m: r[f"{m}_x_a2a"] >= 1.1 and
                      r.get(f"{m}_x_megatron", 0) >= 1.5),
           "nccl": ("x a2a >= 0.85", lambda r, m: r[f"{m}_x_a2a"] >= 0.85)}


def steady_ms(run: dict) -> tuple[float, str]:
    """An etp-train report's steady ms/iter and which iterations it covers: the median over
    the log windows that start in the second half of the run (not profiled). The first
    iterations compile kernels (and, with ``backend=auto``, a fresh cache profiles at set-up):
    runs compared side by side must not carry their different warm-ups. Run etp-train with
    ``--log-interval 1`` so that every iteration is a window; without a log, its own mean."""
    log = [r for r in run.get("log") or [] if r.get("ms_per_iter") is not None]
    if not log:
        return run["ms_per_iter"], "the report's mean"
    last = max(r["iteration"] for r in log)
    starts = [1] + [r["iteration"] + 1 for r in log[:-1]]
    steady = [(s, r) for s, r in zip(starts, log) if s > last // 2 and not r.get("profiled")] or [(starts[-1], log[-1])]
    ms = sorted(r["ms_per_iter"] for _, r in steady)
    median = ms[len(ms) // 2] if len(ms) % 2 else (ms[len(ms) // 2 - 1] + ms[len(ms) // 2]) / 2
    return median, f"median of iterations {steady[0][0]}-{steady[-1][1]['iteration']}, {len(ms)} windows"


def targets(labelled_paths):
    """The issue's targets from benchmark JSON (this script's) and etp-train JSON files, given
    as ``label=path``: per world size, workload, backend and move, whether it meets its target;
    hierarchical against the nccl backend of the same run; recipe ratios (``ep4_alltoall`` /
    ``ep4_etp`` etc. by label) over steady iterations (``steady_ms``). Prints a table; returns
    it as lines."""
    lines, recipes = [], {}
    for item in labelled_paths:
        label, _, path = item.rpartition("=")
        data = json.loads(Path(path).read_text())
        if "ms_per_iter" in data:  # an etp-train run
            recipes[label or path] = steady_ms(data)
            continue
        lines += [f"### {label or path}: {data['world_size']}x {data['device']}", "",
                  "| workload | backend | move | ms | x a2a | x megatron | target | met |", "|---|---|---|---:|---:|---:|---|---|"]
        by_key = {(r["workload"], r["backend"]): r for r in data["rows"] if "error" not in r}
        for (workload, backend), r in by_key.items():
            rule = next((v for k, v in TARGETS.items() if backend.startswith(k)), None)
            nccl = by_key.get((workload, "nccl"))
            for move in MOVES:
                if backend.startswith("hierarchical") and nccl:
                    text, met = f"<= nccl {nccl[f'{move}_ms']:.3f} ms", r[f"{move}_ms"] <= nccl[f"{move}_ms"]
                elif rule:
                    text, met = rule[0], rule[1](r, move)
                else:
                    text, met = "-", None
                xm = r.get(f"{move}_x_megatron")
                lines.append(f"| {workload} | {backend} | {move} | {r[f'{move}_ms']:.3f} | {r[f'{move}_x_a2a']:.2f} | "
                             f"{'-' if xm is None else f'{xm:.2f}'} | {text} | {'' if met is None else 'yes' if met else 'NO'} |")
        lines.append("")
    for label, (ms, span) in recipes.items():
        lines.append(f"- recipe {label}: {ms:.1f} ms/iter ({span})")
    recipes = {label: ms for label, (ms, _) in recipes.items()}
    for base, other, goal in (("ep4_alltoall", "ep4_etp", 1.3), ("ep4_alltoall", "ep4_etp_eager", None),
                              ("ep1_xetp4", "ep2_xetp2", None), ("ep4_etp", "ep2_xetp2", None)):
        if base in recipes and other in recipes:
            ratio = recipes[base] / recipes[other]
            lines.append(f"- {base} / {other} = {ratio:.3f}" + (f" (target >= {goal}: {'yes' if ratio >= goal else 'NO'})"
                                                                 if goal else ""))
    print("\n".join(lines))
    return lines


def _parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="sonicmoe,deepseek_v3")
    parser.add_argument("--backends", default="nccl,nccl_padded,symm_push,symm_allgather,symm_dedup")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--ranks-per-host", type=int, default=0, help="EPConfig.ranks_per_host (0: detected)")
    parser.add_argument("--num-ctas", type=int, default=132, help="EPConfig.num_ctas (132)")
    parser.add_argument("--tile-rows", type=int, default=0, help="EPConfig.tile_rows (0: automatic)")
    parser.add_argument("--num-warps", type=int, default=8)
    parser.add_argument("--num-stages", type=int, default=3)
    parser.add_argument("--no-megatron", action="store_true", help="skip megatron-core's dispatcher baseline")
    parser.add_argument("--sweep", action="store_true", help="time forward moves over the grids below instead")
    # num_ctas costs no compile; every (rows, warps, stages) compiles each kernel once.
    parser.add_argument("--sweep-ctas", default="132")
    parser.add_argument("--sweep-rows", default="0", help="0: automatic")
    parser.add_argument("--sweep-warps", default="8")
    parser.add_argument("--sweep-stages", default="3")
    parser.add_argument("--trace", action="store_true",
                        help="also profile one call of each move: its span and top kernels (rank 0 prints)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--benchmarks-md", default=None)
    parser.add_argument("--targets", nargs="+", metavar="LABEL=JSON",
                        help="no run: the issue's targets from these benchmark / etp-train JSON files")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="gloo on CPU, the tiny 'smoke' workload, the CPU backends: checks the script, times nothing")
    return parser


def main(argv=None):
    global DEVICE
    args = _parser().parse_args(argv)
    if args.targets:
        return targets(args.targets)
    own_group = not dist.is_initialized()  # a test may call main() inside its own group
    if args.cpu_smoke:
        DEVICE = torch.device("cpu")
        if own_group:
            dist.init_process_group("gloo")
        args.workloads, args.iters, args.warmup, args.no_megatron = "smoke", 2, 1, True
        if args.backends == _parser().get_default("backends"):
            args.backends = "reference,nccl,nccl_padded"
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    if not args.no_megatron:
        import megatron.core.parallel_state as ps

        ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    results = dict(device=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", world_size=dist.get_world_size(), args=vars(args),
                   provenance=run_provenance(), workloads=[], rows=[])
    for name in args.workloads.split(","):
        info, rows = bench_workload(name, WORKLOADS[name], args)
        results["workloads"].append(info)
        results["rows"] += rows
    if dist.get_rank() == 0:
        command = "torchrun --nproc-per-node={} tools/bench_ep.py {}".format(dist.get_world_size(), " ".join(sys.argv[1:]))
        md = (_sweep_markdown if args.sweep else _markdown)(results, command)
        print(md)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))
        if args.benchmarks_md:
            Path(args.benchmarks_md).write_text(md)
    if own_group:  # else gloo's threads abort the interpreter at exit
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
