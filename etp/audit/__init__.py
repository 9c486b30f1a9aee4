"""The memory audit: how many bytes a rank needs, predicted and measured, in the same categories.

* ``predict.py``: ``predict_memory(recipe, world_size)`` from a recipe alone (no GPU), and the
  peak; it counts ``inventory.py``'s weights, ``activations.py``'s activations and
  ``buffers.py``'s runtime buffers.
* ``measure.py``: ``MemoryAudit`` measures a running job by phase and by category.
* ``cli.py``: ``etp-audit``, the command line over the prediction (with and without ETP).

Example::

    from etp.audit import MemoryAudit, predict_memory
    audit = MemoryAudit(model, optimizer)
    ...
    print(audit.format_table(predict_memory(recipe, world_size)))
"""
from .activations import padded_expert_rows
from .categories import CATEGORIES
from .ep_buffers import ep_dispatcher_bytes
from .measure import SCHEMA_VERSION, MemoryAudit
from .predict import (
           WeightSpec,
           activation_bytes,
           fit_bytes,
           fits,
           largest_micro_batch,
           predict_memory,
           predict_peak,
           weight_inventory,
)

__all__ = ["CATEGORIES", "SCHEMA_VERSION", "MemoryAudit", "WeightSpec", "activation_bytes", "ep_dispatcher_bytes",
           "fit_bytes", "fits", "largest_micro_batch", "padded_expert_rows", "predict_memory", "predict_peak",
           "weight_inventory"]
