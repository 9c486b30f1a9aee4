"""What etp-train tells its user: a log line every ``log_interval`` iterations (loss, grad
norm, ms/iter, TFLOP/s per rank, MFU against the datasheet peak, peak memory), the profiler's
breakdown and the timeline at the end, and the JSON report (``--json``).

Losses are read on the host at log intervals only: a read per iteration would empty the
device's queue before every forward ([Note: sync-free step]).
"""
from __future__ import annotations

import json
import math
import time

import torch

from etp.train.collector import CollectorPauses

__all__ = ["Reporter", "fp8_eager_hint", "param_bits_sum", "steady_records"]

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
    """The line etp-train prints when FP8 gathers run in an eager step on CUDA and the recipe
    could be captured as it stands (``cuda_graph: step`` validates), else None: an FP8 GEMM
    issues more launches than a bf16 one, and an eager step of a small-batch recipe is bound
    by its host's launches, which a captured step does not pay.

    Example::

        fp8_eager_hint(Recipe.from_yaml("recipes/moe_flagship.yaml", etp={"gather_dtype": "fp8_tensorwise"}), "cuda")
    """
    e = recipe.etp
    if (device_type != "cuda" or not e.gather_dtype.startswith("fp8") or recipe.train.cuda_graph == "step"
            or (e.etp_size == 1 and e.expert_etp_size == 1)):
        return None
    try:
        recipe.replace(cuda_graph="step", overlap_grad_reduce=False)
    except ValueError:
        return None  # not capturable as it stands: no advice that would fail
    return (f"etp-train: {e.gather_dtype} gathers in an eager step: each FP8 GEMM issues more launches than a "
            "bf16 one, and an eager step is bound by its host; the fast FP8 setting is the captured step: "
            "--set cuda_graph=step --set overlap_grad_reduce=false")


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

    Example::

        reporter = Reporter(recipe, rank, device, flops, peak)
        reporter.start()
        ...per iteration: reporter.iteration_done(i, loss_tensor, norm, profiled)
    """

    def __init__(self, recipe, rank: int, device: torch.device, flops_per_iter: float, peak: float | None) -> None:
        self.recipe, self.rank, self.device = recipe, rank, device
        self.flops_per_iter, self.peak = flops_per_iter, peak
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
        self.records.append({"iteration": iteration + 1, "loss": self.losses[-1], "grad_norm": norm,
                             "ms_per_iter": elapsed * 1e3, "tflops_per_rank": tflops, "mfu": mfu,
                             "profiled": self._window_profiled,
                             # this rank's; gather_collector_pauses adds the slowest rank's
                             "gc_ms_per_iter": self.pauses.take() / self._window_iterations})
        self._print(iteration + 1, norm, elapsed, tflops, mfu)
        self._window_began, self._window_iterations = time.perf_counter(), 0
        self._window_profiled, self._excluded = False, 0.0

    def evaluation_done(self, split: str, iteration: int, loss: float, seconds: float) -> None:
        """Records (and rank 0 prints) a validation or test loss after ``iteration`` iterations; its
        ``seconds`` stay out of the log window's step time."""
        from etp.train.evaluation import perplexity

        self.exclude(seconds)
        record = {"split": split, "iteration": iteration, "loss": loss, "ppl": perplexity(loss), "seconds": seconds}
        self.evaluations.append(record)
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

    def _print(self, done: int, norm, elapsed: float, tflops: float, mfu) -> None:
        if self.rank != 0:
            return
        memory = (f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if self.device.type == "cuda"
                  else "n/a (CPU)")
        print(f"iter {done:5d}/{self.recipe.train.train_iters} | loss {self.losses[-1]:.4f} | "
              f"grad norm {'n/a' if norm is None else f'{norm:.3f}'} | {elapsed * 1e3:8.1f} ms/iter | "
              f"{tflops:7.3f} TFLOP/s/rank | MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
              f"peak {memory}", flush=True)

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
