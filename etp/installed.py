"""What this process could import, asked without importing it: facts about the installation
that the recipe's predictions and megatron-core's integration both depend on.

Example::

    from etp.installed import have_fused_kernels
    have_fused_kernels()   # False on a machine without apex / TransformerEngine
"""
from __future__ import annotations

import importlib.util

__all__ = ["have_fused_kernels"]


def have_fused_kernels() -> bool:
    """Whether apex or TransformerEngine is importable (megatron-core then steps and clips with
    their kernels instead of its torch fallbacks, and keeps fp32 copies of 16-bit gradients)."""
    return any(importlib.util.find_spec(name) is not None for name in ("apex", "transformer_engine"))
