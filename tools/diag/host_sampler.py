"""Where a running program's main thread spends its wall time, by sampling its Python stack.

cProfile and the torch profiler both tax every call, which shifts a host-bound step's balance
(a Python-heavy path looks slower, a launch-heavy one faster). This samples instead: a thread
reads the main thread's stack every ``--interval-ms`` and counts, per sample,

* ``self``: the innermost Python line (a torch op, a Triton launch or a blocking CUDA call
  shows as the line that called it: torch's bindings release the GIL while they run);
* ``inclusive``: every function on the stack, once per sample;
* ``first_etp`` / ``first_megatron``: the innermost frame inside ``etp/`` / ``megatron/``.

While the main thread waits in ``loss.backward()``, the backward runs on autograd's device
thread: the sample then counts that thread's stack (the Python of custom Functions'
backward), or ``(autograd engine: C++ nodes)`` when it runs none.

Only a window is sampled, so start-up and the first iterations' compilation stay out: either
``--after-s`` seconds after start, for ``--for-s``, or (``--iterations A:B``, for ``etp-train``)
while the local ``iteration`` of ``etp/train/loop.py``'s ``train`` is in ``[A, B)``. Each rank writes ``host_samples_rank{R}.json``
(rank from ``RANK``) with the counts as milliseconds of wall time.

With ``--iterations``, the samples are also kept per iteration (``first_etp`` and
``first_megatron`` keys): ``slow_minus_fast`` lists the places that took more samples in
the slowest third of the sampled iterations than in the fastest third (per iteration), which
says whether a slow iteration spends its extra time in one place or spreads it everywhere (a
slower host).

    torchrun --standalone --nproc-per-node 2 tools/diag/host_sampler.py --out /tmp/hs --iterations 10:30 \\
        -m etp.train --recipe recipes/moe_flagship.yaml --set world_size=2 ...
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import threading
import time

_DEPTH = 64
# Where etp-train's ``train`` (whose local ``iteration`` gates --iterations) lives; a test's
# stand-in is a main.py.
TRAIN_FILES = ("etp/train/loop.py", "etp/train/main.py")
_ENGINE_CPP = "(autograd engine: C++ nodes)"


def _where(code, line: int) -> str:
    path = code.co_filename
    for marker in ("site-packages/", "/tmp/site/", os.getcwd() + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{line}({code.co_name})"


class Sampler(threading.Thread):
    def __init__(self, target_ident: int, interval_s: float, after_s: float, for_s: float,
                 iterations: tuple[int, int] | None = None):
        super().__init__(daemon=True, name="host-sampler")
        self.target, self.interval, self.after, self.span = target_ident, interval_s, after_s, for_s
        self.iterations = iterations
        self.self_counts: collections.Counter = collections.Counter()
        self.inclusive: collections.Counter = collections.Counter()
        self.first_etp: collections.Counter = collections.Counter()
        self.first_megatron: collections.Counter = collections.Counter()
        self.samples = 0
        self.current = None  # the iteration read at the last gate check
        self.per_iteration: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.window = (0.0, 0.0)
        self.done = threading.Event()

    def _iteration(self) -> int | None:
        """The sampled thread's training iteration (``train``'s local), None outside the loop."""
        frame = sys._current_frames().get(self.target)
        while frame is not None:
            if frame.f_code.co_name == "train" and frame.f_code.co_filename.endswith(TRAIN_FILES):
                return frame.f_locals.get("iteration")
            frame = frame.f_back
        return None

    def _inside(self, now: float, end: float) -> bool:
        if self.iterations is None:
            return now < end
        iteration = self.current = self._iteration()
        return iteration is not None and self.iterations[0] <= iteration < self.iterations[1]

    def run(self) -> None:
        if self.iterations is None:
            time.sleep(self.after)
        else:
            while (iteration := self._iteration()) is None or iteration < self.iterations[0]:
                time.sleep(0.01)
        begin = time.perf_counter()
        end = begin + self.span
        tick = begin
        checked = 0
        while True:
            now = time.perf_counter()
            if now - checked > 0.01 or self.iterations is None:  # the gate is read 100 times a second
                checked = now
                if not self._inside(now, end):
                    break
            frame = self._active_frame()
            if frame is None:
                break
            self._count(frame)
            tick += self.interval
            time.sleep(max(0.0, tick - time.perf_counter()))
        self.window = (begin, time.perf_counter())
        self.done.set()

    def _active_frame(self):
        """The main thread's frame, or, while it waits for autograd's backward, that of the
        thread running the backward (a pseudo-frame key when it runs only C++ nodes)."""
        frames = sys._current_frames()
        main = frames.get(self.target)
        if main is None or main.f_code.co_name != "_engine_run_backward":
            return main
        for ident, frame in frames.items():
            if ident in (self.target, self.ident):
                continue
            outer = frame
            while outer.f_back is not None:
                outer = outer.f_back
            if "torch/autograd/" in outer.f_code.co_filename:
                return frame
        return _ENGINE_CPP

    def _count(self, frame) -> None:
        if frame is _ENGINE_CPP:
            self.samples += 1
            for table in (self.self_counts, self.inclusive, self.first_etp, self.first_megatron):
                table[_ENGINE_CPP] += 1
            return
        self.samples += 1
        self.self_counts[_where(frame.f_code, frame.f_lineno)] += 1
        seen, etp, meg = set(), None, None
        depth = 0
        while frame is not None and depth < _DEPTH:
            code = frame.f_code
            key = _where(code, code.co_firstlineno)
            if key not in seen:
                seen.add(key)
                self.inclusive[key] += 1
            path = code.co_filename
            if etp is None and "/etp/" in path:
                etp = _where(code, frame.f_lineno)
            if meg is None and "/megatron/" in path:
                meg = _where(code, frame.f_lineno)
            frame, depth = frame.f_back, depth + 1
        self.first_etp[etp or "(no etp frame)"] += 1
        self.first_megatron[meg or "(no megatron frame)"] += 1
        if self.current is not None:
            per = self.per_iteration[self.current]
            per[" ".join(filter(None, (meg, etp))) or "(neither)"] += 1
            per[None] += 1  # the iteration's total

    def report(self, top: int) -> dict:
        # Each sample stands for the wall time between samples, which the GIL can stretch past
        # the nominal interval: the window's length over the samples taken.
        ms = 1e3 * (self.window[1] - self.window[0]) / max(1, self.samples)

        def table(counter):
            return [{"where": k, "ms": round(v * ms, 2), "samples": v} for k, v in counter.most_common(top)]

        return {"samples": self.samples, "iterations": self.iterations, "interval_ms": 1e3 * self.interval, "ms_per_sample": ms, "window_s": round(self.window[1] - self.window[0], 3),
                "self": table(self.self_counts), "inclusive": table(self.inclusive),
                "first_etp": table(self.first_etp), "first_megatron": table(self.first_megatron),
                **slow_minus_fast(self.per_iteration, ms, top)}


def slow_minus_fast(per_iteration: dict, ms: float, top: int) -> dict:
    """Per sampled iteration its ms; and per place (first megatron and etp frames) its ms per
    iteration in the slowest third of the iterations minus that in the fastest third, largest first."""
    # The first and last iterations of the window are cut by the gate: only whole ones count.
    whole = sorted(per_iteration)[1:-1]
    if len(whole) < 3:
        return {"per_iteration_ms": {}, "slow_minus_fast": []}
    ranked = sorted(whole, key=lambda i: per_iteration[i][None])
    third = max(1, len(ranked) // 3)
    fast, slow = ranked[:third], ranked[-third:]
    places = {k for i in whole for k in per_iteration[i] if k is not None}

    def mean(its, key):
        return sum(per_iteration[i][key] for i in its) / len(its) * ms

    diff = sorted(((mean(slow, k) - mean(fast, k), k) for k in places), reverse=True)
    return {"per_iteration_ms": {i: round(per_iteration[i][None] * ms, 1) for i in whole},
            "slow_minus_fast": [{"where": k, "ms": round(d, 2), "fast_ms": round(mean(fast, k), 2)}
                                for d, k in diff[:top]]}


def provenance_module():
    """This checkout's ``etp/provenance.py`` (standard library only), loaded by its path: the
    program sampled may import its own ``etp`` package (a test's stand-in), so this tool must
    neither import ``etp`` first (the program would get this one) nor after it."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "etp",
                        "provenance.py")
    spec = importlib.util.spec_from_file_location("_etp_provenance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for host_samples_rank{R}.json")
    parser.add_argument("--interval-ms", type=float, default=1.0)
    parser.add_argument("--after-s", type=float, default=20.0, help="start sampling this long after start")
    parser.add_argument("--for-s", type=float, default=8.0, help="sample this long")
    parser.add_argument("--iterations", help="A:B, etp-train only: sample while the training iteration is "
                        "in [A, B) (instead of --after-s / --for-s)")
    parser.add_argument("--top", type=int, default=80)
    parser.add_argument("-m", dest="module", required=True, help="the module to run, then its arguments")
    launched = list(sys.argv)
    args, rest = parser.parse_known_args()
    if args.interval_ms <= 0 or args.for_s <= 0 or args.after_s < 0:
        raise ValueError(f"--interval-ms {args.interval_ms}, --after-s {args.after_s}, --for-s {args.for_s}: "
                         "the interval and the window must be positive, the delay not negative")
    iterations = None
    if args.iterations:
        try:
            iterations = tuple(int(v) for v in args.iterations.split(":"))
            assert len(iterations) == 2 and 0 <= iterations[0] < iterations[1]
        except (ValueError, AssertionError):
            raise ValueError(f"--iterations {args.iterations!r}: expected A:B with 0 <= A < B, e.g. 10:30") from None
    os.makedirs(args.out, exist_ok=True)
    provenance = provenance_module().run_provenance
    sys.setswitchinterval(min(sys.getswitchinterval(), args.interval_ms / 2e3))  # the sampler gets its turns
    sampler = Sampler(threading.get_ident(), args.interval_ms / 1e3, args.after_s, args.for_s, iterations)
    sampler.start()
    sys.argv = [args.module] + rest
    sys.path.insert(0, os.getcwd())  # as ``python -m`` does (sys.path[0] is this script's folder)
    try:
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    finally:
        rank = os.environ.get("RANK", "0")
        if not sampler.done.is_set():
            print(f"host_sampler: rank {rank}: the program ended before the window closed "
                  f"({sampler.samples} samples)", file=sys.stderr)
        path = os.path.join(args.out, f"host_samples_rank{rank}.json")
        with open(path, "w") as f:
            json.dump({"provenance": provenance(launched), **sampler.report(args.top)}, f, indent=1)
        print(f"host_sampler: rank {rank}: {sampler.samples} samples -> {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
