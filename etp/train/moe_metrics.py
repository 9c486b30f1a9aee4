"""The router's losses and the experts' load of each log window of an MoE recipe: what the
``Reporter`` adds to the log line, the metrics stream and the report.

[Note: MoE metrics]
*Router losses.* megatron-core's router saves every training micro-batch's load-balancing loss
and z-loss, each divided by its coefficient, into its layer-wise tracker
(``moe_utils.save_to_aux_losses_tracker``, from megatron-core 0.18 ``MoEMetricsTracker.record``:
``values[layer_number - 1] += loss.detach()``, one float32 tensor per loss name on the device;
etp reads it through ``etp.megatron.compat.moe_router_losses``). Megatron-LM's loop calls ``track_moe_metrics``
every iteration, which reduces the values across ranks, scales them by 1 / micro-batches, adds
their mean over the MoE layers into ``total_loss_dict`` and clears them; the log line prints
that sum over the interval divided by its iterations. etp-train lets the tracker's sums run
over the whole window and reads them once at its end, which gives the same figure:

    ``load_balancing_loss`` = Σ over the window's micro-batches and the MoE layers
                              / (micro-batches per iteration × iterations × MoE layers)

(``seq_load_balancing_loss``, ``global_load_balancing_loss`` and ``z_loss`` alike, whichever the
routers tracked), and per layer ``moe/load_balancing_loss_layer_{i}`` (Megatron-LM's
``moe_per_layer_logging`` names; ``i`` the 0-based layer index). Like Megatron-LM's, the figures
are the losses without their coefficients.

Not ``track_moe_metrics`` itself: called per iteration it would issue collectives and, with a
writer, read every value on the host (``add_scalar`` of a tensor) each step; and its
``reduce_aux_losses_tracker_across_ranks`` averages with ``ReduceOp.AVG``, which gloo does not
have. Its reduction, for one pipeline stage (etp-train's only), is a sum over the loss's
``reduce_group`` (the tensor × context-parallel ranks, each holding a share of the loss) and a
mean over the data-parallel ranks: the sum over every rank × |reduce_group| / world size, which
is what ``window`` computes from one all-reduce. ``z_loss`` has no reduce group: megatron-core
keeps the logging rank's own, etp averages it over all ranks (each rank's value is the mean
over its tokens, the ranks hold equally many, so the average is the run's).

*Expert load.* A forward hook on each router adds its routing map's column sums (the tokens
routed to each expert, after any capacity drop) into one persistent [MoE layers, experts] int64
tensor on the device. Summed over the window and every rank (divided by the tensor-parallel
size without sequence parallelism, whose ranks route the same tokens), per layer:
``moe/expert_load_max_layer_{i}`` and ``moe/expert_load_mean_layer_{i}`` (tokens per expert, most
loaded and mean) and their ratio ``moe/expert_load_max_over_mean_layer_{i}`` (1: balanced; at
most experts / top-k); ``expert_load_max_over_mean`` is the largest ratio over the layers.
The hook counts what the tracker does, a forward in training mode with gradients enabled, so
evaluation and the no-grad first pass of a recomputed layer count nothing.

*No host synchronization per step, captured or not.* Both accumulations are in-place device
ops on tensors that outlive the step; the host reads them only in ``window``, at log time.
Under ``cuda_graph: step`` the tracker's tensors are created by the capture's first eager
warm-up (its dict bookkeeping is the only host work, done then) and the adds into them and into
the counts are recorded into the graph, so each replay adds to the same tensors. ``reset``
after the capture drops what the warm-ups added.

Example::

    moe = MoEMetrics.of(model, micro_batches=2)   # None for a dense model
    ...the window's iterations...
    record.update(moe.window(iterations=25))      # every rank: one all-reduce
    print(moe.line(record))                       # 'load_balancing_loss 1.003 | expert load max/mean 1.27 (layer 0)'
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

__all__ = ["MoEMetrics"]

#: The per-layer expert-load ratio's key (``moe/expert_load_max_over_mean_layer_{i}``).
LOAD_RATIO = "moe/expert_load_max_over_mean_layer_"
_LAYER = re.compile(re.escape(LOAD_RATIO) + r"(\d+)$")


class _CountRoutedTokens:
    """A router's forward hook: its routing map's column sums into row ``slot`` of ``counts``."""

    def __init__(self, counts: torch.Tensor, slot: int) -> None:
        self.counts, self.slot = counts, slot

    def __call__(self, router, inputs, output) -> None:
        if router.training and torch.is_grad_enabled():  # as the router's own loss tracking
            self.counts[self.slot].add_(output[1].sum(dim=0))


class MoEMetrics:
    """The router losses and expert load of a model's log windows ([Note: MoE metrics]).

    Args:
        routers: the model's megatron-core routers (one per MoE layer).
        micro_batches: micro-batches per iteration (the router losses' 1 / count scale).
        device: where the counts accumulate (the routers'; default: the first router weight's).

    Construction clears megatron-core's tracker (a previous run in this process leaves its
    entries, sized for its own layers) and hooks every router.

    Example::

        moe = MoEMetrics.of(model, micro_batches=recipe.num_microbatches(world), device=torch.device("cuda"))
    """

    def __init__(self, routers: list, micro_batches: int, device: torch.device | None = None) -> None:
        from etp.megatron.compat import forget_moe_router_losses

        if not routers:
            raise ValueError("MoEMetrics needs at least one router (a dense model has no MoE metrics)")
        self.routers = sorted(routers, key=lambda router: router.layer_number)
        self.layers = [router.layer_number - 1 for router in self.routers]  # the tracker's indices
        self.micro_batches = micro_batches
        config = self.routers[0].config
        self.num_experts = config.num_moe_experts
        # Without sequence parallelism the tensor-parallel ranks route the same tokens.
        self.duplicates = 1 if config.sequence_parallel else self.routers[0].tp_group.size()
        self.counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.int64,
                                  device=device or self.routers[0].weight.device)
        self._hooks = [router.register_forward_hook(_CountRoutedTokens(self.counts, slot))
                       for slot, router in enumerate(self.routers)]
        forget_moe_router_losses()

    @classmethod
    def of(cls, model: torch.nn.Module, micro_batches: int, device: torch.device | None = None) -> MoEMetrics | None:
        """The metrics of ``model``'s routers, or None when it has none (a dense model)."""
        from megatron.core.transformer.moe.router import Router

        routers = [module for module in model.modules() if isinstance(module, Router)]
        return cls(routers, micro_batches, device) if routers else None

    def reset(self) -> None:
        """Drops what was accumulated so far (the capture's warm-ups), on the device."""
        from etp.megatron.compat import moe_router_losses

        self.counts.zero_()
        for values, _ in moe_router_losses().values():  # megatron-core's clear: the same tensors, zeroed
            values.zero_()

    def remove(self) -> None:
        """Unhooks the routers."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def window(self, iterations: int) -> dict:
        """The window's figures ([Note: MoE metrics]), then a fresh window; every rank calls it
        (one all-reduce over the default group, then one host read)."""
        from etp.megatron.compat import moe_router_losses

        tracker = moe_router_losses()
        names = sorted(tracker)  # the same on every rank: the same routers ran
        layers = len(self.layers)
        flat = torch.cat([tracker[name][0][self.layers].double() for name in names]
                         + [self.counts.flatten().double()])  # counts below 2**53 stay exact
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(flat)
        values = flat.tolist()
        self.reset()
        record, per_layer = {}, {}
        for k, name in enumerate(names):
            group = tracker[name][1]
            share = (1 if group is None else group.size()) / world
            losses = [v * share / (self.micro_batches * iterations) for v in values[k * layers:(k + 1) * layers]]
            record[name] = sum(losses) / layers
            per_layer.update({f"moe/{name}_layer_{i}": loss for i, loss in zip(self.layers, losses)})
        counts = values[len(names) * layers:]
        ratios = []
        for slot, i in enumerate(self.layers):
            row = [round(c) // self.duplicates for c in counts[slot * self.num_experts:(slot + 1) * self.num_experts]]
            most, mean = max(row), sum(row) / self.num_experts
            ratio = most / mean if mean else None
            per_layer.update({f"moe/expert_load_max_layer_{i}": most, f"moe/expert_load_mean_layer_{i}": mean,
                              f"{LOAD_RATIO}{i}": ratio})
            ratios.append(ratio)
        known = [r for r in ratios if r is not None]
        record["expert_load_max_over_mean"] = max(known) if known else None
        return {**record, **per_layer}

    @staticmethod
    def line(record: dict) -> str:
        """The log line's part of a window's figures: the mean router losses and the most
        imbalanced layer's ratio (empty without MoE figures)."""
        parts = [f"{name} {record[name]:.4g}" for name in
                 ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")
                 if record.get(name) is not None]
        ratios = {int(match.group(1)): value for key, value in record.items()
                  if (match := _LAYER.match(key)) and value is not None}
        if ratios:
            worst = max(ratios, key=ratios.get)
            parts.append(f"expert load max/mean {ratios[worst]:.2f} (layer {worst})")
        return " | ".join(parts)
