"""``EtpTokenDispatcher``: a megatron-core (0.16) MoE token dispatcher over ``etp.ep``.

megatron's ``MoELayer`` calls, per forward::

    tokens, probs = d.dispatch_preprocess(hidden, routing_map, probs)   # [*, H], [T, E] x2
    tokens, probs = d.token_dispatch(tokens, probs)
    x, tokens_per_expert, probs = d.dispatch_postprocess(tokens, probs)
    y, bias = experts(x, tokens_per_expert, probs)
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))

Here ``dispatch_preprocess`` turns the routing map into ``[T, K]`` expert indices and
weights and runs ``ExpertDispatcher.prepare`` (its small count all-gather); the moves are
``ExpertDispatcher.dispatch`` / ``combine``. Two modes for the experts' input:

* ``trim=True`` (default, what megatron's expert MLPs expect): ``ExpertDispatcher.dispatch``
  with ``trim=True`` returns the valid rows only (``tokens_per_expert.sum()`` of them, one
  host sync) and ``tokens_per_expert`` on the host; ``combine`` takes the experts' valid
  rows as they are (nothing is padded back to the receive capacity, in either direction).
* ``trim=False``: the static ``[capacity, H]`` buffers and device ``tokens_per_expert``
  (rows past the valid ones are zero with zero probability): no host sync, for experts that
  take padded input with device counts (etp's ``ETPGroupedExperts``: its grouped GEMMs run
  the valid rows only). With ``capturable=True`` too (etp-train's ``cuda_graph: step``),
  ``backend="auto"`` chooses among the backends that read no split sizes on the host
  (``EPConfig.capturable``), and the layer is captured with the rest of the step.

Composes with ETP's sharding of the expert weights (``etp.expert_etp_size``: the weights of
this rank's experts sharded over its expert-data-parallel ranks, e.g. EP 2 x expert ETP 2 at
world 4): the dispatcher moves tokens over the EP group, the ETP engine gathers weights over
the other axis, and neither knows of the other (``tests/megatron/test_ep_megatron.py`` trains
it against EP 1 with megatron's dispatcher). ``dispatcher.backend_report`` says which backends
``backend="auto"`` chose for each move.

Not supported: megatron's expert tensor parallelism (``expert_tensor_parallel_size > 1``),
token dropping with padding (``moe_pad_expert_input_to_capacity``), shared-expert overlap.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from etp import ep

__all__ = ["EtpTokenDispatcher", "install_etp_dispatchers"]


class EtpTokenDispatcher(MoETokenDispatcher):
    """megatron ``MoETokenDispatcher`` built on :class:`etp.ep.ExpertDispatcher`.

    Args:
        num_local_experts, local_expert_indices, config, pg_collection: as megatron's
            ``MoEAlltoAllTokenDispatcher``.
        max_tokens_per_rank: the most tokens one rank routes per call (sequence length x
            micro-batch, divided by TP with sequence parallelism); sizes every buffer.
        backend, capacity_factor, num_ctas, weight_dtype: see :class:`etp.ep.EPConfig` (``num_ctas``
            None: its default)
            (a ``capacity_factor`` drops the rows past each expert's capacity).
        trim: give the experts only the valid rows (see the module docstring).
        capturable: the step will be captured in a CUDA graph: needs ``trim=False``; see
            ``EPConfig.capturable``.
        agree_group: see :class:`etp.ep.ExpertDispatcher` (``install_etp_dispatchers`` passes
            the world when every rank holds the same MoE layers).

    Example::

        d = EtpTokenDispatcher(n_local, local_ids, config=cfg, pg_collection=pgs,
                               max_tokens_per_rank=seq_len * micro_batch)
    """

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None, *,
                 max_tokens_per_rank: int, backend: str = "auto", capacity_factor: Optional[float] = None,
                 num_ctas: Optional[int] = None, trim: bool = True, weight_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, agree_group=None, capturable: bool = False):
        super().__init__(config=config, pg_collection=pg_collection)
        if capturable and trim:
            raise ValueError("EtpTokenDispatcher: capturable=True needs trim=False (trim reads the token counts "
                             "on the host, which a CUDA graph cannot)")
        if self.tp_size > 1:
            raise ValueError(f"EtpTokenDispatcher: expert tensor parallel size {self.tp_size} > 1 is not supported")
        if getattr(config, "moe_shared_expert_overlap", False):
            raise ValueError("EtpTokenDispatcher: moe_shared_expert_overlap is not supported")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.trim = trim
        self.topk = config.moe_router_topk
        params_dtype = getattr(config, "params_dtype", None) or torch.float32
        self.ep_config = ep.EPConfig(
            num_experts=config.num_moe_experts, topk=self.topk, hidden_size=config.hidden_size,
            max_tokens_per_rank=max_tokens_per_rank, dtype=torch.bfloat16 if config.bf16 else params_dtype,
            backend=backend, capacity_factor=capacity_factor, drop_tokens=capacity_factor is not None,
            weight_dtype=weight_dtype, capturable=capturable,
            **({} if num_ctas is None else {"num_ctas": num_ctas}))
        self.dispatcher = ep.ExpertDispatcher(self.ep_config, self.ep_group, name="moe", device=device,
                                              agree_group=agree_group)
        if self.dispatcher.ctx.experts_per_rank != num_local_experts:
            raise ValueError(f"EtpTokenDispatcher: {num_local_experts} local experts, the EP group of "
                             f"{self.ep_size} gives {self.dispatcher.ctx.experts_per_rank}")
        self._handle = None
        self._tokens_per_expert = None
        self.hidden_shape = None

    # ---------------------------------------------------------------- dispatch
    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """``routing_map`` [T, E] bool with K trues per token and ``probs`` [T, E] ->
        (tokens [T, H], topk weights [T, K]); runs ``prepare``."""
        self.hidden_shape = tokens.shape
        tokens = tokens.reshape(-1, self.hidden_shape[-1])
        if routing_map.dtype != torch.bool or routing_map.shape != probs.shape:
            raise ValueError(f"routing_map: expected a bool tensor of probs' shape {tuple(probs.shape)}, got "
                             f"{routing_map.dtype} {tuple(routing_map.shape)}")
        # The K routed experts of each token, in expert order (the map has K trues per row).
        masked = torch.where(routing_map, probs.float(), float("-inf"))
        idx = masked.topk(self.topk, dim=1).indices.sort(dim=1).values
        weights = probs.gather(1, idx)
        self._handle = self.dispatcher.prepare(idx)
        return tokens.to(self.ep_config.dtype), weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        recv_x, recv_w, tokens_per_expert = self.dispatcher.dispatch(hidden_states, probs, self._handle,
                                                                     trim=self.trim)
        self._tokens_per_expert = tokens_per_expert
        return recv_x, recv_w

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """(expert input, tokens_per_expert, probs) for megatron's experts (host counts with
        ``trim``, device counts without)."""
        return hidden_states, self._tokens_per_expert, probs

    # ---------------------------------------------------------------- combine
    def combine_preprocess(self, hidden_states: torch.Tensor):
        return hidden_states.to(self.ep_config.dtype)

    def token_combine(self, hidden_states: torch.Tensor):
        return self.dispatcher.combine(hidden_states, self._handle)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        # Shared experts run in MoELayer itself without moe_shared_expert_overlap (refused above).
        return hidden_states.view(self.hidden_shape)


def install_etp_dispatchers(model: torch.nn.Module, *, max_tokens_per_rank: int, backend: str = "auto",
                            capturable: bool = False) -> int:
    """Replaces the ``token_dispatcher`` of every megatron-core ``MoELayer`` in ``model`` with an
    ``EtpTokenDispatcher`` on the layer's own expert-parallel group (recipe key
    ``moe_token_dispatcher_type: etp``); returns how many. ``capturable``: the step will be
    captured in a CUDA graph (``cuda_graph: step``): the experts get the padded buffers and
    device counts (``trim=False``) and the backends read no split sizes on the host; without
    it the experts get the valid rows (one host sync per layer). Call after building the model, on
    every rank (without pipeline parallelism every rank holds the same MoE layers, so
    ``backend="auto"`` chooses once for all EP groups over the world: [Note: one choice for
    every EP group] in ``etp.ep.profiler``).

    Example::

        install_etp_dispatchers(gpt_model, max_tokens_per_rank=seq_length * micro_batch_size)
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from .local_dispatcher import replace_token_dispatchers

    same_layers = dist.is_initialized() and ps.get_pipeline_model_parallel_world_size() == 1
    agree = dist.group.WORLD if same_layers else None
    return replace_token_dispatchers(model, lambda old, config, groups: EtpTokenDispatcher(
        old.num_local_experts, list(old.local_expert_indices), config=config, pg_collection=groups,
        max_tokens_per_rank=max_tokens_per_rank, backend=backend, agree_group=agree,
        trim=not capturable, capturable=capturable))
