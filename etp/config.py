"""ETPConfig: the frozen, validated settings of Extended Tensor Parallelism.

Every invalid value raises ``ValueError`` naming the key, the value and what is allowed;
``assert`` is never used for user input (it vanishes under ``python -O``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from .formats import FORMATS, GatherFormat, gather_format

__all__ = ["ETPConfig", "REDUCTIONS", "REMOVED_SETTINGS", "TRANSPORTS"]

#: How weight gradients combine over the ETP group. ETP peers see different data, so their
#: gradients must be combined: "mean" matches a loss averaged per rank (DDP convention),
#: "sum" matches per-token-sum losses normalized later by the caller.
REDUCTIONS = ("mean", "sum")

#: How weight and gradient bytes move; see [Note: ETP transports] in etp/transport/base.py.
TRANSPORTS = ("auto", "nccl", "copy_engine")
GATHER_REUSE = ("chain", "pass", "step")

#: Settings that existed once, and what stands in their place (a recipe or ``from_dict`` that
#: names one is refused with this sentence).
REMOVED_SETTINGS: dict[str, str] = {
    "reduce_transport": "`transport` now chooses gathers and weight-gradient reductions together "
                        "(auto | nccl | copy_engine: copy-engine gathers and the push reduce-scatter)",
    "reduce_ctas": "the capped-CTA reduce-scatters are gone; `transport: copy_engine` reduces on no SM",
    "gemm_sm_carveout": "the capped-CTA reduce-scatters it served are gone; `transport: copy_engine` "
                        "leaves every SM to the GEMMs",
    "alias_own_rows": "copy-engine gathers always read this rank's own rows in place where the driver "
                      "allows it (the wrap-time log line says so)",
    "fp8_fast_accum": "FP8 forward and input-gradient GEMMs always accumulate fast (same measured "
                      "error against float64)",
    "fp8_weight_scaling": "FP8 weight scales are always delayed (a weight whose amax grew is re-cast "
                          "with its own, so nothing saturates)",
    "prefetch_recompute": "`prefetch` covers the weights activation recompute gathers as well",
}


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class ETPConfig:
    """Settings of Extended Tensor Parallelism.

    Args:
        etp_size: ranks that shard each dense weight (1 = ETP off for dense weights).
        expert_etp_size: ranks that shard each routed-expert weight (1 = off for experts).
        pad_for_alignment: each rank's shard holds a multiple of this many rows; the logical
            weight is padded to ``pad_for_alignment * size`` rows before slicing. Power of two.
        reduction: "mean" or "sum" of weight gradients over the ETP group.
        gather_dtype: format the weight travels in for the all-gather: "param" (the
            parameter's own dtype), "bf16", "fp16", "fp32", "fp8_tensorwise" (e4m3, one
            scale per weight or per expert) or "fp8_blockwise" (e4m3, 128x128 blocks; needs
            pad_for_alignment a multiple of 128). FP8 halves the gathered bytes and runs the
            GEMMs in FP8 on sm90+ (fast accumulation; delayed weight scales: the previous
            step's amax, a weight whose amax grew re-cast with its own). A format outside
            etp is named by its import path, "module:Name" (see ``etp.formats``); the object
            behind the name is ``gather_format``.
        fp8_wgrad: with FP8 gathers, the weight-gradient GEMMs of grouped (expert) weights run
            in FP8 on sm90+ too (per-expert scales from the rows' amax). A precision choice:
            off, weight gradients come from bf16 GEMMs.
        gather_reuse: how long a gathered weight is kept (memory for fewer gathers):
            "chain" (two buffers per shape and role, re-gathered in backward: the least
            memory), "pass" (every forward gather kept for its backward and recompute, as
            FSDP's ``reshard_after_forward=False``) or "step" (kept across the micro-batches
            of a step as well: one gather per weight per optimizer step; ``drain()`` /
            ``etp.finalize_grads``, which must run before every optimizer step, ends it).
            "pass" and "step" hold every ETP weight unsharded in the gather dtype: the
            memory of replicated 16-bit (or FP8) weights, with optimizer states and
            gradients still sharded. See [Note: gather reuse] in etp/runtime.py.
        prefetch: gather the next weight of the chain (and of activation recompute's chain)
            while the current GEMM runs. Off: every weight is gathered when it is needed.
        async_reduce: reduce-scatter weight gradients on a side stream, finalized later. Off:
            each reduce-scatter completes before backward goes on.
        debug_checks: check every gather / reduce-scatter state transition and, at wrap time,
            that replicated parameters and shard layouts agree across each ETP group (slower);
            log weight-cache and wgrad-pool activity on the ``etp.cache`` logger (allocations
            at INFO, every acquire / release at DEBUG). Off, nothing is logged.
        transport: how weight and gradient bytes move: "nccl" (the process group's
            collectives), "copy_engine" (gathers are peer copies out of torch symmetric memory
            and weight gradients are pushed to their owners the same way, fenced by stream flag
            operations: no SM beside the GEMMs; CUDA + NCCL groups of GPUs on one host only) or
            "auto" (copy_engine where symmetric memory is available, else nccl). Chosen once at
            wrap time and logged. See [Note: ETP transports].

    Example::

        cfg = ETPConfig.from_yaml("configs/etp.yaml", etp_size=4)
        cfg = ETPConfig(etp_size=2, reduction="sum")
    """

    etp_size: int = 1
    expert_etp_size: int = 1
    pad_for_alignment: int = 16
    reduction: str = "mean"
    gather_dtype: str = "param"
    fp8_wgrad: bool = True
    gather_reuse: str = "chain"
    prefetch: bool = True
    async_reduce: bool = True
    debug_checks: bool = False
    transport: str = "auto"

    def __post_init__(self) -> None:
        for key in ("etp_size", "expert_etp_size", "pad_for_alignment"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"ETPConfig.{key}={value!r}: expected a positive integer")
            if value <= 0:
                raise ValueError(f"ETPConfig.{key}={value!r}: must be >= 1")
        if not _is_power_of_two(self.pad_for_alignment):
            raise ValueError(
                f"ETPConfig.pad_for_alignment={self.pad_for_alignment!r}: must be a power of two "
                "(1, 2, 4, 8, 16, ...)"
            )
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"ETPConfig.reduction={self.reduction!r}: allowed values are {list(REDUCTIONS)}"
            )
        try:
            found = gather_format(self.gather_dtype)
        except ValueError as error:
            raise ValueError(f"ETPConfig.gather_dtype={self.gather_dtype!r}: {error}") from None
        found.check(self)
        for key, allowed in (("transport", TRANSPORTS), ("gather_reuse", GATHER_REUSE)):
            if getattr(self, key) not in allowed:
                raise ValueError(
                    f"ETPConfig.{key}={getattr(self, key)!r}: allowed values are {list(allowed)}"
                )
        for key in ("fp8_wgrad", "prefetch", "async_reduce", "debug_checks"):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ValueError(f"ETPConfig.{key}={value!r}: expected true or false")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(cls, values: Mapping[str, Any], **overrides: Any) -> "ETPConfig":
        """Builds a config from a mapping plus keyword overrides; unknown keys are errors."""
        if not isinstance(values, Mapping):
            raise ValueError(f"ETP settings must be a mapping, got {type(values).__name__}")
        merged = {**values, **overrides}
        removed = sorted(set(merged) & set(REMOVED_SETTINGS))
        if removed:
            raise ValueError(f"ETP setting {removed[0]!r} was removed: {REMOVED_SETTINGS[removed[0]]}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise ValueError(
                f"unknown ETP setting(s) {unknown}: allowed keys are {sorted(known)}"
            )
        return cls(**merged)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "ETPConfig":
        """Loads a YAML file (the whole file, or its ``etp:`` section) plus overrides."""
        import yaml  # local: pyyaml is only needed when reading files

        text = Path(path).read_text(encoding="utf-8")
        loaded = yaml.safe_load(text) or {}
        if isinstance(loaded, Mapping) and isinstance(loaded.get("etp"), Mapping):
            loaded = loaded["etp"]
        return cls.from_dict(loaded, **overrides)

    def replace(self, **changes: Any) -> "ETPConfig":
        """A copy with some fields changed (validated again)."""
        return self.from_dict(dataclasses.asdict(self), **changes)

    # ------------------------------------------------------------------ derived
    @property
    def gather_format(self) -> GatherFormat:
        """The object behind ``gather_dtype`` (``etp.formats``): what every part of etp asks
        about the weights' wire, quantization, GEMM operands and memory."""
        return gather_format(self.gather_dtype)

    @property
    def gather_torch_dtype(self) -> torch.dtype | None:
        """The dtype weights travel in, or None for the parameter's own dtype."""
        return self.gather_format.dtype

    def check_world_size(self, world_size: int) -> None:
        """Raises ValueError when the ETP sizes do not divide ``world_size``."""
        for key in ("etp_size", "expert_etp_size"):
            size = getattr(self, key)
            if world_size % size:
                raise ValueError(
                    f"ETPConfig.{key}={size} does not divide the world size {world_size}: "
                    f"choose a divisor of {world_size}"
                )


def __getattr__(name: str):
    # The table of formats that stood here: each format object now says its own wire dtype.
    if name == "GATHER_DTYPES":
        import warnings

        warnings.warn("etp.config.GATHER_DTYPES is replaced by etp.formats (gather_format(name).dtype; "
                      "etp.formats.FORMATS lists the names); it goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return {key: gather_format(key).dtype for key in FORMATS}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
