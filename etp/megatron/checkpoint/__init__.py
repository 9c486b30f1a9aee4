"""Checkpoints of ETP models: reshardable model and optimizer state, crash-safe publishing,
verification and safe loading.

* ``training.py``: ``save_training_checkpoint`` / ``load_training_checkpoint`` (the entry points);
  see [Note: ETP training checkpoints].
* ``model_state.py``: ETP weights as pieces of megatron's full logical tensors.
  ``pieces.py`` cuts a shard into those pieces; ``stock_segments.py`` reads megatron's own
  description of a weight.
* ``optimizer_state.py``: optimizer state described like its parameters.
* ``publish.py``: crash-safe publishing and verified loading; see [Note: crash-safe checkpoints].
* ``background.py``: ``async_save``'s writer (megatron-core's async request, run in a thread of
  this process); see [Note: async saves].
* ``manifest.py``: directories, manifests and verification.
* ``unpickle.py``: restricted unpickling of the files megatron and torch DCP unpickle.
"""
from .manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    LoadedCheckpoint,
    find_latest,
    iteration_dir,
    list_checkpoints,
    verify_checkpoint,
)
from .publish import PendingCheckpoint, begin_checkpoint, load_checkpoint, save_checkpoint
from .training import (
    begin_training_checkpoint,
    load_model_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
    sync_save_strategy,
)
from .unpickle import safe_unpickling

__all__ = [
    "LATEST_NAME",
    "MANIFEST_NAME",
    "CheckpointError",
    "LoadedCheckpoint",
    "PendingCheckpoint",
    "begin_checkpoint",
    "begin_training_checkpoint",
    "find_latest",
    "iteration_dir",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_checkpoint",
    "load_training_checkpoint",
    "safe_unpickling",
    "save_checkpoint",
    "save_training_checkpoint",
    "sync_save_strategy",
    "verify_checkpoint",
]
