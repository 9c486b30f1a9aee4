"""A run's set-up: the process group, the device, megatron-core's parallel state, the model
with ETP applied, and the optimizer step that drives it.

On GPUs the model is wrapped in megatron-core DDP (``ETPDistributedDataParallel`` with ETP
weights) and stepped by megatron-core's Adam (``get_etp_megatron_optimizer``: fp32 main
params and grads, the distributed optimizer when the recipe asks, grad-norm clipping counting
every element once, FP8 shards re-quantized after each step). On CPU (megatron-core's DDP and
optimizer need CUDA) torch AdamW steps the same model after ``etp.finalize_grads`` (inside
megatron-core's ``finalize_model_grads``) and ``etp.clip_grad_norm_``. With ``use_torch_fsdp2`` (CPU or GPU) ``FSDP2Step`` shards the model
with torch FSDP2 and steps it with torch AdamW instead; with ``use_megatron_fsdp`` (GPUs)
``MegatronFSDPStep`` wraps it in megatron-core's Megatron-FSDP and steps it with megatron-core's
distributed optimizer.
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Run", "set_up"]


@dataclass
class Run:
    """What a set-up run holds: its place in the world, its model and how to step it."""

    rank: int
    world: int
    backend: str
    device: torch.device
    stepper: object  # TorchStep | MegatronStep (etp.train.optimizer_steps) | FSDP2Step | MegatronFSDPStep
    loss_fn: object
    megatron_config: object  # the model's TransformerConfig
    summary: object  # etp.WrapSummary of apply_etp
    determinism: dict | None


def _silence_fallback_warnings(rank: int) -> None:
    """megatron-core warns once per module and process that neither TransformerEngine nor
    apex is installed; etp needs neither. One line from rank 0 instead."""
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", message="Apex is not installed. Falling back to Torch Norm")  # per layer spec
    warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated")  # megatron's DCP call
    if rank == 0 and importlib.util.find_spec("apex") is None:
        print("etp-train: NVIDIA apex not found: megatron-core's fallbacks run on torch's foreach "
              "ops, and etp's fused AdamW steps the optimizer (etp.megatron.fast_fallbacks, "
              "etp.megatron.fused_adamw; without ETP weights, megatron-core's distributed optimizer and Megatron-FSDP "
              "keep torch's fused Adam); TransformerEngine is not used", flush=True)


def _init_process_group(recipe, rank: int, world: int, port: int | None) -> tuple[int, int, str, torch.device]:
    """The world group, waiting ``distributed_timeout_minutes`` for a stalled peer (the groups etp
    creates later take its timeout: [Note: group timeouts] in ``etp/groups.py``)."""
    backend = recipe.parallel.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        init = dict(backend=backend, timeout=recipe.parallel.distributed_timeout)
        if port is not None:
            init.update(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dist.init_process_group(**init)
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe.check_world_size(world)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return rank, world, backend, device


def set_up(recipe, rank: int, world: int, port: int | None = None, clock=None) -> Run:
    """Everything before the first iteration of one rank (a collective over the world);
    ``clock`` (an ``etp.train.reporting.StartupClock``) times its phases.

    Example::

        run = set_up(recipe, rank=0, world=2, port=29500)
        run.stepper.model, run.stepper.optimizer
    """
    _silence_fallback_warnings(rank)
    determinism = None
    if recipe.train.deterministic:  # before any CUDA work: cuBLAS reads its workspace config once
        from etp.train.reproducible import enable_determinism

        determinism = enable_determinism()
    from megatron.core import parallel_state as ps

    from etp.megatron import patches
    from etp.megatron.groups import build_megatron_etp_groups
    from etp.megatron.model import apply_etp
    from etp.train.model_build import build_model
    from etp.train.optimizer_steps import MegatronStep, TorchStep

    rank, world, backend, device = _init_process_group(recipe, rank, world, port)
    p = recipe.parallel
    ps.initialize_model_parallel(tensor_model_parallel_size=p.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                                 expert_model_parallel_size=p.expert_model_parallel_size,
                                 expert_tensor_parallel_size=p.expert_tensor_parallel_size,
                                 context_parallel_size=p.context_parallel_size,
                                 distributed_timeout_minutes=p.distributed_timeout_minutes)
    patches.time_out_megatron_groups(p.distributed_timeout)  # one megatron-core group skips it
    groups = build_megatron_etp_groups(recipe.etp, timeout=p.distributed_timeout)
    mark = clock.mark if clock is not None else lambda name: None
    mark("process groups")
    model, loss_fn, config = build_model(recipe, device)
    mark("build")
    summary = apply_etp(model, recipe.etp, groups)
    mark("wrap")
    if p.use_torch_fsdp2:  # ETP is off (the recipe refuses ETP sizes above 1): apply_etp changed nothing
        from etp.train.baselines.fsdp2 import FSDP2Step

        stepper = FSDP2Step(recipe, model, config)
    elif p.use_megatron_fsdp:  # ETP off likewise; GPUs only (preflight refuses a CPU run)
        from etp.train.baselines.megatron_fsdp import MegatronFSDPStep

        stepper = MegatronFSDPStep(recipe, model, config)
    elif device.type == "cpu":
        ep_group = ps.get_expert_model_parallel_group() if recipe.parallel.expert_model_parallel_size > 1 else None
        stepper = TorchStep(recipe, model, groups, ps.get_tensor_model_parallel_group(), config, ep_group)
    else:
        stepper = MegatronStep(recipe, model, config)
    if (recipe.train.deterministic and device.type == "cuda" and recipe.train.cuda_graph != "step"
            and p.tensor_model_parallel_size == 1 and not p.fsdp_peer):
        # The embedding backward a captured step takes (ordered sums, no atomics): eager and
        # captured deterministic runs then run the same kernels ([Note: etp-train graph step]).
        # Not under an FSDP: its gathers swap the embedding's parameter, which that forward holds.
        from etp.train.captured_step import make_embeddings_capture_safe

        make_embeddings_capture_safe(stepper.model)
    mark("optimizer")
    return Run(rank, world, backend, device, stepper, loss_fn, config, summary, determinism)


def quiesce(run: Run) -> None:
    """Ends the run with nothing in flight: ETP's prefetched gathers discarded, side streams
    idle, every rank past its last collective (NCCL's destroy_process_group hung at exit on
    the GPU machine after checkpoint saves without this)."""
    from etp.wrap import _runtime_of

    runtime = _runtime_of(run.stepper.model)
    if runtime is not None:
        runtime.drain()
    if run.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
