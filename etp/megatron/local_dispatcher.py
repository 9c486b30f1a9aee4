"""``LocalTokenDispatcher``: megatron-core MoE token permutation without expert parallelism,
with no host synchronization and static shapes.

[Note: local dispatcher]
With expert-parallel size 1 (etp's design point: ETP shards the experts instead) every token
stays on its rank, and dropless top-K routing gives exactly ``T x K`` (token, expert) rows:
the only data-dependent quantities are where each expert's rows start, and the grouped GEMMs
take those on the device (``tokens_per_expert`` -> ``torch._grouped_mm`` offsets). megatron's
``alltoall`` dispatcher instead copies the counts to the host and waits for them every layer,
re-sorts its rows by local expert with one ``split`` + ``cat`` of 64 chunks (a full copy
forward and backward), and combines with a bf16 ``scatter_add_``.

Here, per layer and micro-batch:

* ``idx [T, K]``: the K experts of each token, read off the routing map by ``topk`` (the map
  has exactly K trues per row under dropless routing);
* ``order``: a stable ``argsort`` of the flattened ``idx``: rows sorted by expert and, within
  an expert, by token (megatron's ``permute`` order, so experts see the same rows);
* ``inverse``: where each (token, k) pair went;
* dispatch gathers ``x[order // K]``; combine sums the K rows ``y[inverse]`` of each token in
  a fixed order (fp32 accumulation, deterministic, no atomics), in one pass that never writes
  the gathered rows (``etp.kernels.gather_sum``). Each is the other's backward (``_Permute`` /
  ``_Unpermute``).

The permuted tokens are K copies of the layer's input, and the experts' first GEMM would keep
them for its weight gradient: K x hidden 16-bit values per token, the largest tensor a MoE
layer keeps with top-8 routing. ``mark_permuted`` tells the experts where they came from, and
``ETPGroupedExperts`` keeps the unpermuted input (which the router keeps anyway) and the row
indices instead, gathering the rows again in backward (``regathered_rows``): one more
memory-bound gather per layer, the same bits.

Everything is a fixed-shape device op, so the layer needs no host synchronization and is
capturable in a CUDA graph. Limits (checked at construction): expert-parallel and expert
tensor-parallel size 1, dropless routing (no capacity factor, no padding to capacity), no
shared-expert overlap. Routed experts must accept device ``tokens_per_expert`` (etp's
``ETPGroupedExperts`` does).

Example::

    model = GPTModel(config=config, transformer_layer_spec=etp_gpt_layer_spec(num_experts=64), ...)
    install_local_dispatchers(model)      # every MoELayer's token_dispatcher replaced
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from ..kernels.gather_sum import gather_sum
from ..rebuilt_activations import rebuilt_in_backward

__all__ = ["LocalTokenDispatcher", "install_local_dispatchers", "local_permutation", "mark_permuted",
           "regathered_rows"]

_PERMUTED_FROM = "_etp_permuted_from"


def mark_permuted(permuted: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Records on ``permuted`` that it is ``tokens.index_select(0, rows)``; returns it. The
    experts then keep ``tokens`` and ``rows`` for backward instead of ``permuted``
    (``regathered_rows``)."""
    setattr(permuted, _PERMUTED_FROM, (tokens, rows, tokens._version))
    return permuted


def regathered_rows(permuted: torch.Tensor):
    """A ``torch.autograd.graph.saved_tensors_hooks`` context under which autograd keeps
    ``permuted`` (marked by ``mark_permuted``) as its source and row indices, gathering it again
    when backward needs it ([Note: rebuilt activations] in ``etp.rebuilt_activations``); a no-op context for an
    unmarked tensor.

    Example::

        with regathered_rows(x):
            y = grouped_linear(x, w1, counts)    # x is not kept for backward
    """
    source = getattr(permuted, _PERMUTED_FROM, None)
    if source is None:
        return contextlib.nullcontext()
    tokens, rows, version = source
    if tokens._version != version:
        raise RuntimeError("regathered_rows: the permuted tokens' source was modified in place after "
                           "mark_permuted; the marked rows are not its rows any more")
    return rebuilt_in_backward(permuted, lambda: tokens.index_select(0, rows), [tokens, rows],
                               "regathered_rows (the experts' permuted input)")


