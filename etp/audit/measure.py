"""MemoryAudit: measured per-rank memory of a training run, by phase and by category.

[Note: ETP runtime memory audit]
The runtime half of the memory audit (the prediction is ``etp.audit.predict_memory``, see
[Note: ETP memory prediction]). Two kinds of numbers, on the audited device only:

* Phase peaks (CUDA only): around each ``with audit.phase(name)`` the allocator's peak
  counters are reset and read back, giving ``peak_allocated`` / ``peak_reserved`` of the
  phase, and ``retained``: bytes allocated at the phase end minus at its start, less the
  growth of the byte categories below during the phase. For ``forward`` that is the
  activations kept for backward (plus the loss), the measured counterpart of the predicted
  ``activations``. ``retained`` skips the first iteration once ``step_done()`` has marked a
  later one: the first also allocates one-time buffers (a cuBLAS workspace per thread, in the
  first forward and the first backward). Other devices report
  None: no number rather than a made-up one.
* Byte categories, taken from tensors at each phase end (any device, so CPU tests see
  them): ``params``; ``main_grad`` (``param.main_grad`` if present, else ``param.grad``);
  ``optimizer`` (state tensors, plus fp32 master copies of megatron-core's mixed-precision
  and distributed optimizers, which are the inner optimizer's parameters); the ETP runtime's
  ``gather_fwd`` / ``gather_bwd`` / ``gather_recompute`` / ``wgrad_pool``; ``fp8_shards`` (the quantized copies of the
  shards a quantized gather format keeps, FP8's; their few bytes of scales are left out, as in
  the prediction).

Every storage counts once, by address: views of one buffer (megatron-core DDP's grad and
param buffers) count the whole buffer once, and optimizer entries that are model parameters
(fp32 params megatron steps in place, views of the param buffer) count under ``params``
only. A phase that runs every iteration keeps its maximum over iterations; the report's
``bytes`` is the high-water mark of each category over all phase ends and the report call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .categories import CATEGORIES

__all__ = ["SCHEMA_VERSION", "MemoryAudit"]

#: Bumped whenever a key of ``MemoryAudit.report()`` changes meaning or goes away.
SCHEMA_VERSION = 1

# megatron-core keeps the fp32 master copies of bf16/fp16 params here (Float16Optimizer /
# DistributedOptimizer); they are also the inner optimizer's params, listed for safety.
_MAIN_PARAM_GROUPS = ("fp32_from_float16_groups", "shard_fp32_from_float16_groups")



class _Storages:
    """Byte total of distinct storages on one device; a storage seen twice counts once."""

    def __init__(self, device: torch.device, exclude: Iterable = ()) -> None:
        self.device = device
        self.seen = set(exclude)
        self.nbytes = 0

    def add(self, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor) or not _same_device(tensor.device, self.device):
            return
        try:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without a storage
            key, size = 0, tensor.numel() * tensor.element_size()
        if key == 0:  # empty tensors share address 0: count each by identity
            key = ("id", id(tensor))
        if key not in self.seen:
            self.seen.add(key)
            self.nbytes += size


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Tensors inside an optimizer state entry (dicts / lists / tuples of tensors)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """State tensors and parameters of a torch optimizer or a megatron-core optimizer
    (``ChainedOptimizer`` recursed; a ``MegatronOptimizer`` wraps a torch one as ``.optimizer``)."""
    if optimizer is None:
        return
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:  # ChainedOptimizer.optimizer asserts a single member: never read it
        for member in chained:
            yield from _optimizer_tensors(member)
        return
    inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else getattr(optimizer, "optimizer", None)
    if inner is not None:
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from _tensors_in(state)
    for attr in _MAIN_PARAM_GROUPS:
        for group in getattr(optimizer, attr, None) or ():
            yield from (t for t in group if t is not None)


def _check_optimizer(optimizer: Any) -> None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    if hasattr(optimizer, "chained_optimizers") or hasattr(optimizer, "optimizer"):
        return
    raise TypeError(
        f"optimizer={type(optimizer).__name__}: expected a torch.optim.Optimizer or a "
        "megatron-core optimizer (MegatronOptimizer / ChainedOptimizer), or None"
    )


def _fmt_bytes(value: float | None) -> str:
    if value is None:
        return "n/a"
    sign, size = ("-" if value < 0 else ""), abs(value)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{sign}{size / scale:.2f} {unit}"
    return f"{sign}{int(size)} B"


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass
class _PhaseRecord:
    """What one phase name measured, each number the maximum over its calls (``retained``:
    over the calls after the first iteration, when there are any)."""

    calls: int = 0
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    retained: int | None = None
    bytes: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class _OpenPhase:
    name: str
    peak_allocated: int = 0
    peak_reserved: int = 0
    allocated_start: int = 0
    tensor_bytes_start: int = 0


class MemoryAudit:
    """Measures one rank's memory during training: per-phase CUDA peaks and the byte totals
    of params, main grads, optimizer state and the ETP runtime's buffers.
    See [Note: ETP runtime memory audit] in etp/audit/measure.py.

    Args:
        model: the (wrapped) model, or a list of model chunks (virtual pipeline stages).
        optimizer: optional torch optimizer or megatron-core optimizer whose state to count.
        device: the device to audit; None takes the first parameter's (CPU without params).
            Phase peaks are measured on CUDA devices only and reported as None elsewhere.

    Raises:
        TypeError: ``optimizer`` is neither a torch nor a megatron-core optimizer.
        ValueError: ``device`` is a CUDA device but CUDA is not available.

    Example::

        from etp.audit import MemoryAudit, predict_memory

        audit = MemoryAudit(model, optimizer)
        for batch in batches:
            with audit.phase("forward"):
                loss = model(batch).mean()
            with audit.phase("backward"):
                loss.backward()
                etp.finalize_grads(model, config, groups)
            with audit.phase("optimizer"):
                optimizer.step()
            audit.step_done()
        print(audit.format_table(predict_memory(recipe, world)))
        audit.write_json(f"audit.rank{rank}.json")
    """

    def __init__(self, model: nn.Module | Iterable[nn.Module], optimizer: Any = None,
                 device: torch.device | str | None = None) -> None:
        self.modules = [model] if isinstance(model, nn.Module) else list(model)
        bad = [type(m).__name__ for m in self.modules if not isinstance(m, nn.Module)]
        if bad:
            raise TypeError(f"model: expected an nn.Module or a list of them, got {bad}")
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        if device is None:
            first = next((p for m in self.modules for p in m.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={str(self.device)!r}: CUDA is not available; pass "
                                 "device='cpu' or None")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.iterations = 0
        self.phases: dict[str, _PhaseRecord] = {}
        self._open: list[_OpenPhase] = []
        # phase name -> [max retained in the first iteration, max in later ones]
        self._retained: dict[str, list[int | None]] = {}

    # ------------------------------------------------------------------ measuring
    @property
    def measures_peaks(self) -> bool:
        """Whether phase peaks are measured (the CUDA caching allocator's counters)."""
        return self.device.type == "cuda"

    def _params(self) -> list[torch.Tensor]:
        seen, params = set(), []
        for module in self.modules:
            for param in module.parameters():
                if id(param) not in seen:  # tied weights across chunks
                    seen.add(id(param))
                    params.append(param)
        return params

    def _runtimes(self, params: list[torch.Tensor]) -> list:
        runtimes = {}
        for param in params:
            runtime = getattr(param, "etp_runtime", None)
            if runtime is not None:
                runtimes[id(runtime)] = runtime
        return list(runtimes.values())

    def measure(self) -> dict[str, int]:
        """Bytes of each tensor category on the audited device, now.

        Example::

            audit.measure()["optimizer"] / 2**20   # MiB of optimizer state
        """
        params = self._params()
        param_bytes, grads, fp8 = _Storages(self.device), _Storages(self.device), _Storages(self.device)
        for param in params:
            param_bytes.add(param)
            main_grad = getattr(param, "main_grad", None)
            grads.add(main_grad if main_grad is not None else param.grad)
            runtime = getattr(param, "etp_runtime", None)
            quant = runtime.fp8_shard(param) if runtime is not None else None
            if quant is not None:
                fp8.add(quant.data)
        # Optimizer entries that are model params (fp32 params stepped in place, views of the
        # param buffer) are already counted under params.
        optimizer = _Storages(self.device, exclude=param_bytes.seen)
        for tensor in _optimizer_tensors(self.optimizer):
            optimizer.add(tensor)
        result = {"params": param_bytes.nbytes, "main_grad": grads.nbytes, "optimizer": optimizer.nbytes,
                  "gather_fwd": 0, "gather_bwd": 0, "gather_recompute": 0, "wgrad_pool": 0,
                  "fp8_shards": fp8.nbytes}
        for runtime in self._runtimes(params):
            for key in ("gather_fwd", "gather_bwd", "gather_recompute", "wgrad_pool"):
                result[key] += runtime.nbytes()[key]
        return result

    def _fold_peaks(self) -> None:
        """Carries the allocator's peaks so far into every open phase (before a reset)."""
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        for open_phase in self._open:
            open_phase.peak_allocated = max(open_phase.peak_allocated, allocated)
            open_phase.peak_reserved = max(open_phase.peak_reserved, reserved)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measures the code in the ``with`` block as phase ``name`` (``forward``,
        ``backward``, ``optimizer`` or any other). Phases may nest; a phase that raises
        records nothing.

        Example::

            with audit.phase("forward"):
                loss = model(batch).mean()
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name {name!r}: expected a non-empty string such as 'forward'")
        current = _OpenPhase(name)
        if self.measures_peaks:
            # Allocator statistics are kept on the host at malloc / free: no synchronize
            # needed (and none wanted: it would serialize the overlap being measured).
            self._fold_peaks()  # an enclosing phase keeps the peak it saw so far
            torch.cuda.reset_peak_memory_stats(self.device)
            current.allocated_start = torch.cuda.memory_allocated(self.device)
            current.tensor_bytes_start = sum(self.measure().values())
        self._open.append(current)
        try:
            yield
        except BaseException:
            self._open.remove(current)
            raise
        if self.measures_peaks:
            self._fold_peaks()
        self._open.remove(current)
        self._record(current)

    def _record(self, current: _OpenPhase) -> None:
        snapshot = self.measure()
        record = self.phases.setdefault(current.name, _PhaseRecord())
        record.calls += 1
        for key, value in snapshot.items():
            record.bytes[key] = max(record.bytes.get(key, 0), value)
        if self.measures_peaks:
            growth = sum(snapshot.values()) - current.tensor_bytes_start
            retained = torch.cuda.memory_allocated(self.device) - current.allocated_start - growth
            record.peak_allocated = _max(record.peak_allocated, current.peak_allocated)
            record.peak_reserved = _max(record.peak_reserved, current.peak_reserved)
            first, later = self._retained.setdefault(current.name, [None, None])
            if self.iterations == 0:
                first = _max(first, retained)
            else:
                later = _max(later, retained)
            self._retained[current.name] = [first, later]
            record.retained = first if later is None else later

    def step_done(self) -> None:
        """Marks the end of one training iteration (counted in the report)."""
        self.iterations += 1

    # ------------------------------------------------------------------ reporting
    def report(self) -> dict:
        """The audit as a JSON-ready dict (``schema_version`` 1); bytes per rank.

        ``bytes`` holds every category of ``etp.audit.CATEGORIES``: the high-water mark over
        phase ends and this call, ``activations`` the forward phase's ``retained`` (None when
        not measured). ``etp`` is None for a model without ETP weights.

        Example::

            report = audit.report()
            report["phases"]["forward"]["peak_allocated"], report["bytes"]["gather_fwd"]
        """
        high = self.measure()
        for record in self.phases.values():
            for key, value in record.bytes.items():
                high[key] = max(high.get(key, 0), value)
        forward = self.phases.get("forward")
        measured = {name: high.get(name) for name in CATEGORIES}
        measured["activations"] = forward.retained if forward is not None else None
        distributed = dist.is_available() and dist.is_initialized()
        return {
            "schema_version": SCHEMA_VERSION,
            "units": "bytes per rank",
            "rank": dist.get_rank() if distributed else 0,
            "world_size": dist.get_world_size() if distributed else 1,
            "device": str(self.device),
            "peaks_measured": self.measures_peaks,
            "iterations": self.iterations,
            "phases": {name: dataclasses.asdict(record) for name, record in self.phases.items()},
            "bytes": measured,
            "etp": self._etp_summary(),
        }

    def _etp_summary(self) -> dict | None:
        runtimes = self._runtimes(self._params())
        if not runtimes:
            return None
        stats: dict[str, int] = {}
        for runtime in runtimes:
            for key, value in runtime.stats.as_dict().items():
                stats[key] = stats.get(key, 0) + value
        return {
            "runtimes": len(runtimes),
            "cache_buffers": sum(r.gathers.cache.num_buffers for r in runtimes),
            "cache_tickets": sum(r.gathers.cache.num_tickets for r in runtimes),
            "pool_allocations": sum(r.reductions.pool.allocations for r in runtimes),
            "pool_free": sum(r.reductions.pool.num_free for r in runtimes),
            "stats": stats,
        }

    def compare(self, prediction: Mapping[str, float]) -> dict:
        """Predicted vs measured bytes of each category ``prediction`` names.

        Args:
            prediction: the per-rank dict ``etp.audit.predict_memory`` returns (a ``total``
                key is ignored; a subset of the categories is fine).

        Returns:
            ``{"units", "categories": {name: {"predicted", "measured", "error",
            "rel_error"}}, "total": {...same keys, "categories": [names summed]}}`` where
            ``error = measured - predicted`` and ``rel_error = error / predicted``; both None
            when the category was not measured (activations off CUDA), ``rel_error`` None
            when only the prediction is 0. The total sums the measured categories only.

        Raises:
            TypeError: ``prediction`` is not a mapping.
            ValueError: an unknown category name or a value that is not a byte count.

        Example::

            cmp = audit.compare(predict_memory(recipe, world_size))
            cmp["categories"]["optimizer"]["rel_error"]   # e.g. 0.004
        """
        return _comparison(prediction, self.report()["bytes"])

    def format_table(self, prediction: Mapping[str, float] | None = None) -> str:
        """A plain-text table of the report (and of ``compare(prediction)`` when given).

        Example::

            print(audit.format_table())
        """
        report = self.report()
        comparison = _comparison(prediction, report["bytes"]) if prediction is not None else None
        lines = [(f"etp memory audit: rank {report['rank']}/{report['world_size']} on {report['device']}, "
                  f"{report['iterations']} iterations (bytes per rank)")]
        if not report["peaks_measured"]:
            lines.append("phase peaks: n/a (measured on CUDA devices only)")
        if report["phases"]:
            lines.append(f"{'phase':<14}{'calls':>7}{'peak allocated':>17}{'peak reserved':>16}{'retained':>14}")
            for name, record in report["phases"].items():
                lines.append(f"{name:<14}{record['calls']:>7}{_fmt_bytes(record['peak_allocated']):>17}"
                             f"{_fmt_bytes(record['peak_reserved']):>16}{_fmt_bytes(record['retained']):>14}")
        header = f"{'category':<14}{'measured':>14}"
        if comparison is not None:
            header += f"{'predicted':>14}{'error':>10}"
        lines.append(header)
        for name, value in report["bytes"].items():
            line = f"{name:<14}{_fmt_bytes(value):>14}"
            row = comparison["categories"].get(name) if comparison is not None else None
            if row is not None:
                rel = "n/a" if row["rel_error"] is None else f"{row['rel_error']:+.1%}"
                line += f"{_fmt_bytes(row['predicted']):>14}{rel:>10}"
            lines.append(line)
        if comparison is not None:
            total = comparison["total"]
            rel = "n/a" if total["rel_error"] is None else f"{total['rel_error']:+.1%}"
            lines.append(f"{'total':<14}{_fmt_bytes(total['measured']):>14}"
                         f"{_fmt_bytes(total['predicted']):>14}{rel:>10}")
        if report["etp"] is not None:
            e, s = report["etp"], report["etp"]["stats"]
            lines.append(f"etp runtime: {e['cache_buffers']} gather buffers for {e['cache_tickets']} tickets, "
                         f"{e['pool_allocations']} wgrad pool allocations; gathers prefetched "
                         f"{s['gathers_prefetched']}, on demand {s['gathers_on_demand']}, "
                         f"re-used {s['gathers_reused']}")
        return "\n".join(lines)

    def write_json(self, path: str | Path) -> dict:
        """Writes ``report()`` to ``path`` (this rank's; name files per rank) and returns it.

        Example::

            audit.write_json(f"audit.rank{torch.distributed.get_rank()}.json")
        """
        report = self.report()
        Path(path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        return report


def _comparison(prediction: Mapping[str, float], measured: Mapping[str, int | None]) -> dict:
    """``MemoryAudit.compare`` against a report's ``bytes``."""
    names = CATEGORIES
    if not isinstance(prediction, Mapping):
        raise TypeError(f"prediction={type(prediction).__name__}: expected the dict "
                         "etp.audit.predict_memory returns")
    unknown = sorted(k for k in prediction if k not in names and k != "total")
    if unknown:
        raise ValueError(
            f"prediction has unknown categories {unknown}: expected names from {list(names)} "
            "(pass predict_memory's dict, or report['layouts']['with_etp'] of etp-audit --json)"
        )
    for key, value in prediction.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"prediction[{key!r}]={value!r}: expected a byte count >= 0")
    rows, summed = {}, []
    for name in names:
        if name in prediction:
            rows[name] = _compare_row(prediction[name], measured[name])
            if measured[name] is not None:
                summed.append(name)
    total = _compare_row(sum(prediction[n] for n in summed), sum(measured[n] for n in summed))
    return {"units": "bytes per rank", "categories": rows, "total": {**total, "categories": summed}}


def _compare_row(predicted: float, measured: int | None) -> dict:
    if measured is None:
        return {"predicted": predicted, "measured": None, "error": None, "rel_error": None}
    error = measured - predicted
    if predicted:
        rel = error / predicted
    else:
        rel = 0.0 if measured == 0 else None  # no finite relative error against 0
    return {"predicted": predicted, "measured": measured, "error": error, "rel_error": rel}
