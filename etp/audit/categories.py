"""The memory categories that the audit predicts and measures, under the same names."""

#: Per-rank byte categories, in table order. ``predict.predict_memory`` returns one value per
#: category; ``measure.MemoryAudit`` measures the same names from live tensors.
CATEGORIES = ("params", "main_grad", "optimizer", "gather_fwd", "gather_bwd", "gather_recompute", "wgrad_pool",
              "fp8_shards", "activations")
