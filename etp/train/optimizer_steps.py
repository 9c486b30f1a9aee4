"""The optimizer steps etp-train drives: ``TorchStep`` (CPU: torch AdamW, etp's finalize inside
megatron-core's, etp's clip) and ``MegatronStep`` (GPU: megatron-core DDP and Adam, ETP's DDP and optimizer builder
when the model holds ETP weights). Both return the grad norm without reading it on the host
([Note: sync-free step])."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch


def weight_decay_groups(model, weight_decay: float) -> list[dict]:
    """AdamW parameter groups as megatron-core makes them by default (``_get_param_groups``
    without a ``no_weight_decay_cond``): biases and 1-D parameters (norms, the router's expert
    bias) take no weight decay, every other parameter ``weight_decay``. Empty groups are left out.

    Example::

        torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=3e-4)
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith(".bias") or param.ndim == 1 else decay).append(param)
    # wd_mult: what megatron-core's scheduler multiplies the scheduled weight decay by (etp.train.schedule)
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    return [g for g in groups if g["params"]]


class _EtpSyncedChunk:
    """A model chunk as megatron-core's ``finalize_model_grads`` takes one, whose data-parallel
    step (DDP's ``finish_grad_sync``) is ``etp.finalize_grads``: megatron-core's other steps (the
    TP sums of sequence-parallel and QK norms' gradients, embeddings across pipeline stages, the
    router's expert bias, its token counts reset) then run on CPU as they do on GPUs."""

    #: what finalize_model_grads reads of DDP's config
    ddp_config = SimpleNamespace(use_megatron_fsdp=False)

    def __init__(self, model, etp_config, groups, ep_group=None) -> None:
        self.module, self.etp_config, self.groups, self.ep_group = model, etp_config, groups, ep_group

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        import etp

        etp.finalize_grads(self.module, self.etp_config, self.groups, ep_group=self.ep_group)


class TorchStep:
    """CPU: torch AdamW (megatron-core's weight-decay groups), ``etp.finalize_grads`` (ETP group
    and data-parallel replicas) inside megatron-core's ``finalize_model_grads`` for a megatron-core
    model, and ``etp.clip_grad_norm_`` (megatron-core's DDP and optimizer need CUDA).

    Args:
        recipe: the run's recipe (optimizer settings, ETP settings).
        model: the model, ETP-wrapped or not.
        groups: its ETP groups.
        tp_group: the tensor-parallel group (the grad norm sums TP pieces over it).
        ep_group: the expert-parallel group, None without expert parallelism (experts' gradients
            and grad norm are completed over it: ``etp.finalize_grads``).
        config: the model's ``TransformerConfig``; None: the model's ``config`` attribute, if it
            has one (a plain torch model has none: ``etp.finalize_grads`` alone).

    Example::

        step = TorchStep(recipe, gpt_model, groups, ps.get_tensor_model_parallel_group())
    """

    def __init__(self, recipe, model, groups, tp_group, config=None, ep_group=None) -> None:
        t = recipe.train
        self.recipe, self.model, self.groups, self.tp_group = recipe, model, groups, tp_group
        self.ep_group = ep_group
        self.config = config if config is not None else getattr(model, "config", None)
        self.optimizer = torch.optim.AdamW(weight_decay_groups(model, t.weight_decay), lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)

    def microbatches(self, count: int):
        self.optimizer.zero_grad(set_to_none=True)
        return [contextlib.nullcontext()] * count

    def step(self, lr: float, phase):
        import etp

        with phase("finalize"):
            if self.config is None:
                etp.finalize_grads(self.model, self.recipe.etp, self.groups, ep_group=self.ep_group)
            else:
                from megatron.core.distributed import finalize_model_grads

                finalize_model_grads([_EtpSyncedChunk(self.model, self.recipe.etp, self.groups, self.ep_group)])
            norm = etp.clip_grad_norm_(self.model, self.groups, self.recipe.train.clip_grad, self.tp_group,
                                       self.ep_group)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with phase("optimizer"):
            self.optimizer.step()
            # The next step's first gathers start now, behind the host work between steps
            # (the megatron path's optimizer builder does this inside its step()).
            etp.prefetch_after_step(self.model)
        return norm


