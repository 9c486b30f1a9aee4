"""Gather formats: one object per way an ETP weight can travel (``ETPConfig.gather_dtype``).

``gather_format(name)`` returns the format object a name stands for: one of ``FORMATS`` (the
formats etp ships), or a format outside etp named by its import path ``"module:Name"``, where
``Name`` is a ``GatherFormat`` subclass (instantiated without arguments) or instance. Each
process resolves the name itself on first use, so a format named by its path reaches every
rank that gets the config: ranks spawned by etp-train's CPU driver (their ``sys.path`` is the
launcher's) and torchrun ranks (with the module on ``PYTHONPATH``). What a format owns:
[Note: ETP gather formats] in ``etp/formats/base.py``.

Example::

    fmt = gather_format("fp8_tensorwise")
    fmt.gathered_bytes(4096, 2048, param_bytes=2)        # 8 MiB: one byte per element
    ETPConfig(etp_size=2, gather_dtype="my_formats:Int8Rowwise").gather_format.name
"""
from __future__ import annotations

import importlib

from .base import (
    GatherFormat,
    QuantizedShard,
    ScaleExchange,
    ShardToQuantize,
    WeightOperand,
    fp8_compute_applies,
    store_quantized,
)

__all__ = ["FORMATS", "GatherFormat", "QuantizedShard", "ScaleExchange", "ShardToQuantize", "WeightOperand",
           "fp8_compute_applies", "gather_format", "store_quantized"]

#: The formats etp ships: name -> where its object lives (imported on first use, so naming
#: ``param`` loads no FP8 kernel).
FORMATS: dict[str, str] = {
    "param": "etp.formats.cast:PARAM",
    "bf16": "etp.formats.cast:BF16",
    "fp16": "etp.formats.cast:FP16",
    "fp32": "etp.formats.cast:FP32",
    "fp8_tensorwise": "etp.formats.fp8_tensorwise:FP8Tensorwise",
    "fp8_blockwise": "etp.formats.fp8_blockwise:FP8Blockwise",
}

_resolved: dict[str, GatherFormat] = {}


def _load(path: str, name: str) -> GatherFormat:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"a format's import path is 'module:Name'; got {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import {module_name!r} ({error}): put its directory on PYTHONPATH") from None
    found = getattr(module, attr, None)
    if isinstance(found, type) and issubclass(found, GatherFormat):
        found = found()
    if not isinstance(found, GatherFormat):
        raise ValueError(f"{module_name}.{attr} is not a GatherFormat subclass or instance")
    return found


def gather_format(name: str) -> GatherFormat:
    """The format object ``name`` stands for (``FORMATS`` or ``"module:Name"``); ValueError
    names the allowed values.

    Example::

        gather_format("bf16").wire_dtype(torch.float32)   # torch.bfloat16
    """
    found = _resolved.get(name) if isinstance(name, str) else None
    if found is not None:
        return found
    if not isinstance(name, str) or (name not in FORMATS and ":" not in name):
        raise ValueError(f"allowed values are {list(FORMATS)} or a format's import path 'module:Name'")
    found = _resolved[name] = _load(FORMATS.get(name, name), name)
    return found
