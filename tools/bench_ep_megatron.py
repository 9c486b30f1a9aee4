"""megatron-core's ``alltoall`` token dispatcher against etp's ``EtpTokenDispatcher`` end to end.

The round trip of one MoE layer's tokens through each dispatcher, permutation included (the
per-move comparison is in ``tools/bench_ep.py``, which imports ``megatron_moves`` from here).
Both run megatron's dispatcher call sequence on the same routing (``dispatch_preprocess`` -> ``token_dispatch`` -> ``dispatch_postprocess`` -> identity experts
-> ``combine_preprocess`` -> ``token_combine`` -> ``combine_postprocess``), forward and
backward, timed per iteration (median over ``--iters``, the slowest rank). Any world size:

    torchrun --standalone --nproc-per-node=2 tools/bench_ep_megatron.py --out ep_megatron.json
    torchrun --standalone --nproc-per-node=2 tools/bench_ep_megatron.py --cpu-smoke   # gloo, tiny

The etp dispatcher runs with ``trim=True`` (megatron's experts get the valid rows and host
counts: one host sync, as megatron's own) and each ``--etp-backends`` entry (default
``symm_dedup``).
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

WORKLOADS = {  # tokens per rank, hidden, top-k, experts (bench_ep's)
    "sonicmoe": dict(tokens=32768, hidden=4096, topk=8, experts=128),
    "deepseek_v3": dict(tokens=16384, hidden=7168, topk=8, experts=256),
    "smoke": dict(tokens=16, hidden=8, topk=2, experts=4),
}


def _config(spec, dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=spec["hidden"], num_attention_heads=1,
                             num_moe_experts=spec["experts"], moe_router_topk=spec["topk"],
                             moe_token_dispatcher_type="alltoall", params_dtype=dtype,
                             bf16=dtype == torch.bfloat16, use_cpu_initialization=True)


def _groups():
    from megatron.core.process_groups_config import ProcessGroupCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    return ProcessGroupCollection(ep=dist.group.WORLD, expt_tp=singles[rank], tp_ep=dist.group.WORLD)


def _round_trip(d, x, routing_map, probs):
    """One forward and backward through megatron's dispatcher call sequence."""
    tokens, p = d.dispatch_preprocess(x, routing_map, probs)
    tokens, p = d.token_dispatch(tokens, p)
    h, _tokens_per_expert, p = d.dispatch_postprocess(tokens, p)
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(h * p[:, None].to(h.dtype))))
    out.backward(torch.ones_like(out))


def _time(fn, iters, warmup, cuda):
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], device="cuda" if cuda else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
    return float(t)


def megatron_moves(spec, idx, weights, x, time_fn):
    """megatron-core's ``alltoall`` dispatcher on the routing ``idx`` / ``weights`` [T, K] of
    ``x`` [T, H] (this rank's), each move timed alone by ``time_fn(fn) -> seconds``:
    ``dispatch`` (dispatch_preprocess + token_dispatch + dispatch_postprocess: its count
    exchange, permutation and all-to-all, with the host sync of its split sizes),
    ``combine`` (combine_preprocess + token_combine + combine_postprocess), and the backward
    of each (``torch.autograd.grad`` of its output, the graph kept). For ``tools/bench_ep.py``:
    needs CUDA and megatron's parallel state initialized with EP = the world.

    Example::

        times = megatron_moves(WORKLOADS["sonicmoe"], idx, weights, x, lambda fn: _time(fn, 10, 3))
    """
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    world, rank = dist.get_world_size(), dist.get_rank()
    local = spec["experts"] // world
    d = MoEAlltoAllTokenDispatcher(local, list(range(rank * local, (rank + 1) * local)), _config(spec, x.dtype),
                                   _groups())
    routing_map = torch.zeros(x.shape[0], spec["experts"], dtype=torch.bool, device=x.device).scatter_(1, idx, True)
    probs = torch.zeros(x.shape[0], spec["experts"], device=x.device).scatter(1, idx, weights.float())

    def dispatch(inp):
        tokens, p = d.dispatch_preprocess(inp, routing_map, probs)
        tokens, p = d.token_dispatch(tokens, p)
        return d.dispatch_postprocess(tokens, p)[0]

    def combine(h):
        return d.combine_postprocess(d.token_combine(d.combine_preprocess(h)))

    times = {}
    with torch.no_grad():
        times["dispatch_s"] = time_fn(lambda: dispatch(x))
        h = dispatch(x)
        times["combine_s"] = time_fn(lambda: combine(h))
    x_grad = x.detach().requires_grad_(True)
    h = dispatch(x_grad)
    grad_h = torch.randn_like(h)
    times["dispatch_bwd_s"] = time_fn(lambda: torch.autograd.grad(h, x_grad, grad_h, retain_graph=True))
    h_grad = h.detach().requires_grad_(True)
    out = combine(h_grad)
    grad_out = torch.randn_like(out)
    times["combine_bwd_s"] = time_fn(lambda: torch.autograd.grad(out, h_grad, grad_out, retain_graph=True))
    return times


