"""The language-model loss of etp-train's megatron-core ``GPTModel``: a vocabulary-parallel
cross-entropy that keeps the 16-bit logits for backward instead of their fp32 softmax.

megatron-core's ``vocab_parallel_cross_entropy`` keeps 4 bytes per logit from the forward to the
backward and holds 6 at the loss in each direction; on a vocabulary of 150 K at 16 K tokens per
micro-batch that decides which micro-batch fits. ``vocab_cross_entropy`` keeps the logits
themselves (2 bytes each in bf16) and writes their gradient over them in backward
([Note: logits cross-entropy], ``etp.kernels.cross_entropy``). Every run of etp-train uses it, the
peers' included: it is part of the model, not of how it is sharded.

Example::

    model = GPTModel(...)
    use_vocab_cross_entropy(model)     # GPTModel.forward(..., labels=...) now returns this loss
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.cross_entropy import cross_entropy_grad_, cross_entropy_stats

__all__ = ["masked_token_mean", "use_vocab_cross_entropy", "vocab_cross_entropy"]


class _VocabCrossEntropy(torch.autograd.Function):
    """loss [s, b] of logits [s, b, V / TP] (this rank's vocabulary slice) and labels [s, b]."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        vocab = logits.shape[-1]
        rows = logits.reshape(-1, vocab)
        size = dist.get_world_size(group) if group is not None else 1
        first = dist.get_rank(group) * vocab if size > 1 else 0
        local = labels.reshape(-1).to(torch.int64) - first
        target = torch.where((local >= 0) & (local < vocab), local, -1)
        row_max, row_sum, picked = cross_entropy_stats(rows, target)
        if size > 1:
            # Each shard's sum rescaled to the global max; the target's logit lives on one shard.
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            row_sum = row_sum * (row_max - global_max).exp()
            dist.all_reduce(row_sum, group=group)
            dist.all_reduce(picked, group=group)
            row_max = global_max
        ctx.save_for_backward(rows, target, row_max, row_sum)
        ctx.logits_shape = logits.shape
        ctx.consumed = False
        return (row_sum.log() + row_max - picked).view(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        if ctx.consumed:
            raise RuntimeError("vocab_cross_entropy: its backward ran twice; it writes the logits' gradient over the "
                               "logits it kept, so a second backward (retain_graph=True) has nothing to read")
        rows, target, row_max, row_sum = ctx.saved_tensors
        ctx.consumed = True
        grad_rows = grad.reshape(-1).to(row_max.dtype).contiguous()
        return cross_entropy_grad_(rows, target, row_max, row_sum, grad_rows).view(ctx.logits_shape), None, None


def vocab_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token cross-entropy of ``logits [s, b, V / TP]`` (this rank's slice of the vocabulary,
    megatron-core's tensor-parallel layout) against ``labels [s, b]``, as megatron-core's
    ``vocab_parallel_cross_entropy`` without label smoothing, keeping only ``logits`` for backward.

    Args:
        logits: the output layer's logits; their backward overwrites them with their gradient.
        labels: int token ids over the whole vocabulary.
        group: the tensor-parallel group the vocabulary is split over (None: not split).

    Returns:
        float32 ``[s, b]`` (float64 for float64 logits): ``log sum_v exp(x_v) - x_label``.

    Example::

        loss = vocab_cross_entropy(logits, labels.transpose(0, 1))   # [s, b]
    """
    return _VocabCrossEntropy.apply(logits, labels, group)


def masked_token_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """A micro-batch's language-model loss from its per-token losses, as Megatron-LM's
    ``pretrain_gpt.loss_func`` reduces them: ``sum(loss x loss_mask) / sum(loss_mask)`` (the
    dataset's loss mask: 0 on padding and, with ``eod_mask_loss``, on end-of-document tokens), in
    float32; the plain mean without a mask. A micro-batch whose mask is all 0 has loss 0, not NaN.

    Example::

        loss = masked_token_mean(model(tokens, positions, mask, labels=labels), batch.loss_mask)
    """
    per_token_loss = per_token_loss.float()
    if loss_mask is None:
        return per_token_loss.mean()
    mask = loss_mask.to(per_token_loss.dtype).reshape(per_token_loss.shape)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def use_vocab_cross_entropy(model) -> None:
    """Makes megatron-core's ``GPTModel`` compute its language-model loss with
    ``vocab_cross_entropy`` (over its tensor-parallel group). Call on the unwrapped model.

    Example::

        model = gpt_model(recipe, config)
        use_vocab_cross_entropy(model)
    """
    if getattr(model.config, "cross_entropy_loss_fusion", False):
        raise ValueError("use_vocab_cross_entropy: the model's config sets cross_entropy_loss_fusion=True; "
                         "leave it False (etp's loss replaces megatron-core's either way)")
    tp = getattr(getattr(model, "pg_collection", None), "tp", None)

    def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        group = tp if tp is not None and dist.is_initialized() and dist.get_world_size(tp) > 1 else None
        return vocab_cross_entropy(logits, labels.transpose(0, 1), group).transpose(0, 1).contiguous()

    model.compute_language_model_loss = compute_language_model_loss
