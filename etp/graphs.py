"""CUDA-graph capture of a whole forward + backward step of a model with ETP weights.

[Note: ETP CUDA graphs]
A graph replays kernels; none of etp's Python runs at replay. So everything the runtime
decides must be decided once, at capture, and hold for every replay:

* **Own chains and streams.** The captured model's ETP weights are moved onto chains of
  class ``"graphed"`` (``ETPRuntime.use_chain_class``) before warm-up: their orders are
  recorded by the warm-up passes, their AG / RS side streams are made then (before capture),
  and no chain links a captured weight to an eager one, so no gather issued in the graph is
  waited for outside it, or the other way round. ``prefetch_after_step`` skips graphed
  chains: their heads are gathered inside the graph.
* **Every fork joins inside the capture.** Side streams join the capture by waiting on an
  event recorded on the capturing stream; the step ends with ``runtime.drain()`` inside the
  capture, so every reduce-scatter is finalized (added into ``main_grad`` / ``grad``) and
  every unconsumed prefetch waited for before the capture closes.
* **No allocation in the replayed work that outlives it.** Gather buffers (the ticket cache),
  the wgrad pool's buffers, CUDA streams and the NCCL communicators all exist after warm-up;
  what the capture allocates comes from the graph's private pool at fixed addresses.
* **Hooks after replay.** Grad-ready hooks (megatron DDP's bucket trigger) are muted during
  warm-up and collected during capture, then fired, in the captured order, after each replay,
  when the replayed reduce-scatters have been added into ``main_grad`` (stream order).
* **Warm-up leaves gradients as they were.** ``main_grad`` is restored in place (its address
  is captured) and ``grad`` to its previous tensor (or None) after the warm-up passes.
* **FP8.** Quantizing shards is per optimizer step, not per replay: ``GraphedStep`` calls
  ``runtime.refresh_fp8()`` before each replay, which re-quantizes in place (same FP8 shard
  and scale tensors, see ``etp.formats.store_quantized``) once the optimizer has changed the shards.

Gradient semantics follow torch's whole-network capture: a parameter whose ``grad`` is
None at capture gets a graph-owned ``grad`` that each replay *overwrites*; ``main_grad``
(megatron-core) is added into, so replays accumulate microbatches and ``zero_grad_buffer``
between steps works as in eager training.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import torch
from torch import nn

from .param import ETPShardedParam
from .streams import warmup_stream
from .wrap import _runtime_of

__all__ = ["GraphedStep"]

log = logging.getLogger("etp.graphs")


class GraphedStep:
    """Captures ``step_fn(*static_inputs)`` (a forward and its backward over ``model``) in
    one CUDA graph; calling the object replays it.

    Args:
        model: a model wrapped with ``etp.wrap_module_params_etp`` (or ``apply_etp``); a
            model without ETP weights is captured as plain ``torch.cuda.graph`` of the step
            (warm-up on a side stream, gradients restored).
        step_fn: runs forward and backward on the given tensors and returns a tensor (or a
            tuple of tensors), e.g. the detached loss. It must launch the same work every
            time: static shapes, no host synchronization (``.item()``, ``.cpu()``).
        static_inputs: the input tensors the graph reads; ``__call__`` copies new values into
            them before each replay.
        warmup: eager passes before capture (records the chains, allocates every buffer).
        pool: a graph memory pool to share (``torch.cuda.graph_pool_handle()``).

    Example::

        def step(tokens):
            loss = model(tokens).float().mean()
            loss.backward()
            return loss.detach()

        graphed = etp.GraphedStep(model, step, torch.zeros_like(first_batch))
        for batch in batches:
            optimizer.zero_grad(set_to_none=False)   # or model.zero_grad_buffer() (megatron)
            loss = graphed(batch)                    # replay; grad-ready hooks fire after it
            etp.finalize_grads(model, config, groups)
            optimizer.step()
    """

    def __init__(self, model: nn.Module, step_fn: Callable, *static_inputs: torch.Tensor,
                 warmup: int = 3, pool=None) -> None:
        if not torch.cuda.is_available():
            raise ValueError("etp.GraphedStep needs CUDA: CUDA graphs do not exist on CPU; run the step eagerly")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"GraphedStep warmup={warmup!r}: need at least 1 eager pass before capture")
        for index, tensor in enumerate(static_inputs):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
                raise ValueError(f"GraphedStep static input {index} must be a CUDA tensor, got {tensor!r}")
        self.model, self.step_fn, self.static_inputs = model, step_fn, static_inputs
        # A model without ETP weights (e.g. etp-train's ETP-off baseline) is captured the same
        # way, with nothing of the runtime to arrange.
        self.runtime = _runtime_of(model)
        params = [p for p in model.parameters() if isinstance(p, ETPShardedParam)]
        if self.runtime is not None:
            self.runtime.use_chain_class(params, "graphed")
        device = static_inputs[0].device if static_inputs else next(model.parameters()).device
        saved = _save_grads(model)
        side = warmup_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), self._hooks_muted():
            for _ in range(warmup):
                step_fn(*static_inputs)
                self._drain()
        torch.cuda.current_stream(device).wait_stream(side)
        _restore_grads(saved)
        if self.runtime is not None:
            self.runtime.refresh_fp8()
        self.graph = torch.cuda.CUDAGraph()
        with self._hooks_deferred() as ready, torch.cuda.graph(self.graph, pool=pool):
            self.outputs = step_fn(*static_inputs)
            self._drain()
        self.ready = list(ready)
        log.info("etp: captured a step over %d ETP weights (%d grad-ready hooks fire after each replay)",
                 len(params), len(self.ready))

    def _hooks_muted(self):
        return contextlib.nullcontext() if self.runtime is None else self.runtime.hooks_muted()

    def _hooks_deferred(self):
        return contextlib.nullcontext([]) if self.runtime is None else self.runtime.hooks_deferred()

    def _drain(self) -> None:
        if self.runtime is not None:
            self.runtime.drain()

    def __call__(self, *inputs: torch.Tensor):
        """Copies ``inputs`` into the static inputs, re-quantizes FP8 shards if the optimizer
        changed them, replays the graph and fires the grad-ready hooks; returns the captured
        outputs (the same tensors every call: clone what you keep)."""
        if inputs and len(inputs) != len(self.static_inputs):
            raise ValueError(f"GraphedStep takes {len(self.static_inputs)} inputs, got {len(inputs)}")
        for static, new in zip(self.static_inputs, inputs):
            if new.shape != static.shape:
                raise ValueError(f"GraphedStep input of shape {tuple(new.shape)}: the graph was captured "
                                 f"for {tuple(static.shape)}; capture another GraphedStep for that shape")
            static.copy_(new)
        if self.runtime is not None:
            self.runtime.refresh_fp8()
        self.replay()
        return self.outputs

    def replay(self) -> None:
        """Replays the captured step as is and fires its grad-ready hooks (no input copy,
        no FP8 refresh)."""
        self.graph.replay()
        if self.runtime is not None:
            self.runtime.fire_grad_ready(self.ready)


def _save_grads(model: nn.Module) -> list:
    saved = []
    for param in model.parameters():
        main_grad = getattr(param, "main_grad", None)
        saved.append((param, param.grad, None if param.grad is None else param.grad.clone(),
                      main_grad, None if main_grad is None else main_grad.clone()))
    return saved


def _restore_grads(saved: Sequence) -> None:
    with torch.no_grad():
        for param, grad, grad_copy, main_grad, main_copy in saved:
            if main_grad is not None:
                main_grad.copy_(main_copy)  # in place: megatron's buffers and the graph keep its address
            if grad is None:
                param.grad = None
            else:
                grad.copy_(grad_copy)
                param.grad = grad
