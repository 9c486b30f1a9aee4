"""Timing the variants: warm-up, timed steps, interleaved rounds, the correctness check.

A step is forward + backward + the variant's finalize, timed with CUDA events (host clock on
CPU) after a synchronize, so the device starts idle. ``--rounds N`` runs the variant list N
times, interleaved (A B C A B C ...), so clock and power drift reach every variant alike; a
variant's figure is the mean over all its timed steps of every round, with each round's mean
and the rounds' spread beside it (never the best step or the best round).
"""
from __future__ import annotations

import gc
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

from .model import Env, Workload
from .variants import Prepared, Unsupported, prepare

__all__ = ["check_step", "measure_variant", "merge_round", "timed_step", "zero_grads"]

GIB = 1024**3


def zero_grads(prep: Prepared, work: Workload) -> None:
    if prep.step is not None:
        return  # a replay overwrites the graph-owned gradients; dropping them loses the link
    prep.module.zero_grad(set_to_none=True)
    work.x.grad = None


def _run_step(prep: Prepared, work: Workload) -> torch.Tensor:
    if prep.step is not None:
        out = prep.step(work)
    else:
        out = prep.module(work.x, work.counts)
        out.backward(work.grad_out)
    prep.finalize()
    return out


def timed_step(prep: Prepared, work: Workload, env: Env) -> float:
    """Milliseconds of one step (the device idle at its start)."""
    zero_grads(prep, work)
    if not env.cuda:
        start = time.perf_counter()
        _run_step(prep, work)
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _run_step(prep, work)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def reset_memory(env: Env) -> None:
    gc.collect()
    if env.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2 DTensor


def check_step(prep: Prepared, work: Workload, env: Env) -> dict:
    """One untimed step whose output sum (over ranks) and mean-gradient norm must agree across
    the bf16 variants up to rounding (FP8 ones up to FP8 rounding): a variant that is fast
    because it is wrong shows here."""
    zero_grads(prep, work)
    out_sum = _run_step(prep, work).detach().double().sum()
    sq = torch.zeros((), dtype=torch.float64, device=env.device)
    for param in prep.model.parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is None:
            continue
        grad = _local(grad).double()
        if prep.grads == "local":  # make it the mean gradient the other variants hold
            dist.all_reduce(grad)
            grad /= env.world
        sq += grad.square().sum()
    if prep.grads == "sharded":
        dist.all_reduce(sq)
    dist.all_reduce(out_sum)
    zero_grads(prep, work)
    return {"output_sum": out_sum.item(), "grad_norm": sq.sqrt().item()}


def _gathered(value: float) -> list[float]:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _summary(times: list[float], round_means: list[float]) -> dict:
    mean = statistics.fmean(times)
    per_rank = _gathered(mean)
    return {
        "step_ms": mean,
        "step_ms_stdev": statistics.stdev(times) if len(times) > 1 else 0.0,
        "round_step_ms": round_means,
        "round_spread": (max(round_means) - min(round_means)) / mean if mean else 0.0,
        "step_ms_per_rank": per_rank,
        "step_ms_max_over_ranks": max(per_rank),
    }


def measure_variant(name: str, args, env: Env, work: Workload, groups_cache: dict, tracer=None) -> dict:
    """One round of variant ``name``: ``args.warmup`` untimed and ``args.steps`` timed steps,
    peak memory, the check, and (``tracer``) a profiled trace. Never raises: a variant this
    machine cannot run is ``skipped``, a broken one ``failed``, and the others still run."""
    try:
        prep = prepare(name, args, env, groups_cache, args.gather_reuse)
        reset_memory(env)
        for _ in range(args.warmup):
            timed_step(prep, work, env)
        times = [timed_step(prep, work, env) for _ in range(args.steps)]
        result = {"status": "ok", "step_ms_all": times, **_summary(times, [statistics.fmean(times)]),
                  "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB if env.cuda else None,
                  "param_bytes_per_rank": prep.param_bytes, "wire_bytes_per_step_per_rank": prep.wire_bytes,
                  **prep.info}
        result["check"] = check_step(prep, work, env)
        if tracer is not None:
            result["profile"] = tracer(prep, work, env, name)
        zero_grads(prep, work)
        del prep
        reset_memory(env)
        return result
    except Unsupported as exc:  # raised on every rank alike, before any collective
        reset_memory(env)
        return {"status": f"skipped: {exc}"}
    except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        trace = traceback.format_exc()
    reset_memory(env)  # outside the except block: the traceback no longer pins the model
    if env.rank == 0:
        print(f"[bench_expert_stack] {name} failed:\n{trace}", file=sys.stderr)
    return {"status": f"failed: {reason}", "traceback": trace}


def merge_round(results: dict, name: str, result: dict) -> None:
    """Adds a later round's result of ``name``: steps pooled, the mean and spread recomputed
    over every round (a collective when both rounds are ok: every rank calls it alike)."""
    first = results.get(name)
    if first is None:
        results[name] = result
        return
    if first.get("status") != "ok" or result.get("status") != "ok":
        first.setdefault("later_rounds", []).append(result.get("status"))
        return
    first["step_ms_all"] += result["step_ms_all"]
    first.update(_summary(first["step_ms_all"], first["round_step_ms"] + result["round_step_ms"]))
