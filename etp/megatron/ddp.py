"""megatron-core DistributedDataParallel for ETP-wrapped models.

[Note: ETP under megatron-core DDP]
ETP shards are ordinary parameters to DDP: each lives in DDP's contiguous param / grad
buffers (``main_grad`` has the shard's padded shape) and the distributed optimizer shards
them further. What changes:

* **Groups.** DDP and the optimizer reduce over the *replicate* groups (data parallel
  without the ETP axis; see [Note: ETP ranks under megatron-core]); the ETP axis was
  already reduced by the reduce-scatter of each weight gradient.
* **Grad-ready.** DDP's own post-accumulate hook would see ``param.grad is None`` (ETP's
  autograd returns no gradient for the shard: the runtime delivers it after its deferred
  reduce-scatter). ETP params therefore get no DDP hook; the ETP runtime adds the
  reduce-scattered shard gradient into ``main_grad`` and only then calls DDP's
  ``register_grad_ready`` (never before), which starts the bucket's reduction when
  ``overlap_grad_reduce`` is on.
* **Scaling.** Every gradient is summed over all data-parallel ranks exactly once (the ETP
  axis by etp, the replicate axis by DDP) and scaled once, by the factor megatron-core uses
  without ETP: ``1 / (data-parallel x context-parallel size)`` for mean losses, 1 for
  per-token losses (``finalize_model_grads`` divides by the token count). DDP's bucket
  factors are reset after construction to give exactly that, undoing the ETP group size
  when ``ETPConfig.reduction`` is ``"mean"`` (so either setting gives the same gradients).
* **Replicated params** (norms, biases, router, embeddings) get partial gradients on each
  ETP peer: ``etp.megatron.finalize_model_grads`` sums them over the ETP group after DDP's
  reduction. With the distributed optimizer only the rank's own chunk of a bucket is
  reduced; ETP peers own the same chunk (same position in their replicate groups), so the
  chunk is exact and the rest is never read.
* **Not supported:** ``overlap_param_gather`` (the ETP prefetch would read shards whose
  parameter all-gather is still in flight) and several distributed-optimizer instances.
"""
from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

from ..groups import ETPGroups, new_process_group
from ..param import ETPShardedParam
from ..runtime import register_grad_ready_hook
from ..wrap import is_expert_param, runtime_of

__all__ = ["ETPDistributedDataParallel", "etp_process_groups"]


