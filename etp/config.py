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

__all__ = ["ETPConfig", "GATHER_DTYPES", "REDUCTIONS", "REDUCE_TRANSPORTS", "TRANSPORTS"]

#: Gather formats, mapped to the dtype the weight travels in (None: the parameter's own).
GATHER_DTYPES: dict[str, torch.dtype | None] = {
    "param": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    # One byte per element on the wire; see [Note: ETP FP8 gathers] in etp/quant.py.
    "fp8_tensorwise": torch.float8_e4m3fn,
    "fp8_blockwise": torch.float8_e4m3fn,
}

#: How weight gradients combine over the ETP group. ETP peers see different data, so their
#: gradients must be combined: "mean" matches a loss averaged per rank (DDP convention),
#: "sum" matches per-token-sum losses normalized later by the caller.
REDUCTIONS = ("mean", "sum")


#: How gathered weight bytes move; see [Note: ETP transports] in etp/transport/base.py.
TRANSPORTS = ("auto", "nccl", "copy_engine")
FP8_WEIGHT_SCALINGS = ("current", "delayed")
GATHER_REUSE = ("chain", "pass", "step")
#: How weight-gradient reduce-scatters run; see [Note: ETP transports].
REDUCE_TRANSPORTS = ("auto", "nccl", "nccl_capped", "symm_triton", "copy_engine", "copy_engine_push")


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
            pad_for_alignment a multiple of 128).
        fp8_fast_accum: with ``fp8_tensorwise`` gathers on sm90+, the forward and
            input-gradient FP8 GEMMs accumulate without the periodic fp32 promotion (CUTLASS's
            fast-accumulation kernels, TransformerEngine's choice for its forward GEMM; with
            ``fp8_wgrad`` also the weight-gradient GEMMs):
            1.15-1.24x faster on H200 at expert shapes with the same measured error against
            float64 (BENCHMARKS.md "FP8 compute"). Off: the promoted kernels.
        fp8_wgrad: the weight-gradient GEMMs of grouped (expert) weights run in FP8 on sm90+
            with bf16 activations (TransformerEngine's FP8 recipes quantize this GEMM too):
            each operand gets one scale per expert from the rows' amax its rowwise
            quantization already found (per (expert, column) where none is known), cast
            transposed in one read. On by default since the flagship recipe's loss with it
            tracked bf16 gathers on 2xH200 (1.4% apart over the last 10 of 25 iterations) and
            the 2xH200 expert stack's ETP FP8 step fell from 1.03x to 0.98x of bf16
            replicated's (BENCHMARKS.md "2xH200, session 6"). Off: weight gradients from bf16
            GEMMs.
        fp8_weight_scaling: how ``fp8_tensorwise`` weights get their scales each step:
            "current" (the weight's amax now: an amax pass, then the cast) or "delayed" (the
            previous step's amax, as TransformerEngine's default recipe: one cast pass that
            also records this step's amax; weights whose amax grew are re-cast with their own
            scale, decided on the device, so nothing ever saturates). Delayed (the default)
            saves one read of every FP8 weight per step; a weight's first quantization (no
            previous amax) is current.
        gather_reuse: how long a gathered weight is kept (memory for fewer gathers):
            "chain" (two buffers per shape and role, re-gathered in backward: the least
            memory), "pass" (every forward gather kept for its backward and recompute, as
            FSDP's ``reshard_after_forward=False``: no backward gathers, the full weights
            held through each micro-batch) or "step" (kept across the micro-batches of a
            step as well: one gather per weight per optimizer step; ``drain()`` /
            ``etp.finalize_grads``, which must run before every optimizer step, ends it).
            "pass" and "step" hold every ETP weight unsharded in the gather dtype: the
            memory of replicated 16-bit (or FP8) weights, with optimizer states and
            gradients still sharded. See [Note: gather reuse] in etp/runtime.py.
        prefetch: gather the next weight of the chain while the current GEMM runs.
        prefetch_recompute: with ``prefetch``, also prefetch the weights of forwards that
            activation recompute re-runs inside backward, along their own chain (off: each
            recomputed weight is gathered on demand). See [Note: ETP recompute chain].
        async_reduce: reduce-scatter weight gradients on a side stream, finalized later.
        debug_checks: check every gather / reduce-scatter state transition (slower) and log
            weight-cache and wgrad-pool activity on the ``etp.cache`` logger (allocations at
            INFO, every acquire / release at DEBUG); off, nothing is logged.
        transport: how weight all-gathers move bytes: "nccl" (the process group's
            collective), "copy_engine" (peer copies out of torch symmetric memory fenced by
            stream flag operations: no SMs; CUDA + NCCL groups on NVLink GPUs of one host
            only) or "auto" (copy_engine where symmetric memory is available, else nccl).
            Chosen once at wrap time and logged.
        alias_own_rows: with "copy_engine" gathers, a weight whose shard is a whole multiple
            of the 2 MiB mapping granularity is gathered into a buffer whose own rows *are* the
            shard (virtual-memory aliasing, [Note: aliased own rows] in etp/transport/vmm.py),
            so only the peers' rows are copied: a device-local copy runs on the SMs and
            stalls the next GEMM. On 2xH100 the bf16 expert stack's step fell from 60.95 to
            58.15 ms with it, and its ticket buffers to (size - 1) / size of their bytes
            (BENCHMARKS.md "2xH100, session 12"); on the flagship recipe it takes 4.2 GiB off
            the bf16 peak (44.10 -> 39.91 GiB) and trains the same (session 13). On by default;
            False keeps plain ticket buffers and the own-rows copy. Ignored by NCCL gathers.
        reduce_transport: how weight-gradient reduce-scatters run: "nccl" (the RS
            communicator, fp32 wire), "nccl_capped" (its own NCCL communicator limited to
            ``reduce_ctas`` CTAs), "symm_triton" (a Triton kernel over symmetric memory on
            ``reduce_ctas`` CTAs: 16-bit wire bytes, fp32 sums added straight into
            ``main_grad``), "copy_engine" (the peers' 16-bit slices of this rank's rows
            pulled over symmetric memory by the copy engines, then added in fp32 into
            ``main_grad`` locally: SMs only for that memory-bound add, and two barrier kernels
            per reduction), "copy_engine_push" (each rank pushes the peers' rows to them by
            copy engine, fenced by stream flag operations: nothing on an SM beside the GEMMs;
            the fp32 sum into ``main_grad`` runs on the compute stream when the reduction is
            finalized; a CUDA graph replays it as well; see [Note: push reduce-scatter]) or
            "auto" (copy_engine_push where symmetric memory is available, as for ``transport``,
            else nccl. On the flagship
            recipe at world 2 it ran 10% faster than nccl with 2.8 GiB less peak memory:
            BENCHMARKS.md, session 11).
        reduce_ctas: CTAs (thread blocks) of the "nccl_capped" and "symm_triton" reductions.
        gemm_sm_carveout: SMs the GEMMs leave free for the side streams' kernels from the
            first weight-gradient reduce-scatter of a backward pass to its last (torch's SM
            carve-out; 0: off). A persistent GEMM that starts while a collective holds SMs
            otherwise runs part of its tiles late, up to twice its time alone: set it to the
            reduction's CTAs (``reduce_ctas`` with "nccl_capped" / "symm_triton"; plus one for
            the copy-engine gather's barrier kernel inside a CUDA graph, where its fences are
            kernels). See [Note: GEMM SM carve-out].

    Example::

        cfg = ETPConfig.from_yaml("configs/etp.yaml", etp_size=4)
        cfg = ETPConfig(etp_size=2, reduction="sum")
    """

    etp_size: int = 1
    expert_etp_size: int = 1
    pad_for_alignment: int = 16
    reduction: str = "mean"
    gather_dtype: str = "param"
    fp8_fast_accum: bool = True
    fp8_wgrad: bool = True
    fp8_weight_scaling: str = "delayed"
    gather_reuse: str = "chain"
    prefetch: bool = True
    prefetch_recompute: bool = True
    async_reduce: bool = True
    debug_checks: bool = False
    transport: str = "auto"
    alias_own_rows: bool = True
    reduce_transport: str = "auto"
    reduce_ctas: int = 8
    gemm_sm_carveout: int = 0

    def __post_init__(self) -> None:
        for key in ("etp_size", "expert_etp_size", "pad_for_alignment", "reduce_ctas"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"ETPConfig.{key}={value!r}: expected a positive integer")
            if value <= 0:
                raise ValueError(f"ETPConfig.{key}={value!r}: must be >= 1")
        carveout = self.gemm_sm_carveout
        if isinstance(carveout, bool) or not isinstance(carveout, int) or carveout < 0:
            raise ValueError(f"ETPConfig.gemm_sm_carveout={carveout!r}: expected a non-negative integer "
                             "(SMs the GEMMs leave free during backward; 0: off)")
        if not _is_power_of_two(self.pad_for_alignment):
            raise ValueError(
                f"ETPConfig.pad_for_alignment={self.pad_for_alignment!r}: must be a power of two "
                "(1, 2, 4, 8, 16, ...)"
            )
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"ETPConfig.reduction={self.reduction!r}: allowed values are {list(REDUCTIONS)}"
            )
        if self.gather_dtype not in GATHER_DTYPES:
            raise ValueError(
                f"ETPConfig.gather_dtype={self.gather_dtype!r}: allowed values are "
                f"{list(GATHER_DTYPES)}"
            )
        if self.gather_dtype == "fp8_blockwise" and self.pad_for_alignment % 128:
            raise ValueError(
                f"ETPConfig.pad_for_alignment={self.pad_for_alignment!r}: gather_dtype="
                "'fp8_blockwise' needs shards of whole 128-row blocks: use a multiple of 128"
            )
        for key, allowed in (("transport", TRANSPORTS), ("reduce_transport", REDUCE_TRANSPORTS),
                             ("fp8_weight_scaling", FP8_WEIGHT_SCALINGS), ("gather_reuse", GATHER_REUSE)):
            if getattr(self, key) not in allowed:
                raise ValueError(
                    f"ETPConfig.{key}={getattr(self, key)!r}: allowed values are {list(allowed)}"
                )
        for key in ("fp8_fast_accum", "fp8_wgrad", "prefetch", "prefetch_recompute", "async_reduce", "debug_checks",
                    "alias_own_rows"):
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
    def gather_torch_dtype(self) -> torch.dtype | None:
        """The dtype weights travel in, or None for the parameter's own dtype."""
        return GATHER_DTYPES[self.gather_dtype]

    def check_world_size(self, world_size: int) -> None:
        """Raises ValueError when the ETP sizes do not divide ``world_size``."""
        for key in ("etp_size", "expert_etp_size"):
            size = getattr(self, key)
            if world_size % size:
                raise ValueError(
                    f"ETPConfig.{key}={size} does not divide the world size {world_size}: "
                    f"choose a divisor of {world_size}"
                )
