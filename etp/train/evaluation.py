"""Validation and test: Megatron-LM's ``evaluate`` for etp-train.

Every ``eval_interval`` iterations (and after the last one, ``train_iters``) etp-train runs
``eval_iters`` global batches of the valid split forward only, under the training layout, without gradients and with
dropout off; the test split once at the end. Each evaluation continues where the previous one
stopped in its split (the consumed samples, saved in checkpoints like the train split's). The
loss is the mean of the micro-batches' language-model losses over every data-parallel rank (the
same mean as the training loss), its perplexity ``exp(min(loss, 20))`` as Megatron-LM prints it.

ETP weights are gathered for each forward as in training; the engine is drained after each
(inference forwards do not chain, [Note: ETP passes]), and the next training step's gathers are
started again afterwards.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["evaluate", "perplexity"]


def perplexity(loss: float) -> float:
    """Megatron-LM's ``exp(min(20, loss))``."""
    return math.exp(min(20.0, loss))


def evaluate(model, loss_fn, batches, global_batches: int, microbatches: int, device, group=None) -> float:
    """The mean language-model loss of ``global_batches`` global batches read from ``batches``
    (``DatasetBatches``), forward only; a collective over the data-parallel ``group``.

    Example::

        loss = evaluate(run.stepper.model, run.loss_fn, valid, recipe.data.eval_iters, micro, run.device, dp_group)
    """
    import etp
    from etp.wrap import _runtime_of

    runtime = _runtime_of(model)
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    try:
        with torch.no_grad():
            for _ in range(global_batches * microbatches):
                loss, _ = loss_fn(model, batches.next())
                total += loss.detach().double()
                if runtime is not None:
                    runtime.drain()
    finally:
        model.train(was_training)
    dist.all_reduce(total, group=group)
    if runtime is not None:
        etp.prefetch_after_step(model)
    count = global_batches * microbatches * dist.get_world_size(group)
    return float(total) / count
