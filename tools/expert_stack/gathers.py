"""Gather bandwidth of the largest weight (one layer's ``fc1_weight [E, 2 ffn, hidden]``): etp's
own synchronous gather (``etp.runtime_of(model).acquire`` with prefetching off: the weight a
GEMM asks for, gathered on demand into the cache's ticket buffer) in bf16 and FP8, against a
raw NCCL ``all_gather_into_tensor`` of the same bytes on etp's all-gather communicator. Median
of 20 calls after 5, queued back to back between CUDA events. Reported: algbw (bytes gathered /
time) and busbw (algbw (W-1)/W) in GB/s, and etp over raw.
"""
from __future__ import annotations

import functools
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

import etp

from .measure import reset_memory
from .model import Env, build_model

__all__ = ["gather_bandwidth"]

WARMUP, ITERS = 5, 20


def _time_calls(fn, env: Env) -> list[float]:
    for _ in range(WARMUP):
        fn()
    if env.cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if not env.cuda:
        times = []
        for _ in range(ITERS):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ITERS)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _entry(what: str, times: list[float], shard_bytes: int, world: int) -> dict:
    median = statistics.median(times)
    algbw = shard_bytes * world / (median * 1e-3) / 1e9
    return {"status": "ok", "what": what, "shard_bytes": shard_bytes, "median_ms": median, "ms_all": times,
            "algbw_gbps": algbw, "busbw_gbps": algbw * (world - 1) / world}


def _etp_gather(shape, env: Env, groups_cache: dict, gather_dtype: str) -> tuple[dict, int]:
    """etp's gather of layer 0's fc1 weight in a 1-layer model; also the shard's element count."""
    from etp.cache import Role

    cfg = etp.ETPConfig(etp_size=env.world, expert_etp_size=env.world, prefetch=False, gather_dtype=gather_dtype)
    if "etp" not in groups_cache:
        groups_cache["etp"] = etp.build_etp_groups(cfg)
    model = build_model(SimpleNamespace(**{**vars(shape), "layers": 1}), env)
    etp.wrap_module_params_etp(model, cfg, groups_cache["etp"])
    if gather_dtype.startswith("fp8"):
        etp.quantize_shards(model)
    param = model.layers[0].fc1_weight
    # A consume outside autograd (records_grad=False: no gradient comes back for it), as a
    # no-grad forward makes; without prefetch every call gathers the weight now.
    gather = functools.partial(etp.runtime_of(model).acquire, param, Role.FWD, param.dtype, records_grad=False)
    fp8 = gather_dtype.startswith("fp8")
    label = gather_dtype if fp8 else str(param.dtype).removeprefix("torch.")
    entry = _entry(f"etp gather, {label}", _time_calls(gather, env), param.numel() * (1 if fp8 else param.element_size()),
                   env.world)
    return entry, param.numel()


def _raw_gather(env: Env, groups_cache: dict, numel: int, dtype: torch.dtype) -> dict:
    group = groups_cache["etp"].expert.ag_group
    src = torch.ones(numel, dtype=dtype, device=env.device)
    out = torch.empty(numel * env.world, dtype=dtype, device=env.device)
    gather = functools.partial(dist.all_gather_into_tensor, out, src, group=group)
    label = str(dtype).removeprefix("torch.")
    return _entry(f"raw all_gather_into_tensor, {label}", _time_calls(gather, env), numel * src.element_size(),
                  env.world)


def _guarded(fn, what: str, env: Env) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - report, keep measuring the others
        return {"status": f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:200], "what": what}
    finally:
        reset_memory(env)


def gather_bandwidth(shape, env: Env, groups_cache: dict) -> dict:
    """The section's entries (etp FP8, raw uint8 of the same bytes, etp bf16, raw bf16) and the
    busbw ratios etp / raw; skipped in a world of 1 (ETP shards nothing)."""
    if env.world == 1:
        return {"status": "skipped: a world of 1", "entries": {}}
    entries, numel = {}, {}
    for key, dtype in (("etp_fp8", "fp8_tensorwise"), ("etp_bf16", "param")):
        def run(key=key, dtype=dtype):
            entry, numel[key] = _etp_gather(shape, env, groups_cache, dtype)
            return entry
        entries[key] = _guarded(run, key, env)
    for key, source, dtype in (("raw_uint8", "etp_fp8", torch.uint8), ("raw_bf16", "etp_bf16", env.dtype)):
        if source in numel:
            entries[key] = _guarded(lambda s=source, d=dtype: _raw_gather(env, groups_cache, numel[s], d), key, env)

    def ratio(a: str, b: str) -> float | None:
        ea, eb = entries.get(a, {}), entries.get(b, {})
        ok = ea.get("status") == "ok" and eb.get("status") == "ok"
        return ea["busbw_gbps"] / eb["busbw_gbps"] if ok else None

    return {"status": "ok", "tensor": "layers.0.fc1_weight", "group_size": env.world, "warmup": WARMUP,
            "iters": ITERS, "entries": entries, "etp_fp8_over_raw_busbw": ratio("etp_fp8", "raw_uint8"),
            "etp_bf16_over_raw_busbw": ratio("etp_bf16", "raw_bf16")}
