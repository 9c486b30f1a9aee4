"""Plain gather formats: the shard travels as it is (``param``) or cast to a float dtype
(``bf16``, ``fp16``, ``fp32``); the GEMMs get the gathered weight in their compute dtype.
Nothing is kept per step and nothing is scaled. See [Note: ETP gather formats]."""
from __future__ import annotations

import torch

from .base import GatherFormat

__all__ = ["CastFormat", "PARAM", "BF16", "FP16", "FP32"]


class CastFormat(GatherFormat):
    """The weight travels in ``dtype`` (None: the parameter's own).

    Example::

        CastFormat("bf16", torch.bfloat16).gathered_bytes(64, 32, param_bytes=4)   # 4096
    """

    def __init__(self, name: str, dtype: torch.dtype | None) -> None:
        self.name, self.dtype = name, dtype


PARAM = CastFormat("param", None)
BF16 = CastFormat("bf16", torch.bfloat16)
FP16 = CastFormat("fp16", torch.float16)
FP32 = CastFormat("fp32", torch.float32)