def local_permutation(routing_map: torch.Tensor, topk: int) -> tuple[torch.Tensor, ...]:
    """``(idx [T, K], order [T*K], token_rows [T*K], inverse [T*K])`` of a ``[T, E]`` routing
    map with ``topk`` trues per row; see [Note: local dispatcher]. Row ``j`` of the permuted
    tokens is the pair ``order[j]`` = (token ``token_rows[j] = order[j] // K``, its k); the pair
    (token t, k) sits at row ``inverse[t * K + k]``."""
    idx = routing_map.to(torch.uint8).topk(topk, dim=1, sorted=False).indices
    order = torch.argsort(idx.reshape(-1), stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return idx, order, torch.div(order, topk, rounding_mode="floor"), inverse


class _Permute(torch.autograd.Function):
    """``x [T, H] -> x[token_rows]`` (the dispatch; ``token_rows = order // K``); backward is
    the combine of the grads."""

    @staticmethod
    def forward(ctx, x, token_rows, inverse, topk):
        ctx.save_for_backward(inverse)
        ctx.topk = topk
        return x.index_select(0, token_rows)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _combine(grad, inverse, ctx.topk), None, None, None


class _Unpermute(torch.autograd.Function):
    """``y [T*K, H] -> sum_k y[inverse[t*K + k]]`` per token (the combine); backward is the
    dispatch of the grads."""

    @staticmethod
    def forward(ctx, y, token_rows, inverse, topk):
        ctx.save_for_backward(token_rows)
        ctx.topk = topk
        return _combine(y, inverse, topk)

    @staticmethod
    def backward(ctx, grad):
        (token_rows,) = ctx.saved_tensors
        return grad.index_select(0, token_rows), None, None, None


def _combine(rows: torch.Tensor, inverse: torch.Tensor, topk: int) -> torch.Tensor:
    # The K rows of token t, in k order, summed in fp32 and rounded once, in one pass that
    # never writes the gathered [T*K, H] copy ([Note: fused gather-sum]).
    return gather_sum(rows, inverse, topk)


class LocalTokenDispatcher(MoETokenDispatcher):
    """megatron-core ``MoETokenDispatcher`` for expert-parallel size 1 with no host
    synchronization; see [Note: local dispatcher].

    Args:
        num_local_experts, local_expert_indices, config, pg_collection: as megatron's
            ``MoEAlltoAllTokenDispatcher``.

    Example::

        layer.mlp.token_dispatcher = LocalTokenDispatcher(64, list(range(64)), config=config)
    """

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        for name, value in (("expert_model_parallel_size", self.ep_size),
                            ("expert_tensor_parallel_size", self.tp_size)):
            if value != 1:
                raise ValueError(f"LocalTokenDispatcher: {name}={value}; it needs 1 (use megatron's "
                                 "alltoall dispatcher for expert parallelism)")
        if config.moe_expert_capacity_factor is not None or getattr(config, "moe_pad_expert_input_to_capacity", False):
            raise ValueError("LocalTokenDispatcher: dropless routing only; set moe_expert_capacity_factor=None")
        if getattr(config, "moe_shared_expert_overlap", False):
            raise ValueError("LocalTokenDispatcher: moe_shared_expert_overlap is not supported")
        if num_local_experts != config.num_moe_experts:
            raise ValueError(f"LocalTokenDispatcher: {num_local_experts} local experts of "
                             f"{config.num_moe_experts}: every expert must be local")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.topk = config.moe_router_topk
        self._perm = None
        self._tokens_per_expert = None
        self.hidden_shape = None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """(tokens [T*K, H] sorted by expert, their probs [T*K])."""
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, self.hidden_shape[-1])
        idx, order, token_rows, inverse = local_permutation(routing_map, self.topk)
        self._perm = (token_rows, inverse)
        # Counted from the rows as sorted, not from the map: a padding token's all-false row
        # (megatron's padding_mask) still gets K rows here, with probability 0.
        sorted_experts = idx.reshape(-1).index_select(0, order)
        bounds = torch.searchsorted(sorted_experts, torch.arange(routing_map.shape[1] + 1, device=order.device))
        self._tokens_per_expert = bounds.diff()
        permuted_probs = probs.gather(1, idx).reshape(-1).index_select(0, order)
        permuted = _Permute.apply(tokens, token_rows, inverse, self.topk)
        return mark_permuted(permuted, tokens, token_rows), permuted_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, probs  # every expert is local

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """(expert input, ``tokens_per_expert`` on the device, probs)."""
        return hidden_states, self._tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        token_rows, inverse = self._perm
        self._perm = None
        return _Unpermute.apply(hidden_states, token_rows, inverse, self.topk)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        return hidden_states.view(self.hidden_shape)


def replace_token_dispatchers(model: torch.nn.Module, make) -> int:
    """Replaces the ``token_dispatcher`` of every megatron-core ``MoELayer`` in ``model`` with
    ``make(old_dispatcher, config, pg_collection)`` (the layer's own groups); returns how many."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_layer import MoELayer

    count = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            old = module.token_dispatcher
            groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
            module.token_dispatcher = make(old, module.config, groups)
            count += 1
    return count


def install_local_dispatchers(model: torch.nn.Module) -> int:
    """Replaces the ``token_dispatcher`` of every megatron-core ``MoELayer`` in ``model`` with a
    ``LocalTokenDispatcher``; returns how many. Call after building the model."""
    return replace_token_dispatchers(model, lambda old, config, groups: LocalTokenDispatcher(
        old.num_local_experts, list(old.local_expert_indices), config=config, pg_collection=groups))
