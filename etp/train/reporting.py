"""What etp-train tells its user: how long each start-up phase took (``StartupClock``), a log
line every ``log_interval`` iterations (loss, learning rate, grad norm, ms/iter, TFLOP/s per
rank, MFU against the datasheet peak, peak memory, time since the run began and the estimated
time to its end; for MoE recipes the router losses and the most imbalanced layer's expert load,
[Note: MoE metrics]), the profiler's breakdown and the timeline at the end, and the JSON report
(``--json``).

Losses are read on the host at log intervals only: a read per iteration would empty the
device's queue before every forward ([Note: sync-free step]).
"""
from __future__ import annotations

import contextlib
import json
import math
import time

import torch

from etp.train.collector import CollectorPauses

__all__ = ["Reporter", "StartupClock", "format_duration", "fp8_eager_hint", "param_bits_sum",
           "steady_records"]

#: Elements per int64 partial sum in ``param_bits_sum`` (a 32 MiB int64 copy at most).
_BITS_CHUNK = 1 << 22


def _host_norm(norm) -> float | None:
    """The step's grad norm (a device tensor from the sync-free step, a float or None from
    megatron's own) as a float; raises on inf / nan, which megatron's bf16 step lets through."""
    if norm is None:
        return None
    value = float(norm.reshape(()).item()) if isinstance(norm, torch.Tensor) else float(norm)
    if not math.isfinite(value):
        raise FloatingPointError(f"the gradient norm is {value}: the step diverged (lower lr or clip_grad)")
    return value


def param_bits_sum(model) -> int:
    """Rank 0's parameters (of a module, or an iterable of parameters) as one integer: the sum of
    every element's bit pattern (int64, exact and order-free), so two runs whose parameters are
    equal bit for bit report the same number and nearly any difference changes it (tests compare
    captured with eager runs).

    Example::

        assert param_bits_sum(eager_model) == param_bits_sum(captured_model)
    """
    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    # Summed where the parameters live; one host read. ``sum(dtype=torch.int64)`` of a narrower
    # integer tensor casts the whole tensor to int64 first (8 bytes per element: the largest
    # parameter's copy would be the run's reported peak allocation), so each is summed in
    # chunks of ``_BITS_CHUNK`` elements, whose copies stay small.
    from torch.distributed.tensor import DTensor

    sums = []
    for param in model.parameters() if isinstance(model, torch.nn.Module) else model:
        # An FSDP's: this rank's shard (rank 0 reports alone; a DTensor op may be a collective).
        if isinstance(param, DTensor):
            param = param.to_local()
        bits = param.detach().contiguous().view(views[param.element_size()]).reshape(-1)
        sums.extend(chunk.sum(dtype=torch.int64) for chunk in bits.split(_BITS_CHUNK))
    return int(torch.stack(sums).sum()) if sums else 0


