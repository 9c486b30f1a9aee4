"""``profile``: time every available backend on the layer's workload; cache the fastest.

The cache is one JSON file (``<cache_dir>/ep_backends.json``) keyed by
``(device name, world size, T, H, K, E, dtype)``; rank 0 reads and writes it and broadcasts
the choice, so all ranks of a group always agree.

[Note: one choice for every EP group]
Where several expert-parallel groups coexist (EP 2 x expert ETP 2 at world 4: groups {0, 1}
and {2, 3}), each choosing on its own can end with different backends in different groups:
their measurements differ, or one group reads the cache after another wrote it. That is
more than a performance difference. torch's symmetric-memory rendezvous numbers its store
exchanges with one counter per process, across all groups, so when ranks have made
different numbers of rendezvous (a different backend allocates different buffers; a group
that profiled made many more), the next rendezvous over a group crossing them (the expert
ETP group {0, 2}) waits for keys its peer never writes: a silent hang at set-up. With
``agree_group`` (a group holding every EP group, all of whose ranks build the same
dispatchers: the world for megatron without pipeline parallelism) one rank of it reads the
cache for all, every group's times are merged (the slowest of each move) before choosing,
and only that rank writes the file.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from etp.ep.backends import available_backends
from etp.ep.config import EPConfig

__all__ = ["profile", "choose", "cache_path", "cache_key", "pick_fastest"]

log = logging.getLogger(__name__)

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


def _time_moves(disp, cfg, group, iters, warmup) -> dict:
    """Seconds per move of one dispatcher (the slowest rank's mean): ``dispatch`` (with
    ``prepare``) and ``combine_backward`` run on its dispatch backend, ``combine`` and
    ``dispatch_backward`` (with the routing weights') on its combine backend."""
    rank = dist.get_rank(group)
    gen = torch.Generator(device=disp.device).manual_seed(1234 + rank)
    T, K = cfg.max_tokens_per_rank, cfg.topk
    scores = torch.rand(T, cfg.num_experts, generator=gen, device=disp.device)
    topk_w, topk_idx = scores.topk(K, dim=1)
    x = torch.randn(T, cfg.hidden_size, generator=gen, device=disp.device).to(cfg.dtype)
    now = _timer(disp.device)
    times = dict.fromkeys(("dispatch", "combine", "dispatch_backward", "combine_backward"), 0.0)
    with torch.no_grad():
        for step in range(warmup + iters):
            dist.barrier(group=group)
            stamps = [now()]
            handle = disp.prepare(topk_idx)
            recv_x, recv_w, _ = disp.dispatch(x, topk_w.to(cfg.weight_dtype), handle)
            stamps.append(now())
            disp.combine(recv_x, handle)
            stamps.append(now())
            disp.dispatch_backward(recv_x, recv_w, handle)
            stamps.append(now())
            disp.combine_backward(x, handle)
            stamps.append(now())
            if step >= warmup:
                for key, t0, t1 in zip(times, stamps, stamps[1:]):
                    times[key] += t1 - t0
    disp.check()
    return {key: _max_over_ranks(seconds / iters, group, disp.device) for key, seconds in times.items()}


#: How each side is scored: its forward move plus the backward move that runs on it.
_SCORE = {"dispatch": lambda t: t["dispatch"] + t["combine_backward"],
          "combine": lambda t: t["combine"] + t["dispatch_backward"]}


def pick_fastest(times: dict) -> dict:
    """``{"dispatch": name, "combine": name}``: the fastest of ``times`` (name -> move -> time)."""
    return {side: min(times, key=lambda n: fn(times[n])) for side, fn in _SCORE.items()}


def profile(cfg: EPConfig, group: Optional[dist.ProcessGroup] = None, *, iters: int = 5, warmup: int = 2,
            candidates: Optional[list[str]] = None, dispatcher_cls=None, report: Optional[dict] = None
            ) -> tuple[str, str]:
    """Times the moves of every available backend; returns the fastest for each side.

    The workload is ``max_tokens_per_rank`` tokens routed uniformly at random. A dispatch
    backend is scored by its forward dispatch (with ``prepare``) plus the dispatch that
    combine's backward runs on it; a combine backend by its forward combine plus the combines
    of dispatch's backward. The two are chosen separately (a dispatcher may mix them). Each
    time is the slowest rank's; collective over ``group`` (every rank must call it).

    Args:
        cfg: the layer's config (its ``backend`` is ignored).
        group: the expert-parallel group (default: the world).
        iters, warmup: timed and untimed repetitions per backend.
        candidates: backend names to try (default: all available here).
        dispatcher_cls: the dispatcher class to time (``etp.ep.profile`` passes
            ``ExpertDispatcher``; passed in because the dispatcher resolves ``backend="auto"``
            through this module, which therefore must not import it).
        report: if given, filled with the choice and every backend's times in ms
            (``{"dispatch": name, "combine": name, "ms": {backend: {move: ms}}}``).

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
    measured = {}
    for name in names:
        # capturable=False: every candidate is timed, eager; the capturable choice is made from the times
        disp = dispatcher_cls(replace(cfg, backend=name, validate=False, capturable=False), group,
                              name=f"profile:{name}")
        measured[name] = _time_moves(disp, cfg, group, iters, warmup)
        del disp
    chosen = pick_fastest(measured)
    if report is not None:
        report.update(chosen, ms={n: {k: round(v * 1e3, 4) for k, v in t.items()} for n, t in measured.items()})
    return chosen["dispatch"], chosen["combine"]


def choose(cfg: EPConfig, group: Optional[dist.ProcessGroup] = None, dispatcher_cls=None,
           agree_group: Optional[dist.ProcessGroup] = None) -> dict:
    """The cached choice for this workload, profiling (and caching) on a miss: the cache
    entry, ``{"dispatch": name, "combine": name, "ms": {...}, "source": "cache" | "profiled"}``
    (``ms``: every candidate's times, see ``profile``). Logged once per process and key.

    ``agree_group``: a group containing ``group`` whose ranks all call ``choose`` together
    (each with its own EP group): every EP group then gets the same choice and one rank
    reads and writes the cache. See [Note: one choice for every EP group]."""
    group = group or dist.group.WORLD
    lead = agree_group if agree_group is not None else group
    key, path = cache_key(cfg, group), cache_path(cfg)
    cached = [None]
    if dist.get_rank(lead) == 0:
        cached[0] = _read_cache(path).get(key)
    dist.broadcast_object_list(cached, src=dist.get_global_rank(lead, 0), group=lead)
    if cached[0] is not None:
        return _log_choice(key, {**cached[0], "source": "cache"}, lead)
    entry: dict = {}
    profile(cfg, group, dispatcher_cls=dispatcher_cls, report=entry)
    if agree_group is not None:
        entry = _merge_reports(entry, agree_group)
    if dist.get_rank(lead) == 0:
        _write_cache(path, key, entry)
    return _log_choice(key, {**entry, "source": "profiled"}, lead)


def _merge_reports(entry: dict, agree_group) -> dict:
    """Every group's report merged over ``agree_group``: each backend's move times the
    slowest group's, and the choice made again from those (identical on every rank)."""
    everyone: list = [None] * dist.get_world_size(agree_group)
    dist.all_gather_object(everyone, entry["ms"], group=agree_group)
    names = [n for n in everyone[0] if all(n in ms for ms in everyone)]
    if not names:
        raise RuntimeError(f"the expert-parallel groups share no EP backend to choose from: {everyone}")
    ms = {n: {move: max(ms[n][move] for ms in everyone) for move in everyone[0][n]} for n in names}
    return {**pick_fastest(ms), "ms": ms}


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError:  # torn or hand-edited: profile again (and rewrite it)
        log.warning("etp.ep: ignoring the unreadable backend cache %s", path)
        return {}


def _write_cache(path: Path, key: str, entry: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = _read_cache(path)
    table[key] = entry
    # A name of this process's own: two writers (two runs sharing a cache, or EP groups
    # without an agree_group) must not rename each other's half-written file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    tmp.replace(path)


_LOGGED: set = set()


def _log_choice(key: str, entry: dict, group) -> dict:
    if dist.get_rank(group) == 0 and key not in _LOGGED:
        _LOGGED.add(key)
        ms = entry.get("ms", {})
        detail = ", ".join(f"{n} {t.get('dispatch', 0):.3f} / {t.get('combine', 0):.3f} ms" for n, t in ms.items())
        log.info("etp.ep backend auto (%s, %s): dispatch %s, combine %s%s", key, entry["source"], entry["dispatch"],
                 entry["combine"], f" (dispatch / combine: {detail})" if detail else "")
    return entry
