"""``cuda_graph: step``: etp-train captures one micro-batch's forward + backward of the
megatron-core model in a CUDA graph (``etp.GraphedStep``) and replays it.

[Note: etp-train graph step]
What a whole-step capture of megatron-core's ``GPTModel`` needs beyond ``GraphedStep``:

* **No host synchronization in the step.** megatron's MoE dispatchers copy token counts to
  the host every layer; ``moe_token_dispatcher_type: local`` (``LocalTokenDispatcher``) does
  not, so the recipe requires it with graphs.
* **Gradients through ``torch.autograd.grad``, added into ``main_grad`` inside the graph.**
  ``.backward()`` would run every leaf's ``AccumulateGrad`` on the stream the leaf was
  created on (the legacy default stream, which may not wait on a capturing stream), and
  megatron DDP's grad hooks skip their ``main_grad`` add while a graph is being captured.
  ETP weights are inputs of the ``autograd.grad`` call too (so every ETP op's backward runs;
  their gradients reach ``main_grad`` through the ETP runtime, inside the graph as well).
* **A capture-safe embedding backward.** ``F.embedding``'s CUDA backward sorts the token ids
  and reads the number of unique ids on the host. With tensor parallelism 1,
  ``_CaptureSafeEmbedding`` keeps the forward and adds the gradient rows with ``index_add_``
  into an fp32 buffer instead (no host read; atomics). Under ``deterministic: true`` it
  takes ``etp.kernels.embedding_backward`` (a stable sort and one ordered fp32 sum per row:
  no atomics), and etp-train then uses it in eager runs too, so a captured run and an eager
  one run the same kernels and train bit for bit alike.
* **No AccumulateGrad node on the legacy stream.** megatron DDP holds every parameter's
  ``AccumulateGrad`` node (made on the legacy default stream at construction); autograd
  syncs a leaf node's stream with the gradient's producer, which a capture forbids for the
  legacy stream. ``capture_step`` drops those nodes so the warm-up makes them on its side
  stream.
* **DDP reductions after the replays.** ``overlap_grad_reduce`` must be off: megatron's
  bucket hooks do not run at replay, and ``finalize_model_grads`` starts every bucket's
  reduction after the last micro-batch.

Example (what ``etp-train --set cuda_graph=step`` does)::

    graphed = capture_step(model, loss_fn, first_batch, micro=2, device=torch.device("cuda"))
    for batch in micro_batches:
        total += graphed(*batch.tensors()) / 2
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from etp.data.batch import as_batch
from etp.graphs import GraphedStep
from etp.kernels.embedding import embedding_backward
from etp.param import ETPShardedParam

__all__ = ["capture_step", "make_embeddings_capture_safe"]


class _CaptureSafeEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward needs no host synchronization."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        if torch.are_deterministic_algorithms_enabled():
            # Ordered sums, no atomics. (index_add_ turns into a sorted index_put_ in this mode:
            # deterministic too, but whether it syncs with the host is torch's internals.)
            summed = embedding_backward(ids, grad, ctx.weight_shape[0])
            return None, summed.to(ctx.weight_dtype)
        # Outside deterministic mode index_add_ stays: one parallel pass with no sort, whereas
        # the ordered kernel sums each id's tokens in one program, so an id that fills much of
        # the batch (padding, end-of-document) becomes one long serial loop. Both write the
        # whole [vocab, H] fp32 buffer, so on spread-out ids they should cost about the same
        # (an estimate: the two have not been timed against each other on a GPU).
        # At least fp32 for the sums (bf16 weights), never less than the weight's own precision.
        dtype = torch.promote_types(ctx.weight_dtype, torch.float32)
        accumulated = torch.zeros(ctx.weight_shape, dtype=dtype, device=grad.device)
        accumulated.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(dtype))
        return None, accumulated.to(ctx.weight_dtype)


def make_embeddings_capture_safe(model: torch.nn.Module) -> int:
    """Switches the forward of every megatron ``VocabParallelEmbedding`` with tensor-parallel
    size 1 in ``model`` to ``_CaptureSafeEmbedding``; returns how many."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    count = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            if module.num_embeddings_per_partition != module.num_embeddings or module.reduce_scatter_embeddings:
                raise ValueError("cuda_graph=step: the capture-safe embedding supports tensor_model_parallel_size 1 "
                                 "without sequence parallelism")
            weight = module.weight
            module.forward = lambda ids, weight=weight: _CaptureSafeEmbedding.apply(ids, weight)
            count += 1
    return count


def capture_step(model, loss_fn, first_batch, micro: int, device) -> GraphedStep:
    """One micro-batch's forward + backward as an ``etp.GraphedStep`` (three eager warm-ups on
    a side stream, gradients restored, then the capture); see [Note: etp-train graph step].

    Args:
        model: the DDP-wrapped megatron-core model (every trainable plain parameter has a
            ``main_grad``).
        loss_fn: ``loss_fn(model, batch) -> (loss, objective)``.
        first_batch: an ``etp.data.batch.Batch`` (or a ``[micro_batch, seq + 1]`` token batch): its
            tensors' shapes are the graph's; replay with ``graphed(*batch.tensors())``.
        micro: micro-batches per step (the objective is divided by it, as in eager training).
    """
    if device.type != "cuda":
        raise ValueError("cuda_graph=step needs CUDA (CUDA graphs do not exist on CPU): set cuda_graph=none")
    make_embeddings_capture_safe(model)
    # megatron DDP keeps each parameter's AccumulateGrad node alive (its hooks hang there),
    # made on the legacy default stream when DDP was built; autograd syncs a leaf's node's
    # stream with the producer's, which a capture forbids for the legacy stream. Dropped here,
    # the nodes are made again in the warm-up, on its side stream (torch's whole-network
    # capture recipe); DDP's hooks are not needed with graphs (see the note).
    for module in model.modules():
        if isinstance(getattr(module, "grad_accs", None), list):
            module.grad_accs.clear()
    trainable = [p for p in model.parameters() if p.requires_grad]
    plain = [not isinstance(p, ETPShardedParam) for p in trainable]
    missing = sum(1 for p, is_plain in zip(trainable, plain) if is_plain and getattr(p, "main_grad", None) is None)
    if missing:
        raise ValueError(f"cuda_graph=step: {missing} trainable parameters have no main_grad "
                         "(megatron-core DDP gives every one a main_grad); wrap the model with DDP first")

    first_batch = as_batch(first_batch)  # the graph's static inputs: the batch's tensors

    def step(*tensors):
        loss, objective = loss_fn(model, first_batch.with_tensors(tensors))
        grads = torch.autograd.grad(objective / micro, trainable, allow_unused=True)
        with torch.no_grad():
            for param, is_plain, grad in zip(trainable, plain, grads):
                if is_plain and grad is not None:
                    param.main_grad.add_(grad)
        return loss.detach()

    return GraphedStep(model, step, *first_batch.clone().tensors())