def _group_or_self(group: dist.ProcessGroup | None, singletons: dict,
                   timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    """DDP needs a real group even for a replicate axis of size 1."""
    if group is not None:
        return group
    if "mine" not in singletons:
        me = dist.get_rank()
        for rank in range(dist.get_world_size()):  # a collective: every rank makes every one
            made = new_process_group([rank], timeout=timeout)
            if rank == me:
                singletons["mine"] = made
    return singletons["mine"]


def etp_process_groups(groups: ETPGroups, timeout: datetime.timedelta | None = None):
    """megatron-core ``ProcessGroupCollection`` whose data-parallel groups are the ETP
    replicate groups (what DDP and the optimizer reduce over); the model-parallel groups are
    parallel_state's. A collective when a replicate axis has size 1 (it creates singleton
    groups, waiting ``timeout``: None is the world group's, [Note: group timeouts] in
    ``etp/groups.py``), so every rank calls it.

    Example::

        pgs = etp_process_groups(groups)
        optimizer = get_megatron_optimizer(opt_config, [ddp_model], pg_collection=pgs,
                                           use_gloo_process_groups=False)
    """
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    singletons: dict = {}
    pgs = ProcessGroupCollection()
    pgs.tp = ps.get_tensor_model_parallel_group()
    pgs.pp = ps.get_pipeline_model_parallel_group()
    pgs.ep = ps.get_expert_model_parallel_group()
    pgs.mp = ps.get_model_parallel_group()
    pgs.tp_ep_pp = ps.get_expert_tensor_model_pipeline_parallel_group()
    pgs.embd = ps.get_embedding_group(check_initialized=False)
    pgs.pos_embd = ps.get_position_embedding_group(check_initialized=False)
    dense = _group_or_self(groups.dense_replicate, singletons, timeout)
    expert = _group_or_self(groups.expert_replicate, singletons, timeout)
    pgs.dp = pgs.dp_cp = pgs.intra_dp_cp = dense
    pgs.expt_dp = pgs.intra_expt_dp = expert
    pgs.intra_dist_opt = ps.get_intra_distributed_optimizer_instance_group(check_initialized=False)
    return pgs


def _megatron_ddp():
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel


class ETPDistributedDataParallel(_megatron_ddp()):
    """megatron-core ``DistributedDataParallel`` for a model wrapped by ``apply_etp``.

    Same constructor as megatron-core's DDP (so Megatron-LM can use it as its ``DDP``
    class); the process groups come from the ETP groups ``apply_etp`` used. See
    [Note: ETP under megatron-core DDP]. Use ``etp.megatron.finalize.finalize_model_grads`` in
    place of megatron-core's and ``etp.megatron.optimizer.get_etp_megatron_optimizer`` for the
    optimizer.

    Raises:
        ValueError: ``overlap_param_gather``, several distributed-optimizer instances, a
            ``pg_collection`` argument, or a model without ETP weights.

    Example::

        summary = apply_etp(model, ETPConfig(etp_size=8, expert_etp_size=8))
        model = ETPDistributedDataParallel(transformer_config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True), model)
    """

    def __init__(self, config, ddp_config, module: torch.nn.Module, disable_bucketing: bool = False,
                 pg_collection=None):
        if pg_collection is not None:
            raise ValueError("ETPDistributedDataParallel builds its own process groups from the ETP "
                             "groups: pass pg_collection=None")
        if ddp_config.overlap_param_gather:
            raise ValueError("overlap_param_gather=True is not supported with ETP (the ETP prefetch "
                             "would read shards whose parameter all-gather is in flight): set "
                             "overlap_param_gather=False")
        if ddp_config.num_distributed_optimizer_instances != 1:
            raise ValueError(f"num_distributed_optimizer_instances="
                             f"{ddp_config.num_distributed_optimizer_instances} is not supported with "
                             "ETP: use 1")
        runtime = runtime_of(module)
        if runtime.groups is None:
            raise ValueError("the model's ETP weights carry no groups: wrap it with apply_etp")
        groups: ETPGroups = runtime.groups
        for param in module.parameters():
            if is_expert_param(param):
                # Expert buffers reduce over the expert replicate group, also with EP = 1,
                # where megatron-core leaves expert params in the dense buffers.
                param.allreduce = False
        pgs = etp_process_groups(groups)
        super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing, pg_collection=pgs)
        self.etp_groups, self.etp_pg_collection, self.etp_config = groups, pgs, runtime.config
        self._etp_runtime = runtime
        self._rescale_buckets(config)
        for param in module.parameters():
            if isinstance(param, ETPShardedParam) and param.requires_grad:
                register_grad_ready_hook(param, self._etp_grad_ready)

    @contextlib.contextmanager
    def no_sync(self):
        """megatron-core's ``no_sync`` that also lands the microbatch's last ETP reductions
        before DDP counts grad-ready calls again (the first pass has no recorded order to
        tell the runtime which reduction is its last)."""
        with super().no_sync():
            yield
            self._etp_runtime.reductions.drain()

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        if isinstance(param, ETPShardedParam):
            return _no_hook  # the ETP runtime calls _etp_grad_ready after its reduce-scatter
        return super()._make_backward_post_hook(param)

    def _etp_grad_ready(self, param: torch.Tensor) -> None:
        if self.ddp_config.overlap_grad_reduce and param in self.param_to_bucket_group:
            self.param_to_bucket_group[param].register_grad_ready(param, self.force_all_reduce)

    def _rescale_buckets(self, config) -> None:
        """Scales every bucket so that each gradient ends as it would without ETP: summed over
        all data-parallel ranks and scaled once. See [Note: ETP under megatron-core DDP]."""
        from megatron.core import parallel_state as ps

        # What the ETP reduction already divided by (reduce-scatter of shards, all-reduce of
        # replicated params in finalize): undone here so that one factor remains.
        mean = self.etp_config.reduction == "mean"
        dense = self.etp_groups.dense.size if mean else 1
        expert = self.etp_groups.expert.size if mean else 1
        dp_cp = 1 if config.calculate_per_token_loss else ps.get_data_parallel_world_size(with_context_parallel=True)
        for buffers, etp_divisor in ((self.buffers, dense), (self.expert_parallel_buffers, expert)):
            for buffer in buffers:
                averaged = buffer.data_parallel_group.size() if self.ddp_config.average_in_collective else 1
                factor = averaged * etp_divisor / dp_cp
                buffer.gradient_scaling_factor = factor
                for bucket in buffer.buckets:
                    bucket.gradient_scaling_factor = factor


def _no_hook(*unused) -> None:
    return None
