"""``deterministic: true``: bitwise-reproducible training runs.

What it switches on, before any CUDA work of the run:

* ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (unless set): cuBLAS needs a fixed workspace for
  deterministic GEMMs; it must be in the environment before the first cuBLAS handle.
* ``torch.use_deterministic_algorithms(True)`` (strict: an op with no deterministic
  implementation raises instead of silently varying) and cuDNN deterministic / no autotuning.
* megatron-core's ``TransformerConfig.deterministic_mode`` (the driver passes it: e.g. the
  vocab-parallel embedding's forward avoids ``F.embedding``'s non-deterministic backward).
* SDPA: ``etp.megatron.attention.SDPAttention`` restricts itself to flash / memory-efficient
  / math kernels, whose backwards are deterministic in this mode (cuDNN attention is not).
* MoE: megatron-core's unpermute uses ``index_add_``, deterministic under this flag.

NCCL reductions are deterministic for a fixed world size, topology and message sizes (the
algorithm choice is), so ``NCCL_ALGO`` is left alone; set ``NCCL_ALGO=Ring`` yourself to pin it
across machines. Reproducible means same recipe, same world size, same machine type.

Not switched on: torch's ``fill_uninitialized_memory`` (on by default under deterministic
algorithms), which writes NaN into every new ``torch.empty`` result: one extra kernel and a
full write per allocation, for memory etp always overwrites before reading. The FP8 path
allocates many short-lived operands per GEMM, so it paid most. ``ETP_DETERMINISTIC_FILL=1``
keeps torch's NaN fill (a debugging aid: a read of unwritten memory then shows as NaN).

``ETP_DETERMINISTIC_WARN_ONLY=1`` in the environment switches torch's strict mode to
``warn_only=True`` (ops without a deterministic implementation warn instead of raising), for
diagnosing which op breaks a run; such a run is not guaranteed reproducible.
"""
from __future__ import annotations

import os

import torch

__all__ = ["enable_determinism"]


def enable_determinism() -> dict:
    """Switches the process to deterministic algorithms; returns what it set (for the report).

    Example::

        if recipe.train.deterministic:
            enable_determinism()
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    warn_only = os.environ.get("ETP_DETERMINISTIC_WARN_ONLY", "0") not in ("", "0")
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    fill = os.environ.get("ETP_DETERMINISTIC_FILL", "0") not in ("", "0")
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return {"use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
            "warn_only": warn_only, "fill_uninitialized_memory": fill, "NCCL_ALGO": os.environ.get("NCCL_ALGO")}