def megatron_optimizer(opt_config, model, fast: bool, etp_adamw: bool = False):
    """megatron-core's optimizer over a model without ETP weights wrapped in megatron-core's DDP or
    Megatron-FSDP, with the TE/apex-free fast paths etp's own optimizer gets when ``fast``
    ([Note: megatron fallbacks], [Note: sync-free step]): peers are measured on the same footing.
    ``etp_adamw`` also steps it with etp's fused AdamW ([Note: etp AdamW step]), as
    ``get_etp_megatron_optimizer`` does: megatron-core's DDP takes it, Megatron-FSDP's sharded
    parameters keep torch's fused Adam.

    Example::

        optimizer = megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-4, bf16=True), ddp_model, True)
    """
    from megatron.core.optimizer import get_megatron_optimizer

    from etp.megatron import fast_fallbacks, patches

    if fast:
        patches.use_fast_fallbacks(True)
    optimizer = get_megatron_optimizer(opt_config, [model], use_gloo_process_groups=False)
    if fast:
        fast_fallbacks.fuse_adam(optimizer)
        if etp_adamw:
            patches.step_with_fused_adamw(optimizer)
        if patches.step_without_host_sync(optimizer) and etp_adamw:
            patches.read_bf16_grads_in_place(optimizer)  # bf16 gradient buffers: no fp32 copies
    return optimizer


class MegatronStep:
    """GPU: megatron-core DDP (fp32 gradient buffers; bf16 where ``Recipe.main_grad_bytes`` says
    they hold the same values, or with ``grad_reduce_in_bf16``) and megatron-core's Adam (mixed
    precision, optionally distributed) stepped by etp's fused AdamW under ``megatron_fallbacks:
    fast`` (the distributed optimizer, the report's peer, by torch's fused Adam);
    ``ETPDistributedDataParallel`` and etp's finalize / optimizer builder when the model holds ETP
    weights, megatron-core's own otherwise."""

    def __init__(self, recipe, model, config) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig

        from etp.megatron import patches
        from etp.megatron.ddp import ETPDistributedDataParallel
        from etp.megatron.finalize import finalize_model_grads as etp_finalize_model_grads
        from etp.megatron.optimizer import get_etp_megatron_optimizer
        from etp.wrap import _runtime_of

        p, t = recipe.parallel, recipe.train
        fast = t.megatron_fallbacks == "fast"
        if not fast:
            patches.use_fast_fallbacks(False)  # stock megatron-core, even after a fast run in this process
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.bf16_grads = recipe.main_grad_bytes(world) == 2  # [Note: bf16 gradients, read in place]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=not self.bf16_grads, overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather, bucket_size=p.ddp_bucket_size,
            use_distributed_optimizer=p.use_distributed_optimizer)
        opt_config = OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            clip_grad=t.clip_grad, bf16=t.bf16, fp16=t.fp16, params_dtype=config.params_dtype,
            use_distributed_optimizer=p.use_distributed_optimizer)
        if _runtime_of(model) is not None:
            self.model = ETPDistributedDataParallel(config, ddp_config, model)
            self.optimizer = get_etp_megatron_optimizer(opt_config, [self.model], fast_fallbacks=fast)
            self.finalize = etp_finalize_model_grads
        else:
            self.model = DistributedDataParallel(config, ddp_config, model)
            # No ETP weights (world 1, or ETP sizes of 1): the same AdamW step as with them, except
            # under megatron-core's distributed optimizer, the report's peer, which keeps its own
            # step (torch's fused Adam, then megatron's bf16 copy).
            self.optimizer = megatron_optimizer(opt_config, self.model, fast,
                                                etp_adamw=not p.use_distributed_optimizer)
            self.finalize = finalize_model_grads

    def microbatches(self, count: int):
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Gradient reduction waits for the last microbatch, as in megatron's schedules.
        return [self.model.no_sync() for _ in range(count - 1)] + [contextlib.nullcontext()]

    def step(self, lr: float, phase):
        with phase("finalize"):
            self.finalize([self.model])
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with phase("optimizer"):  # clipping included: megatron's step computes the norm
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("megatron-core's optimizer skipped the step (inf / nan gradients)")
        return grad_norm  # a device tensor with the sync-free step: read at log time only
