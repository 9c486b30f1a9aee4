"""``skip_train``: the loss of the loaded weights, with no training step and no save (see
[Note: fine-tuning] in ``etp/train/checkpointing.py``)."""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["evaluate_loaded"]


def evaluate_loaded(run, recipe, batches, iteration: int) -> float:
    """The data-parallel mean loss of ``run``'s model on the global batch of ``iteration``,
    forward only, printed by rank 0; what ``skip_train: true`` reports.

    Example::

        loss = evaluate_loaded(run, recipe, Batches(recipe, dp_rank, run.device, micro), 0)
    """
    from megatron.core import parallel_state as ps

    micro = recipe.num_microbatches(run.world)
    model = run.stepper.model
    model.eval()
    total = torch.zeros((), device=run.device)
    with torch.no_grad():
        for index in range(micro):
            loss, _ = run.loss_fn(model, batches.get(iteration, index))
            total += loss.detach().float() / micro
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    loss = float(total) / ps.get_data_parallel_world_size()
    if run.rank == 0:
        samples = micro * recipe.train.micro_batch_size * ps.get_data_parallel_world_size()
        print(f"etp-train: skip_train: loss {loss:.6f} of the loaded weights on the global batch of iteration "
              f"{iteration} ({samples} samples); nothing trained or saved", flush=True)
    return loss
