"""``profile``: time every available backend on the layer's workload; cache the fastest.

The cache is one JSON file (``<cache_dir>/ep_backends.json``) keyed by
``(device name, world size, T, H, K, E, dtype)``; rank 0 reads and writes it and broadcasts
the choice, so all ranks of a group always agree.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from etp.ep.backends import available_backends
from etp.ep.config import EPConfig

__all__ = ["profile", "choose", "cache_path", "cache_key"]

#: How many times ``profile`` ran in this process (tests read it).
PROFILE_RUNS = 0


def cache_path(cfg: EPConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("ETP_CACHE_DIR") or Path.home() / ".cache" / "etp"
    return Path(root) / "ep_backends.json"


def _device_name(group) -> str:
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def cache_key(cfg: EPConfig, group) -> str:
    fields = [_device_name(group), dist.get_world_size(group), cfg.max_tokens_per_rank, cfg.hidden_size, cfg.topk,
              cfg.num_experts, cfg.dtype]
    if cfg.ranks_per_host is not None:  # declared hosts: other backends are available
        fields.append(f"ranks_per_host={cfg.ranks_per_host}")
    return "|".join(str(v) for v in fields)


def _timer(device):
    if device.type == "cuda":
        def now():
            torch.cuda.synchronize(device)
            return time.perf_counter()
    else:
        now = time.perf_counter
    return now


def _max_over_ranks(seconds: float, group, device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def profile(cfg: EPConfig, group: Optional[dist.ProcessGroup] = None, *, iters: int = 5, warmup: int = 2,
            candidates: Optional[list[str]] = None, dispatcher_cls=None) -> tuple[str, str]:
    """Times dispatch and combine of every available backend; returns the fastest pair.

    The workload is ``max_tokens_per_rank`` tokens routed uniformly at random. Each time is
    the slowest rank's; collective over ``group`` (every rank must call it).

    Args:
        cfg: the layer's config (its ``backend`` is ignored).
        group: the expert-parallel group (default: the world).
        iters, warmup: timed and untimed repetitions per backend.
        candidates: backend names to try (default: all available here).
        dispatcher_cls: the dispatcher class to time (``etp.ep.profile`` passes
            ``ExpertDispatcher``; passed in because the dispatcher resolves ``backend="auto"``
            through this module, which therefore must not import it).

    Returns:
        ``(dispatch_backend, combine_backend)`` names.

    Example::

        dispatch_name, combine_name = ep.profile(cfg, group)
    """
    if dispatcher_cls is None:
        raise TypeError("profile() needs dispatcher_cls; call etp.ep.profile, which passes ExpertDispatcher")
    global PROFILE_RUNS
    PROFILE_RUNS += 1
    group = group or dist.group.WORLD
    names = candidates or available_backends(group, cfg.ranks_per_host)
    rank = dist.get_rank(group)
    best: dict[str, tuple[float, str]] = {}
    for name in names:
        disp = dispatcher_cls(replace(cfg, backend=name, validate=False), group, name=f"profile:{name}")
        gen = torch.Generator(device=disp.device).manual_seed(1234 + rank)
        T, K = cfg.max_tokens_per_rank, cfg.topk
        scores = torch.rand(T, cfg.num_experts, generator=gen, device=disp.device)
        topk_w, topk_idx = scores.topk(K, dim=1)
        x = torch.randn(T, cfg.hidden_size, generator=gen, device=disp.device).to(cfg.dtype)
        now = _timer(disp.device)
        times = {"dispatch": 0.0, "combine": 0.0}
        with torch.no_grad():
            for step in range(warmup + iters):
                dist.barrier(group=group)
                t0 = now()
                handle = disp.prepare(topk_idx)
                recv_x, _, _ = disp.dispatch(x, topk_w.to(cfg.weight_dtype), handle)
                t1 = now()
                disp.combine(recv_x, handle)
                t2 = now()
                if step >= warmup:
                    times["dispatch"] += t1 - t0
                    times["combine"] += t2 - t1
        disp.check()
        for op, seconds in times.items():
            seconds = _max_over_ranks(seconds / iters, group, disp.device)
            if op not in best or seconds < best[op][0]:
                best[op] = (seconds, name)
        del disp, recv_x, handle
    return best["dispatch"][1], best["combine"][1]


def choose(cfg: EPConfig, group: Optional[dist.ProcessGroup] = None, dispatcher_cls=None) -> tuple[str, str]:
    """The cached choice for this workload, profiling (and caching) on a miss."""
    group = group or dist.group.WORLD
    key, path = cache_key(cfg, group), cache_path(cfg)
    cached = [None]
    if dist.get_rank(group) == 0 and path.exists():
        cached[0] = json.loads(path.read_text()).get(key)
    dist.broadcast_object_list(cached, src=dist.get_global_rank(group, 0), group=group)
    if cached[0] is not None:
        return cached[0]["dispatch"], cached[0]["combine"]
    dispatch_name, combine_name = profile(cfg, group, dispatcher_cls=dispatcher_cls)
    if dist.get_rank(group) == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = json.loads(path.read_text()) if path.exists() else {}
        table[key] = {"dispatch": dispatch_name, "combine": combine_name}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
    return dispatch_name, combine_name
