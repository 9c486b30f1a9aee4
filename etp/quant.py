"""Quantized weight gathers: every quantized shard made once per optimizer step.

``quantize_shards`` finds the ETP weights whose gather format keeps a quantized shard
(``GatherFormat.quantized``: the FP8 formats, or one named by its import path), and asks each
format to quantize its weights of one ETP group at once, with that group's collectives
(``ScaleExchange``) and the plan the format keeps across steps. What the FP8 formats do:
[Note: ETP FP8 gathers] in ``etp/formats/fp8.py``; what a format owns: [Note: ETP gather
formats] in ``etp/formats/base.py``.

The FP8 weight, its scales and the tensorwise cast moved to ``etp.formats`` (the old names
here keep working for one release, with a ``DeprecationWarning``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ._moved import forward
from .collectives import all_gather_tensor
from .formats import ScaleExchange, ShardToQuantize
from .param import ETPShardedParam

__all__ = ["quantize_shards"]


class _GroupExchange(ScaleExchange):
    """A quantization's collectives over one ETP group, each under its ``etp::`` label."""

    def __init__(self, group) -> None:
        self.group, self.size = group, group.size

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        if self.size > 1:
            with record_function("etp::all_reduce"):
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group.ag_group)

    def all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        gathered = flat.new_empty(flat.numel() * self.size)
        if self.size > 1:
            with record_function("etp::all_gather"):
                all_gather_tensor(gathered, flat, group=self.group.ag_group)
        else:
            gathered.copy_(flat)
        return gathered


def _quantize_group(params, fmt) -> None:
    runtime = params[0].etp_runtime
    states = [runtime.gathers.state(p) for p in params]
    shards = [ShardToQuantize(id(p), p.detach(), p.etp_layout, p._version, st.quant, st.quant_home)
              for p, st in zip(params, states)]
    plans = runtime.quant_plans.setdefault((params[0].etp_group.ranks, params[0].etp_config.gather_dtype), {})
    for st, quant in zip(states, fmt.quantize(shards, _GroupExchange(params[0].etp_group), plans)):
        st.quant = quant


def quantize_shards(model_or_params) -> int:
    """Quantizes every ETP shard of a model (or an iterable of ETP params) whose gather format
    keeps a quantized shard (FP8 gathers) for the coming step; a collective over the ETP groups
    (every rank calls it). Returns the number of weights quantized. See [Note: ETP FP8 gathers].

    Example::

        optimizer.step()
        etp.quantize_shards(model)   # optional with torch optimizers: etp notices updates
    """

    params = model_or_params.parameters() if hasattr(model_or_params, "parameters") else model_or_params
    by_group: dict[tuple, list] = {}
    for param in params:
        if isinstance(param, ETPShardedParam) and param.etp_config.gather_format.quantized:
            by_group.setdefault((param.etp_group.ranks, param.etp_config.gather_dtype), []).append(param)
    with torch.no_grad(), record_function("etp::quantize_shards"):
        for _, group_params in sorted(by_group.items(), key=lambda kv: kv[0]):
            _quantize_group(group_params, group_params[0].etp_config.gather_format)
    return sum(len(v) for v in by_group.values())


_MOVED = (forward(__name__, "etp.formats.fp8", ("FP8Weight", "scale_rows", "prepare_scale_rows", "FP8_DTYPE", "BLOCK")),
          forward(__name__, "etp.formats.fp8_tensorwise", ("cast_tensorwise",)),
          forward(__name__, "etp.formats", ("QuantizedShard",)))


def __getattr__(name: str):
    for moved in _MOVED:
        try:
            return moved(name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
