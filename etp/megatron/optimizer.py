"""megatron-core's optimizer over ETP-wrapped models.

``get_etp_megatron_optimizer`` builds megatron-core's optimizer (Adam / SGD, mixed precision,
distributed optimizer) on the replicate groups and makes two things exact:

* **Grad norm** (clipping, logging): every logical element counted once. ETP shards are
  distinct on every ETP peer; replicated params are equal on them after
  ``finalize_model_grads``. Replicated params are marked ``shared`` (megatron-core's "counted
  elsewhere" flag, the one tied embeddings use) on every ETP rank but the first, and the
  statistics group spans the ETP axis: the world for the distributed optimizer (megatron's
  default), model-parallel x ETP ranks otherwise. Padding rows hold zero gradients, so they
  add nothing.
* **FP8 gathers**: after each step the FP8 shard copies are re-quantized (the optimizer
  writes the shards through buffer views, which no version counter sees).
* **No cold chain head**: after each step (and the re-quantization) the first forward
  gather of every chain is issued (``etp.prefetch_after_step``), so the next forward does
  not start with a synchronous gather.
"""
from __future__ import annotations

import datetime
import functools

import torch.distributed as dist

from ..groups import new_groups
from ..param import ETPShardedParam
from ..quant import quantize_shards
from ..wrap import is_expert_param, prefetch_after_step, runtime_of
from .fast_fallbacks import inner_optimizers

__all__ = ["etp_copy_index", "get_etp_megatron_optimizer", "inner_optimizers", "param_pairs"]


def _stats_group(replicate: dist.ProcessGroup | None,
                 timeout: datetime.timedelta | None = None) -> dist.ProcessGroup | None:
    """The ranks sharing this rank's index within its replicate group: every distinct piece
    of the model once (TP x PP x ETP x EP). A collective; None means the world."""
    me = dist.get_rank()
    index = dist.get_process_group_ranks(replicate).index(me) if replicate is not None else 0
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, index)
    if len(set(everyone)) == 1:
        return None
    partition = [tuple(r for r, i in enumerate(everyone) if i == value) for value in sorted(set(everyone))]
    return new_groups(partition, timeout)


def param_pairs(inner) -> list[tuple]:
    """(model param, param the torch optimizer steps, torch optimizer, flattened range) for
    every parameter of one megatron-core optimizer that this rank steps. Mixed precision
    steps fp32 master copies, the fp32 optimizer the model params themselves (range None:
    the whole param). The distributed optimizer steps a 1-D slice of each param it owns a
    part of: the range is that slice of the flattened model param (``param_range_map
    ["param"]`` of megatron's buffer range map)."""
    if hasattr(inner, "gbuf_ranges"):  # DistributedOptimizer
        pairs = []
        for buffer_ranges in inner.gbuf_ranges:
            for bucket_ranges in buffer_ranges.values():
                for bucket in bucket_ranges:
                    for model, ranges in bucket["param_map"].items():
                        group, order = inner.model_param_group_index_map[model]
                        main = inner.optimizer.param_groups[group]["params"][order]
                        pairs.append((model, main, inner.optimizer, slice(ranges["param"].start, ranges["param"].end)))
        return pairs
    if hasattr(inner, "float16_groups"):
        pairs = [(model, main, inner.optimizer, None)
                 for models, mains in zip(inner.float16_groups, inner.fp32_from_float16_groups)
                 for model, main in zip(models, mains)]
        return pairs + [(p, p, inner.optimizer, None) for group in inner.fp32_from_fp32_groups for p in group]
    return [(p, p, inner.optimizer, None) for group in inner.optimizer.param_groups for p in group["params"]]


def etp_copy_index(param, groups) -> int:
    """Which of the equal copies of ``param`` across its ETP group this rank holds: 0 for an
    ETP shard (distinct on every ETP peer) and for ``groups`` None (no ETP), else the rank in
    the (dense or expert) ETP group, over which replicated params are equal."""
    if groups is None or isinstance(param, ETPShardedParam):
        return 0
    return (groups.expert if is_expert_param(param) else groups.dense).rank


def _mark_duplicates(chunks, groups) -> None:
    for chunk in chunks:
        for param in chunk.parameters():
            if etp_copy_index(param, groups) != 0:
                param.shared = True  # equal on ETP peers: counted once, on the first


def get_etp_megatron_optimizer(config, model_chunks, fast_fallbacks: bool = True,
                               timeout: datetime.timedelta | None = None, **kwargs):
    """megatron-core ``get_megatron_optimizer`` for ``ETPDistributedDataParallel`` chunks.

    Args:
        config: megatron-core ``OptimizerConfig``.
        model_chunks: the DDP-wrapped model chunks (a list, or one module).
        fast_fallbacks: without apex / TransformerEngine, run megatron-core's multi-tensor
            helpers on torch foreach ops ([Note: megatron fallbacks]), step AdamW with etp's
            fused kernel, which also writes the bf16 weights ([Note: etp AdamW step]), and step
            without a host synchronization (``grad_norm`` is then a device tensor,
            [Note: sync-free step]).
        timeout: how long the grad-norm statistics groups it creates wait for a peer (None: the
            world group's; [Note: group timeouts] in ``etp/groups.py``).
        kwargs: passed on (``config_overrides`` ...); ``pg_collection`` and
            ``use_gloo_process_groups`` are set here.

    Example::

        opt = get_etp_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-4, bf16=True,
                                         use_distributed_optimizer=True, clip_grad=1.0), [ddp])
        finalize_model_grads([ddp]); ok, grad_norm, _ = opt.step()
    """
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from . import fast_fallbacks as fallbacks
    from . import patches
    from .ddp import ETPDistributedDataParallel

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for chunk in chunks:
        if not isinstance(chunk, ETPDistributedDataParallel):
            raise ValueError(f"model chunk {type(chunk).__name__} is not ETPDistributedDataParallel: "
                             "wrap each chunk with etp.megatron.ddp.ETPDistributedDataParallel first")
    for key in ("pg_collection", "use_gloo_process_groups"):
        if key in kwargs:
            raise ValueError(f"get_etp_megatron_optimizer sets {key} itself: drop it")
    groups = runtime_of(chunks[0]).groups
    _mark_duplicates(chunks, groups)
    dense_stats = _stats_group(groups.dense_replicate, timeout)
    expert_stats = _stats_group(groups.expert_replicate, timeout)
    if fast_fallbacks:
        patches.use_fast_fallbacks(True)  # no-op with apex / TransformerEngine; [Note: megatron fallbacks]
    optimizer = get_megatron_optimizer(config, chunks, pg_collection=chunks[0].etp_pg_collection,
                                       use_gloo_process_groups=False, **kwargs)
    if fast_fallbacks:
        fallbacks.fuse_adam(optimizer)
        patches.step_with_fused_adamw(optimizer)  # [Note: etp AdamW step]
        patches.step_without_host_sync(optimizer)  # [Note: sync-free step]
    for opt in inner_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            continue  # statistics over the world already; duplicates are marked shared
        expert = any(is_expert_param(pair[0]) for pair in param_pairs(opt))
        opt.grad_stats_parallel_group = expert_stats if expert else dense_stats

    step = optimizer.step

    @functools.wraps(step)
    def step_and_requantize(*args, **kw):
        result = step(*args, **kw)
        for chunk in chunks:
            quantize_shards(chunk)  # a no-op without FP8 gathers
        runtimes = {id(runtime_of(chunk)): chunk for chunk in chunks}
        for chunk in runtimes.values():  # one call per runtime: chunks may share one
            prefetch_after_step(chunk)
        return result

    optimizer.step = step_and_requantize
    return optimizer
