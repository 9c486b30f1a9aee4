"""``MegatronFSDPStep``: megatron-core's own Megatron-FSDP over a megatron-core GPTModel, a peer etp
measures itself against (docs/architectures.md, "Peers"), with the stepper interface of
``etp.train.optimizer_steps`` (``microbatches(count)``, ``step(lr, phase)``, ``model``, ``optimizer``).

Built as Megatron-LM's ``get_model`` builds ``--use-megatron-fsdp``: the model as for DDP (bf16
through ``Float16Module`` with ``bf16: true``) wrapped in megatron-core's
``megatron.core.distributed.fsdp.FullyShardedDataParallel`` with
``DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=
"optim_grads_params", use_distributed_optimizer=True, overlap_grad_reduce=True,
overlap_param_gather=True)``. Every ``TransformerLayer`` is one FSDP unit: its parameters are
all-gathered in its forward and backward pre-hooks and released after, and every micro-batch's
backward reduce-scatters its gradients (fp32 unless ``grad_reduce_in_bf16``) into the rank's
gradient shard. megatron-core's ``get_megatron_optimizer`` builds its distributed optimizer over
the fp32 main-weight shards, which Megatron-FSDP exposes as DTensor parameters; its step copies
them into the bf16 shards and starts the next step's first gather.

The step is Megatron-LM's ``train_step`` (``MegatronStep``'s ``microbatches`` and ``step``):
``zero_grad_buffer`` and ``optimizer.zero_grad``, ``no_sync`` around every micro-batch but the
last, megatron-core's ``finalize_model_grads`` (its ``finish_grad_sync`` waits for the
reduce-scatters and hands the gradient shards to the optimizer; then the expert-bias update), and
``optimizer.step()`` (global-norm clip, Adam). With ``megatron_fallbacks: fast`` it gets the
TE/apex-free fast paths the DDP peer gets ([Note: megatron fallbacks], [Note: sync-free step]);
``stock`` keeps megatron-core's own helpers and step.

GPUs only (Megatron-FSDP allocates CUDA streams and buffers; etp-train refuses a CPU run before it
starts), ETP off, tensor / pipeline / context / expert parallelism 1: the recipe checks those
(``use_megatron_fsdp``). Nothing reachable from a recipe needs TransformerEngine; megatron-core
needs it with Megatron-FSDP for FP8 parameters (``fp8_param_gather``) and at tensor-parallel
size above 1, where its adapter tests layers against TE's ``TELinear``.

Example::

    step = MegatronFSDPStep(recipe, gpt_model, transformer_config)
    for context in step.microbatches(4):
        with context:
            (loss_fn(step.model, batch)[1] / 4).backward()
    grad_norm = step.step(lr, phase)
"""
from __future__ import annotations

import importlib.util
import os

import torch

from etp.train.optimizer_steps import MegatronStep, megatron_optimizer

__all__ = ["MegatronFSDPStep", "megatron_fsdp_bucket_size", "unmet_requirement"]


def unmet_requirement() -> str | None:
    """What this process lacks to run Megatron-FSDP, as a sentence that follows "use_megatron_fsdp"
    and ends with the fix, or None when nothing is missing. etp-train checks it before any rank
    starts work; ``MegatronFSDPStep`` checks it again for callers of ``train`` itself.

    Example::

        reason = unmet_requirement()
        if reason is not None:
            raise SystemExit(f"use_megatron_fsdp {reason}")
    """
    if not torch.cuda.is_available():
        return ("needs CUDA GPUs (megatron-core's Megatron-FSDP allocates CUDA streams and buffers): run it "
                "under torchrun on GPUs, or use use_torch_fsdp2 on CPU")
    if importlib.util.find_spec("einops") is None:
        return ("needs the einops package (megatron-core's Megatron-FSDP lays out its device mesh with it): "
                "pip install einops")
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return ("with CUDA_DEVICE_MAX_CONNECTIONS=1 would queue Megatron-FSDP's gathers and reduce-scatters "
                "behind compute (Megatron-LM refuses it): unset CUDA_DEVICE_MAX_CONNECTIONS")
    return None


def megatron_fsdp_bucket_size(recipe, data_parallel_size: int) -> int:
    """Elements per Megatron-FSDP bucket outside the ``TransformerLayer`` units: the recipe's
    ``ddp_bucket_size``, else Megatron-LM's default ``max(40M, 1M x data-parallel size)`` (set by
    its ``get_model``; megatron-core's FSDP itself takes no default and would put every such
    parameter of one dtype in one bucket).

    Example::

        megatron_fsdp_bucket_size(recipe, 4)   # 40_000_000 without ddp_bucket_size
    """
    size = recipe.parallel.ddp_bucket_size
    return size if size is not None else max(40_000_000, 1_000_000 * data_parallel_size)


class MegatronFSDPStep(MegatronStep):
    """megatron-core's Megatron-FSDP (``optim_grads_params``) and distributed optimizer; see the
    module docstring.

    Args:
        recipe: the ``etp.megatron.Recipe`` (``use_megatron_fsdp: true``; optimizer settings, ``bf16``).
        model: the megatron-core GPTModel on its GPU, as ``etp.train.model_build`` builds
            it for DDP (``Float16Module`` with ``bf16: true``), holding no ETP weights.
        config: its ``TransformerConfig``.
    """

    def __init__(self, recipe, model, config) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.distributed.fsdp import FullyShardedDataParallel
        from megatron.core.optimizer import OptimizerConfig

        from etp.megatron import patches
        from etp.wrap import _runtime_of

        p, t = recipe.parallel, recipe.train
        reason = unmet_requirement()
        if reason is not None:
            raise ValueError(f"use_megatron_fsdp {reason}")
        if config is None or next(model.parameters()).device.type != "cuda":
            raise ValueError("MegatronFSDPStep needs megatron-core's GPTModel on a CUDA device (etp-train "
                             "builds it under torchrun on GPUs)")
        if _runtime_of(model) is not None:
            raise ValueError("MegatronFSDPStep shards plain parameters: build the model without ETP "
                             "(etp.etp_size and etp.expert_etp_size 1)")
        fast = t.megatron_fallbacks == "fast"
        if not fast:
            patches.use_fast_fallbacks(False)  # stock megatron-core, even after a fast run in this process
        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
            grad_reduce_in_fp32=not p.grad_reduce_in_bf16, bucket_size=megatron_fsdp_bucket_size(recipe, dp))
        opt_config = OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            clip_grad=t.clip_grad, bf16=t.bf16, fp16=t.fp16, params_dtype=config.params_dtype,
            use_distributed_optimizer=True)
        # fsdp_unit_modules defaults to [TransformerLayer] with optim_grads_params; the device to
        # the current CUDA device (etp-train set it per local rank).
        self.model = FullyShardedDataParallel(config, ddp_config, model)
        self.optimizer = megatron_optimizer(opt_config, self.model, fast)
        self.finalize = finalize_model_grads

    def master_weights(self) -> list:
        """This rank's fp32 main-weight shards (DTensor parameters, one per model parameter): what
        the optimizer steps. Between steps the wrapped module's own parameters are released
        (storage of size 0) or mid-gather, so reports read these instead."""
        return [param for _, param in self.model.param_and_grad_buffer.optimizer_named_parameters]
