"""GatherFormat: what one way of moving ETP weights owns, and the pieces every format shares.

[Note: ETP gather formats]
``ETPConfig.gather_dtype`` names a *gather format*: one object (``etp.formats.gather_format``)
that owns everything specific to how a weight travels and reaches its GEMMs, so nothing else
in etp branches on the name:

* **wire**: the dtype of the gathered buffer (``wire_dtype``) and its bytes
  (``gathered_bytes``, from bits per element, so a packed format counts right);
* **quantization** (``quantized`` formats only): ``quantize`` makes every shard's quantized copy
  and its scales once per optimizer step (``etp.quantize_shards`` calls it, per ETP group, with
  the group's collectives in a ``ScaleExchange`` and a dict for a plan it keeps across steps);
  the result is a ``QuantizedShard``, the *scale state*, which the gather then moves (bytes only:
  every rank already holds the full weight's scales);
* **GEMM operands**: ``operand`` turns a gathered buffer into what the GEMMs take: a plain
  tensor in the compute dtype, or a ``WeightOperand`` (dequantized by the GEMMs' fallback path,
  or met by the scaled FP8 GEMMs where ``fp8_gemm_applies``);
* **rules**: the shard rows it needs (``row_align``, checked against ``pad_for_alignment``),
  the training dtypes it takes (``unsupported``), the GPUs where its GEMMs pay (``not_fast_on``:
  what ``auto`` and ``--tune`` ask), and what the memory audit counts for it
  (``gathered_bytes``, ``quantized_copy_bytes``, ``fp8_gemms``).

A format outside etp is named by its import path, ``"package.module:Name"`` (a ``GatherFormat``
subclass or instance), resolved in each process on first use (spawned ranks included), so
adding one is one file; see ``etp.formats.gather_format``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["GatherFormat", "QuantizedShard", "ScaleExchange", "ShardToQuantize", "WeightOperand",
           "fp8_compute_applies", "is_sm90", "store_quantized"]


@functools.lru_cache(maxsize=None)
def _major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def is_sm90(x: torch.Tensor) -> bool:
    """Whether ``x`` lives on an sm90+ GPU (looked up once per device: every GEMM asks, and the
    lookup costs microseconds of host time)."""
    return x.is_cuda and _major(x.get_device()) >= 9


_SCALED = {False: hasattr(torch, "_scaled_mm"), True: hasattr(torch, "_scaled_grouped_mm")}


def fp8_compute_applies(x: torch.Tensor, weight_shape, grouped: bool) -> bool:
    """Whether an e4m3 weight of ``weight_shape`` with one scale per weight (or expert) meets
    ``x`` in a scaled FP8 GEMM (sm90+, bf16 activations, both weight dims multiples of 16 as
    the FP8 tensor cores need) rather than in the dequantized fallback."""
    return (_SCALED[grouped] and x.dtype == torch.bfloat16 and is_sm90(x)
            and weight_shape[-1] % 16 == 0 and weight_shape[-2] % 16 == 0)


@dataclass(eq=False)
class QuantizedShard:
    """This rank's quantized shard of one weight and the scales of the *full* weight: a
    quantized format's scale state, made once per optimizer step.

    ``scale`` is what real values were multiplied by before the cast (FP8: ``448 / amax``), in
    the shape the format chooses; ``scale_inv = 1 / scale`` is the dequantization multiplier.
    ``amax``: what a format with delayed scaling keeps of this step for the next one.
    """

    data: torch.Tensor
    scale: torch.Tensor
    version: int
    scale_inv: torch.Tensor | None = None
    amax: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.scale_inv is None:  # once per step, not once per GEMM
            self.scale_inv = 1.0 / self.scale


@dataclass(eq=False)
class ShardToQuantize:
    """One weight's shard as a format's ``quantize`` sees it."""

    ident: int  # the weight's identity (its parameter's id): what a plan kept across steps checks
    shard: torch.Tensor  # this rank's ``[shard_rows, cols]`` rows, live (padding rows are zeros)
    layout: Any  # its ``etp.ShardLayout``
    version: int  # the parameter's version counter now (the result records it)
    previous: QuantizedShard | None  # the last quantization, whose tensors are rewritten in place
    home: torch.Tensor | None = None  # where the quantized shard must live (copy-engine transport)


class ScaleExchange:
    """The collectives a quantization runs over one ETP group (``etp.quant`` passes them, so
    formats hold no process group and run under a fake one in tests).

    Example::

        exchange.all_reduce_max(amax)                        # one all-reduce for every weight
        full_scales = exchange.all_gather_rows(row_scales)   # one all-gather for every weight
    """

    size: int = 1  # ranks in the group

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """``tensor`` becomes its element-wise maximum over the group, in place."""
        raise NotImplementedError

    def all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D ``flat``, concatenated in rank order (``[size * numel]``)."""
        raise NotImplementedError

    def all_gather_rows(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each piece (a rank's scales of one weight, rows first) concatenated over the group's
        ranks along its first dim, for all pieces in one collective."""
        if not pieces:
            return []
        flat = torch.cat([p.reshape(-1) for p in pieces])
        per_rank = self.all_gather(flat).view(self.size, -1)
        out, offset = [], 0
        for p in pieces:
            n = p.numel()
            out.append(per_rank[:, offset: offset + n].reshape(self.size * p.shape[0], *p.shape[1:]))
            offset += n
        return out


def store_quantized(target: ShardToQuantize, data: torch.Tensor, scale: torch.Tensor,
                    amax: torch.Tensor | None = None) -> QuantizedShard:
    """The scale state of ``target`` for this step. After the first step it is written into the
    tensors of the previous one, so their addresses never change: a CUDA graph that captured a
    gather and its scaled GEMMs reads the new step's values at replay.

    Example::

        return [store_quantized(s, q, scale) for s, (q, scale) in zip(shards, quantized)]
    """
    old = target.previous
    if old is not None and old.data.shape == data.shape and old.scale.shape == scale.shape:
        if old.data.data_ptr() != data.data_ptr():
            old.data.copy_(data)
        old.scale.copy_(scale)
        torch.reciprocal(old.scale, out=old.scale_inv)
        old.version = target.version
        if amax is not None and old.amax is not None and old.amax.shape == amax.shape:
            old.amax.copy_(amax)
        else:
            old.amax = None if amax is None else amax.clone()
        return old
    return QuantizedShard(data, scale.contiguous(), target.version, amax=None if amax is None else amax.clone())


class WeightOperand:
    """A gathered weight in a form the plain GEMMs cannot read as it is: the GEMMs ask it
    ``fp8_gemm_applies`` (then read its tensorwise e4m3 data and scales, see
    ``etp.formats.fp8.FP8Weight``) and otherwise call ``dequantize``."""

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (the fallback path of every GEMM)."""
        raise NotImplementedError

    def fp8_gemm_applies(self, x: torch.Tensor, grouped: bool) -> bool:
        """Whether this weight meets ``x`` in a scaled FP8 GEMM (``torch._scaled_mm`` /
        ``torch._scaled_grouped_mm``)."""
        return False


class GatherFormat:
    """How ETP weights travel and what their GEMMs get. See [Note: ETP gather formats].

    Subclasses set the class attributes and override what differs; the defaults describe a
    plain format that moves the parameter's own values.

    Example::

        class Int8Rowwise(GatherFormat):
            name, dtype, quantized = "int8_rowwise", torch.int8, True
            def quantize(self, shards, exchange, plans): ...
            def operand(self, weight, buffer, quant, rows, compute_dtype): ...

        ETPConfig(etp_size=2, gather_dtype="my_formats:Int8Rowwise")
    """

    #: the ``ETPConfig.gather_dtype`` that names it
    name: str = ""
    #: element dtype of the wire shard and the gather buffer (None: the parameter's own)
    dtype: torch.dtype | None = None
    #: keeps a quantized copy of every shard, made once per step by ``quantize``
    quantized: bool = False
    #: rows per shard must be a multiple of this (``ETPConfig.pad_for_alignment`` is checked)
    row_align: int = 1
    #: on sm90+ with bf16 activations its GEMMs are scaled FP8 GEMMs that quantize their
    #: activations rowwise (what the memory audit, which assumes such GPUs, counts)
    fp8_gemms: bool = False

    def __repr__(self) -> str:
        return f"<gather format {self.name!r}>"

    # ------------------------------------------------------------------ rules
    def check(self, config) -> None:
        """Raises ValueError when ``config`` (an ``ETPConfig``) cannot run this format."""
        if config.pad_for_alignment % self.row_align:
            raise ValueError(
                f"ETPConfig.pad_for_alignment={config.pad_for_alignment!r}: gather_dtype="
                f"{config.gather_dtype!r} needs shards of whole {self.row_align}-row blocks: use a "
                f"multiple of {self.row_align}"
            )

    def unsupported(self, param_dtype: torch.dtype) -> str | None:
        """Why weights trained in ``param_dtype`` cannot travel in this format, one sentence with
        the fix (None: they can); the recipe refuses the combination with it."""
        return None

    def not_fast_on(self, sm90: bool) -> str | None:
        """Why this format's GEMMs would not pay on a GPU that is (or is not) sm90+ (None: they
        do); ``auto`` and ``--tune`` ask before choosing it."""
        return None

    def fp8_gemm_applies(self, x: torch.Tensor, weight_shape, grouped: bool) -> bool:
        """Whether this format's weight of ``weight_shape`` meets ``x`` in a scaled FP8 GEMM
        (the producer of ``x``'s successor may then quantize it in the same pass)."""
        return False

    # ------------------------------------------------------------------ wire and memory
    def wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the shard on the wire and of the gather buffer."""
        return self.dtype or param_dtype

    def wire_bits(self, param_bytes: int) -> int:
        """Bits one weight element costs on the wire (and in the gather buffer)."""
        return 8 * (self.dtype.itemsize if self.dtype is not None else param_bytes)

    def gathered_bytes(self, rows: int, cols: int, param_bytes: int) -> int:
        """Bytes of ``rows x cols`` weight elements in the gather buffer, as they travel (scales,
        when the format has any, travel once per step in the quantization's own collective)."""
        return -(-rows * cols * self.wire_bits(param_bytes) // 8)

    def quantized_copy_bytes(self, numel: int, param_bytes: int) -> int:
        """Bytes of the per-step quantized copy of a shard of ``numel`` elements (the audit's
        ``fp8_shards``; 0 for a format that gathers the shard itself)."""
        return self.gathered_bytes(numel, 1, param_bytes) if self.quantized else 0

    # ------------------------------------------------------------------ per step and per GEMM
    def quantize(self, shards: Sequence[ShardToQuantize], exchange: ScaleExchange,
                 plans: dict) -> list[QuantizedShard]:
        """The quantized shards of one ETP group's weights for the coming step, in order (a
        collective: every rank of the group calls it with the same weights). ``plans``: kept by
        the runtime across steps for this group and format (reset by ``runtime.reset()``)."""
        raise NotImplementedError(f"{self!r} keeps no quantized shards")

    def operand(self, weight: torch.Tensor, buffer: torch.Tensor, quant: QuantizedShard | None,
                rows: int, compute_dtype: torch.dtype):
        """What the GEMMs get from a gathered weight: ``weight`` is the logical view of the
        gathered ``[padded_rows, cols]`` ``buffer``, ``rows`` its logical rows, ``quant`` this
        rank's scale state (quantized formats)."""
        return weight if weight.dtype == compute_dtype else weight.to(compute_dtype)
