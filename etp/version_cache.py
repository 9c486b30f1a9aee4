"""Values derived from a tensor, kept on it until it changes in place.

The FP8 GEMMs need, per step or per routing, small tensors made from others: the grouped
GEMMs' int32 offsets from ``counts``, a weight's per-column scales from its ``scale_inv``, the
FP8 weight gradient's padded layout. Each costs launches and host time; made once and kept on
the tensor they come from (in its ``__dict__``), they live exactly as long as it and are
remade when an in-place write bumps its version.
"""
from __future__ import annotations

import torch

__all__ = ["per_version"]

_DERIVED = "_etp_derived"  # tensor attribute: values derived from the tensor, per its version


def per_version(owner: torch.Tensor, key, make):
    """``make()``, kept on ``owner`` under ``key`` until ``owner`` changes in place (its version).
    Made each time for an inference tensor (no version counter) and while a CUDA graph is
    captured (a graph must compute what it reads: ``owner`` may be rewritten between replays
    with nobody asking for the derived value again).

    Example::

        offs = per_version(counts, "offsets", lambda: torch.cumsum(counts, 0, dtype=torch.int32))
    """
    if owner.is_inference() or (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
        return make()
    cache = owner.__dict__.setdefault(_DERIVED, {})
    hit = cache.get(key)
    if hit is not None and hit[0] == owner._version:
        return hit[1]
    value = make()
    cache[key] = (owner._version, value)
    return value
