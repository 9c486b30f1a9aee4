"""What the megatron-core versions :mod:`etp.megatron.patches` supports (``>=0.16.1,<0.20``,
tested on 0.16.1 and 0.19.2) name or build differently, read through one helper each: the rest
of etp calls these and never asks for the version. Nothing here rebinds a name in megatron-core
(that is ``patches``' job).

* ``spec_submodules(spec)``: a layer spec's MLP / MoE entry is a ``ModuleSpec`` up to 0.17, a
  ``functools.partial`` from 0.18.
* ``grads_for_norm(link)`` / ``separate_grad_norm_groups(link)``: an optimizer's gradients to
  norm (``get_main_grads_for_grad_norm`` up to 0.18, ``get_grads_for_grad_norm`` in 0.19, which
  norms multi-token prediction's parameters apart).
* ``whole_layer_cuda_graphs()``: ``TransformerConfig``'s ``cuda_graph_scope`` up to 0.17,
  ``cuda_graph_modules`` from 0.18.
* ``moe_router_losses()`` / ``forget_moe_router_losses()``: the routers' loss tracker, a dict in
  ``moe_utils`` up to 0.17, a ``MoEMetricsTracker`` from 0.18.

``etp.data.tokenizer`` carries the tokenizer's two (the data room sits beneath this one):
``build_tokenizer`` moved to ``megatron.core.tokenizers.utils`` in 0.17 and renamed arguments, and
0.18's NullTokenizer counts its end-of-document id in Megatron-LM's ``--vocab-size``.

Example::

    from etp.megatron.compat import spec_submodules
    spec_submodules(spec.submodules.mlp).experts = ModuleSpec(module=ETPGroupedExperts)
"""
from __future__ import annotations

import functools

__all__ = ["forget_moe_router_losses", "grads_for_norm", "moe_router_losses", "separate_grad_norm_groups",
           "spec_submodules", "whole_layer_cuda_graphs"]


def spec_submodules(spec):
    """The ``submodules`` of one entry of a megatron-core layer spec.

    megatron-core up to 0.17 writes every entry as a ``ModuleSpec``; from 0.18 the MLP / MoE entry
    of a ``TransformerLayer`` is a ``functools.partial`` of the module's class (its submodules
    among the keywords), and ``ModuleSpec`` stays for the others.

    Example::

        spec = get_gpt_layer_local_spec(num_experts=8)
        spec_submodules(spec.submodules.mlp).experts = ModuleSpec(module=ETPGroupedExperts)
    """
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    return spec.submodules


def _moe_metrics_tracker():
    """megatron-core's ``MoEMetricsTracker`` (0.18 on), None before it had one."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ModuleNotFoundError:
        return None
    return get_moe_metrics_tracker()


def moe_router_losses() -> dict:
    """The router losses megatron-core's tracker holds, live: loss name -> (its float32
    [layers] tensor of sums the routers add into, its ``reduce_group`` or None). Up to 0.17 the
    tracker is ``moe_utils``' layer-wise dict; from 0.18 a ``MoEMetricsTracker``, whose dict of
    that form 0.18 and 0.19 still return only as a snapshot (and with a deprecation warning).

    Example::

        {name: values.sum() for name, (values, _) in moe_router_losses().items()}
    """
    tracker = _moe_metrics_tracker()
    if tracker is not None:
        return {name: (entry.values, entry.reduce_group) for name, entry in tracker.metrics.items()}
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: (entry["values"], entry.get("reduce_group"))
            for name, entry in get_moe_layer_wise_logging_tracker().items()}


def forget_moe_router_losses() -> None:
    """Drops every entry of megatron-core's router-loss tracker (a previous run in this process
    leaves its own, sized for its layers); the routers make new ones as they record."""
    tracker = _moe_metrics_tracker()
    if tracker is not None:
        tracker.metrics.clear()  # the tracker's own dict, not a copy
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def grads_for_norm(link) -> list:
    """The gradients one megatron-core optimizer (a link of a chained one) counts in its clipping
    norm: ``get_main_grads_for_grad_norm()`` up to 0.18, ``get_grads_for_grad_norm()`` from 0.19
    (which leaves out parameters tagged with a separate grad-norm group: see
    ``separate_grad_norm_groups``).

    Example::

        squares = sum(g.square().sum() for link in inner_optimizers(opt) for g in grads_for_norm(link))
    """
    method = getattr(link, "get_grads_for_grad_norm", None) or link.get_main_grads_for_grad_norm
    return method()


def separate_grad_norm_groups(link) -> set[str]:
    """The grad-norm groups megatron-core 0.19 norms and clips apart from the rest (multi-token
    prediction's, ``grad_norm_group = "mtp"``) that parameters of ``link`` are tagged with; empty
    before 0.19, which has none."""
    return {group for p in link.get_parameters() if (group := getattr(p, "grad_norm_group", None)) is not None}


def whole_layer_cuda_graphs() -> dict:
    """The ``TransformerConfig`` keyword of megatron-core's CUDA-graph scope "the whole layer"
    (what it makes of its default, ``"full"``, which it deprecates with a warning), under this
    megatron-core's name for it: ``cuda_graph_scope`` up to 0.17, ``cuda_graph_modules`` from
    0.18 (which deprecates the old name with a warning of its own).

    Example::

        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **whole_layer_cuda_graphs())
    """
    from dataclasses import fields

    from megatron.core.transformer.transformer_config import TransformerConfig

    renamed = "cuda_graph_modules" in {field.name for field in fields(TransformerConfig)}
    return {"cuda_graph_modules" if renamed else "cuda_graph_scope": []}
