"""``FSDP2Step``: torch FSDP2 over a megatron-core GPTModel, the peer etp measures itself against
(docs/architectures.md, "Peers"), with the stepper interface of ``etp.train.optimizer_steps``
(``microbatches(count)``, ``step(lr, phase)``, ``model``, ``optimizer``).

``fully_shard`` on every ``TransformerLayer`` and on the root, over the data-parallel group:
parameters kept sharded in their own dtype (fp32: the master weights), gathered in the training
dtype (``MixedPrecisionPolicy(param_dtype=bf16)`` with ``bf16: true``), gradients
reduce-scattered in fp32 and averaged over the ranks, as megatron-core's DDP does. torch's AdamW
steps the shards with megatron-core's parameter groups (no weight decay on biases and 1-D
parameters), the gradient is clipped by its global norm, and the router's expert bias is updated
as megatron-core's ``finalize_model_grads`` does. The model must be built in fp32 (no
``Float16Module``) and hold no ETP weights; megatron-core's own ``TorchFullyShardedDataParallel``
passes no mixed-precision policy, hence this one. etp-train steps with it for the recipe key
``use_torch_fsdp2: true``, on CPU ranks (gloo) as on GPUs.

Example::

    step = FSDP2Step(recipe, gpt_model, transformer_config)
    for context in step.microbatches(4):
        with context:
            (loss_fn(step.model, batch)[1] / 4).backward()
    grad_norm = step.step(lr, phase)
"""
from __future__ import annotations

import contextlib

import torch

from etp.train.optimizer_steps import weight_decay_groups

__all__ = ["FSDP2Step"]


class FSDP2Step:
    """torch FSDP2 per transformer layer; see the module docstring.

    Args:
        recipe: the ``etp.megatron.Recipe`` (optimizer settings, ``bf16`` / ``fp16``).
        model: an unwrapped megatron-core GPTModel in fp32.
        config: its ``TransformerConfig`` (the expert-bias update reads it); None for none.
        group: the data-parallel process group (None: megatron-core's).
    """

    def __init__(self, recipe, model, config=None, group=None) -> None:
        from megatron.core import parallel_state
        from megatron.core.transformer.transformer_layer import TransformerLayer
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        t = recipe.train
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise ValueError("FSDP2Step shards fp32 master weights: build the model in fp32, without Float16Module")
        group = group if group is not None else parallel_state.get_data_parallel_group()
        device = next(model.parameters()).device
        mesh = DeviceMesh.from_group(group, device.type)
        compute = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else None
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        for module in [m for m in model.modules() if isinstance(m, TransformerLayer)]:
            fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.recipe, self.model, self.config = recipe, model, config
        self.optimizer = torch.optim.AdamW(weight_decay_groups(model, t.weight_decay), lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                           fused=device.type == "cuda")

    def microbatches(self, count: int):
        """Zeroes the gradients; one context per micro-batch. Every micro-batch's backward
        reduce-scatters its gradients into the fp32 shards, as torchtitan trains with FSDP2:
        holding them unsharded until the last micro-batch would add 4 bytes per parameter of the
        whole model to every rank, the memory a sharded peer exists to save."""
        self.optimizer.zero_grad(set_to_none=True)
        return [contextlib.nullcontext() for _ in range(count)]

    def step(self, lr: float, phase):
        """Expert-bias update, global-norm clip, AdamW; returns the norm before clipping."""
        from torch.distributed.tensor import DTensor

        with phase("finalize"):
            if self.config is not None and getattr(self.config, "moe_router_enable_expert_bias", False):
                from megatron.core.distributed.finalize_model_grads import (
                    _update_router_expert_bias,
                    reset_model_temporary_tensors,
                )

                _update_router_expert_bias([self.model], self.config)
                reset_model_temporary_tensors(self.config, [self.model])
            params = [p for p in self.model.parameters() if p.grad is not None]
            clip = self.recipe.train.clip_grad
            norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with phase("optimizer"):
            self.optimizer.step()
        return norm