def _profile(fn, title, rows=18):
    """One more round trip under the torch profiler; rank 0 prints its kernels by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print(f"--- profile: {title}", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows), flush=True)


def bench(name, spec, args, device):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from etp.megatron.ep_dispatcher import EtpTokenDispatcher

    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if spec["experts"] % world:
        raise ValueError(f"workload {name}: {spec['experts']} experts do not split over {world} ranks")
    local = spec["experts"] // world
    local_ids = list(range(rank * local, (rank + 1) * local))
    config, pgs = _config(spec, dtype), _groups()
    gen = torch.Generator(device=device).manual_seed(rank)
    scores = torch.rand(spec["tokens"], spec["experts"], generator=gen, device=device)
    weights, idx = scores.topk(spec["topk"], dim=1)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.zeros_like(scores).scatter(1, idx, weights)
    x = torch.randn(spec["tokens"], spec["hidden"], generator=gen, device=device).to(dtype)

    def runner(d):
        def run():
            _round_trip(d, x.detach().requires_grad_(True), routing_map, probs.detach().requires_grad_(True))
        return run

    # megatron's alltoall dispatcher makes a CUDA stream at construction: GPU only.
    megatron_d = MoEAlltoAllTokenDispatcher(local, local_ids, config, pgs) if cuda else None
    megatron_s = _time(runner(megatron_d), args.iters, args.warmup, cuda) if cuda else None
    if cuda and args.profile:
        _profile(runner(megatron_d), f"{name} megatron alltoall")
    del megatron_d
    rows = [dict(workload=name, dispatcher="megatron alltoall", round_trip_s=megatron_s)]
    for backend in args.etp_backends.split(","):
        d = EtpTokenDispatcher(local, local_ids, config, pgs, max_tokens_per_rank=spec["tokens"], backend=backend,
                               trim=True, device=device)
        t = _time(runner(d), args.iters, args.warmup, cuda)
        if cuda and args.profile:
            _profile(runner(d), f"{name} etp {d.dispatcher.backend}")
        rows.append(dict(workload=name, dispatcher=f"etp {d.dispatcher.backend}", round_trip_s=t,
                         speedup_vs_megatron=megatron_s / t if megatron_s else None))
        del d
    if rank == 0:
        for row in rows:
            print(json.dumps(row), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="sonicmoe,deepseek_v3")
    p.add_argument("--etp-backends", default="symm_dedup", help="EPConfig backends of the etp dispatcher")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true",
                   help="after timing, one profiled round trip per dispatcher: rank 0 prints its top kernels")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="gloo on CPU, the tiny 'smoke' workload, reference backend (megatron's dispatcher needs CUDA)")
    args = p.parse_args()
    if args.cpu_smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        args.workloads, args.etp_backends, args.iters, args.warmup = "smoke", "reference", 2, 1
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    import megatron.core.parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    rows = []
    for name in args.workloads.split(","):
        rows += bench(name, WORKLOADS[name], args, device)
    if dist.get_rank() == 0:
        command = "torchrun --nproc-per-node={} tools/bench_ep_megatron.py {}".format(
            dist.get_world_size(), " ".join(sys.argv[1:]))
        print(f"\n`{command}`\n\n| workload | dispatcher | round trip ms (forward + backward) | x megatron |\n|---|---|---:|---:|")
        for row in rows:
            ms = "needs CUDA" if row["round_trip_s"] is None else f"{row['round_trip_s'] * 1e3:.3f}"
            ratio = row.get("speedup_vs_megatron", 1.0)
            print(f"| {row['workload']} | {row['dispatcher']} | {ms} | {'-' if ratio is None else f'{ratio:.2f}'} |")
        if args.out:
            from etp.provenance import run_provenance

            Path(args.out).write_text(json.dumps(dict(command=command, world_size=dist.get_world_size(),
                                                      device=str(device), rows=rows,
                                                      provenance=run_provenance()), indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