def fp8_eager_hint(recipe, device_type: str) -> str | None:
    """The line etp-train prints when quantized (FP8) gathers run in an eager step on CUDA and
    the recipe could be captured as it stands (``cuda_graph: step`` validates), else None: a
    GEMM of a quantized weight issues more launches than a bf16 one, and an eager step of a
    small-batch recipe is bound by its host's launches, which a captured step does not pay.

    Example::

        fp8_eager_hint(Recipe.from_yaml("recipes/moe_flagship.yaml", etp={"gather_dtype": "fp8_tensorwise"}), "cuda")
    """
    e = recipe.etp
    if (device_type != "cuda" or not e.gather_format.quantized or recipe.train.cuda_graph == "step"
            or (e.etp_size == 1 and e.expert_etp_size == 1)):
        return None
    try:
        recipe.replace(cuda_graph="step", overlap_grad_reduce=False)
    except ValueError:
        return None  # not capturable as it stands: no advice that would fail
    return (f"etp-train: {e.gather_dtype} gathers in an eager step: each GEMM of a quantized weight issues more "
            "launches than a bf16 one, and an eager step is bound by its host; the fast setting for them is the "
            "captured step: "
            "--set cuda_graph=step --set overlap_grad_reduce=false")


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (hours past 24 stay hours: a run's length reads at a glance).

    Example::

        format_duration(3725.4)   # '1:02:05'
    """
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class StartupClock:
    """Host seconds of a run's start-up phases, in order, from the moment the run began (what
    etp-train prints before its first iteration and after it, and the log line's elapsed time
    counts from).

    Example::

        clock = StartupClock()
        ...process groups...; clock.mark("process groups")
        with clock.timed("capture"):
            ...
        clock.line("set up in")   # 'set up in 1.2 s (process groups 0.4 s, capture 0.8 s)'
    """

    def __init__(self) -> None:
        self.began = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """``name`` took the time since the previous mark (or the clock's start)."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    @contextlib.contextmanager
    def timed(self, name: str):
        """``name`` takes the time of the ``with`` block (the next mark counts from its end)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._last = time.perf_counter()
            self.phases[name] = self.phases.get(name, 0.0) + self._last - began

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def line(self, what: str, names=None) -> str:
        """``what`` and the clock's elapsed seconds, then each phase of ``names`` (default: all)."""
        parts = [f"{name} {self.phases[name]:.1f} s" for name in (names or self.phases) if name in self.phases]
        return f"{what} {self.elapsed():.1f} s" + (f" ({', '.join(parts)})" if parts else "")


def steady_records(records: list[dict]) -> list[dict]:
    """The log windows a steady-state figure averages: all but the first (warm-up, compilation)
    and the profiled ones (the profiler's overhead)."""
    return [r for r in records[1:] if not r.get("profiled")] or records[1:] or records


class Reporter:
    """Log windows of one run: timing, log lines (rank 0) and the report's records.

    Args:
        recipe, rank, device: the run's.
        flops_per_iter: model FLOP per iteration per rank ([Note: FLOP count]).
        peak: the GPU's datasheet dense bf16 TFLOP/s (None: no MFU).
        stop: the iteration count the run ends at (the ETA's end; default ``train_iters``).
        clock: the run's ``StartupClock`` (elapsed time counts from its start; its first-step
            line is printed after the first iteration). None: a clock started here.
        schedule: the run's ``etp.train.schedule.OptimizerSchedule`` (the learning rate column).
        metrics: the run's ``etp.train.metrics.MetricsStream`` (None: no stream).
        moe: the run's ``etp.train.moe_metrics.MoEMetrics`` (None: a dense model): each window's
            router losses and expert load join its record and, short, its log line.

    Example::

        reporter = Reporter(recipe, rank, device, flops, peak, stop=100, clock=clock, schedule=schedule)
        reporter.start()
        ...per iteration: reporter.iteration_done(i, loss_tensor, norm, profiled)
    """

    def __init__(self, recipe, rank: int, device: torch.device, flops_per_iter: float, peak: float | None,
                 *, stop: int | None = None, clock: StartupClock | None = None, schedule=None,
                 metrics=None, moe=None) -> None:
        self.recipe, self.rank, self.device = recipe, rank, device
        self.metrics = metrics  # etp.train.metrics.MetricsStream: [Note: the metrics stream]
        self.moe = moe  # etp.train.moe_metrics.MoEMetrics: [Note: MoE metrics]
        self.flops_per_iter, self.peak = flops_per_iter, peak
        self.stop = recipe.train.train_iters if stop is None else stop
        self.clock = clock or StartupClock()
        self.schedule = schedule
        self._first_step_done = False
        self.losses: list[float] = []
        self.records: list[dict] = []
        self._pending: list[torch.Tensor] = []
        self._window_began = time.perf_counter()
        self._window_iterations = 0
        self._window_profiled = False
        self._excluded = 0.0  # seconds of this window spent outside training (checkpoint saves, validation)
        self.evaluations: list[dict] = []  # validation and test losses (etp.train.evaluation)
        self.pauses = CollectorPauses()  # [Note: collector pauses]

    def start(self) -> None:
        self._window_began = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Keeps ``seconds`` (a save) out of the window's step time."""
        self._excluded += seconds

    def iteration_done(self, iteration: int, loss: torch.Tensor, norm, profiled: bool, last: bool,
                       timeline=None) -> None:
        """Records iteration ``iteration`` (0-based); closes the log window when it is due."""
        self._pending.append(loss)
        self._window_iterations += 1
        self._window_profiled |= profiled
        if not self._first_step_done:
            self._first_step(iteration)
        if (iteration + 1) % self.recipe.train.log_interval and not last:
            return
        self.losses += torch.stack(self._pending).flatten().tolist()
        self._pending.clear()
        norm = _host_norm(norm)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if timeline is not None:
            timeline.window_done(self._window_iterations)
        elapsed = (time.perf_counter() - self._window_began - self._excluded) / self._window_iterations
        tflops = self.flops_per_iter / elapsed / 1e12
        mfu = tflops / self.peak if self.peak else None
        lr = None if self.schedule is None else self.schedule.stepped_lr
        run_s = self.clock.elapsed()
        eta_s = max(0, self.stop - iteration - 1) * elapsed
        moe = {} if self.moe is None else self.moe.window(self._window_iterations)  # every rank: an all-reduce
        self.records.append({"iteration": iteration + 1, "loss": self.losses[-1], "lr": lr, "grad_norm": norm,
                             "ms_per_iter": elapsed * 1e3, "tflops_per_rank": tflops, "mfu": mfu,
                             "profiled": self._window_profiled, "elapsed_s": run_s, "eta_s": eta_s,
                             # this rank's; gather_collector_pauses adds the slowest rank's
                             "gc_ms_per_iter": self.pauses.take() / self._window_iterations, **moe})
        if self.metrics is not None:
            tokens = (self.recipe.train.global_batch_size or 0) * self.recipe.model.seq_length
            cuda = self.device.type == "cuda"
            self.metrics.log({**self.records[-1], "tokens_per_s": tokens / elapsed,
                              "memory_allocated_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None,
                              "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None})
        if self.rank == 0:
            line = self.log_line(iteration + 1, self.losses[-1], lr, norm, elapsed, tflops, mfu, run_s, eta_s)
            print(line + (f" | {self.moe.line(moe)}" if moe else ""), flush=True)
        self._window_began, self._window_iterations = time.perf_counter(), 0
        self._window_profiled, self._excluded = False, 0.0

    def evaluation_done(self, split: str, iteration: int, loss: float, seconds: float) -> None:
        """Records (and rank 0 prints) a validation or test loss after ``iteration`` iterations; its
        ``seconds`` stay out of the log window's step time."""
        from etp.train.evaluation import perplexity

        self.exclude(seconds)
        record = {"split": split, "iteration": iteration, "loss": loss, "ppl": perplexity(loss), "seconds": seconds}
        self.evaluations.append(record)
        if self.metrics is not None:
            name = "validation" if split == "valid" else split
            self.metrics.log({"iteration": iteration, f"{name}_loss": loss, f"{name}_ppl": record["ppl"]})
        if self.rank == 0:
            name = "validation" if split == "valid" else split
            print(f"{name} loss at iteration {iteration} | lm loss {loss:.4f} | lm loss PPL {record['ppl']:.3f} | "
                  f"{seconds * 1e3:.0f} ms", flush=True)

    def gather_collector_pauses(self, group=None) -> float | None:
        """Adds ``gc_ms_per_iter_max_rank`` (the slowest rank's collection time per iteration)
        to every log window; every rank calls it. Returns its steady-window mean."""
        import torch.distributed as dist

        mine = [r["gc_ms_per_iter"] for r in self.records]
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        for index, record in enumerate(self.records):
            record["gc_ms_per_iter_max_rank"] = max(ms[index] for ms in everyone)
        steady = [r["gc_ms_per_iter_max_rank"] for r in steady_records(self.records)]
        return sum(steady) / len(steady) if steady else None

    def _first_step(self, iteration: int) -> None:
        """Rank 0's line after the run's first iteration: its seconds (the device done, read
        once), the capture's among them; every rank waits for its device alike."""
        self._first_step_done = True
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.clock.mark("first step")
        if self.rank == 0:
            print(f"etp-train: {self.clock.line(f'iteration {iteration + 1} done at', ('capture', 'first step'))}",
                  flush=True)

    def log_line(self, done: int, loss: float, lr: float | None, norm: float | None, seconds_per_iter: float,
                 tflops: float, mfu: float | None, elapsed_s: float, eta_s: float) -> str:
        """One log window's line (rank 0 prints it).

        Example::

            reporter.log_line(25, 5.43, 3e-3, 1.2, 0.05, 0.1, None, 12.0, 160.0)
            # 'iter    25/300 | loss 5.4300 | lr 3.000e-03 | grad norm 1.200 | ... | elapsed 0:00:12 | ETA 0:02:40'
        """
        memory = (f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if self.device.type == "cuda"
                  else "n/a (CPU)")
        return (f"iter {done:5d}/{self.recipe.train.train_iters} | loss {loss:.4f} | "
                f"lr {'n/a' if lr is None else f'{lr:.3e}'} | "
                f"grad norm {'n/a' if norm is None else f'{norm:.3f}'} | {seconds_per_iter * 1e3:8.1f} ms/iter | "
                f"{tflops:7.3f} TFLOP/s/rank | MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
                f"peak {memory} | elapsed {format_duration(elapsed_s)} | ETA {format_duration(eta_s)}")

    def write_json(self, path: str, world: int, backend: str, summary, extra: dict) -> None:
        """The run's report: recipe, layout, losses, every log window, the steady-state means
        (``steady_records``: none when the run did no iteration), memory and provenance."""
        from etp.provenance import run_provenance

        recipe, steady = self.recipe, steady_records(self.records)

        def mean(key):
            values = [r[key] for r in steady if r[key] is not None]
            return sum(values) / len(values) if values else None

        cuda = self.device.type == "cuda"
        report = {
            "recipe": str(recipe.source), "world_size": world, "backend": backend, "etp": vars(recipe.etp),
            "params": recipe.num_params(), "active_params": recipe.num_params(active=True),
            "param_bytes_per_rank": {"before_etp": summary.bytes_before, "after_etp": summary.bytes_after},
            "losses": self.losses, "log": self.records,
            "validation": [r for r in self.evaluations if r["split"] == "valid"],
            "test": next((r for r in self.evaluations if r["split"] == "test"), None),
            "steady_iterations": [r["iteration"] for r in steady],
            "ms_per_iter": mean("ms_per_iter"), "tflops_per_rank": mean("tflops_per_rank"), "mfu": mean("mfu"),
            "flops_convention": "6 x GEMM weights per token + 12 x layers x heads x kv_channels x seq (full square)",
            "mfu_peak": "datasheet dense bf16 TFLOP/s of the GPU (peak_tflops)",
            **extra,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
            "provenance": run_provenance(),
        }
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"etp-train: wrote {path}", flush=True)
