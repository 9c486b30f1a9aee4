"""The variants of the expert-stack comparison: one table, name -> ``Variant`` (how the weights
are held and moved), and ``prepare`` that builds a variant ready to step.

Every ETP variant issues the next step's chain-head gathers at the end of its step
(``etp.prefetch_after_step``, the post-optimizer hook) and the step's end waits for the ETP
side streams: with no optimizer step here to hide behind, that gather is charged to the step.
FP8 variants quantize once per step (``etp.quantize_shards``, or the replicated baseline's own
cast), charged to every step as a training loop pays it once per optimizer step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

import etp

from .model import Env, ExpertStack, Workload, build_model, quantize_full_weights

__all__ = ["DEFAULT_VARIANTS", "VARIANTS", "Prepared", "Unsupported", "Variant", "prepare"]


@dataclass(frozen=True)
class Variant:
    """How one column of the comparison holds and moves its weights."""

    kind: str               # "replicated" | "ddp" | "fsdp2" | "etp"
    what: str               # one line for --list and the report
    fp8: bool = False       # FP8 GEMMs (ETP: fp8_tensorwise gathers; replicated: its own FP8 copy)
    fp8_wgrad: bool = False  # the weight-gradient GEMMs in FP8 too (ETPConfig.fp8_wgrad)
    transport: str = "auto"  # ETPConfig.transport
    overlap: bool = True    # ETPConfig.prefetch and async_reduce
    graphed: bool = False   # forward + backward captured in one CUDA graph (etp.GraphedStep)


VARIANTS: dict[str, Variant] = {
    "replicated": Variant("replicated", "full weights on every rank, no communication: the compute ceiling"),
    "replicated_fp8": Variant("replicated", "full weights, all six GEMMs in FP8 (etp's FP8 kernels), "
                              "no communication", fp8=True, fp8_wgrad=True),
    "ddp": Variant("ddp", "torch DistributedDataParallel, bf16 gradient all-reduce"),
    "fsdp2": Variant("fsdp2", "torch FSDP2 fully_shard per layer, bf16 gathers"),
    "etp_sync": Variant("etp", "ETP over NCCL, no prefetch, synchronous reduce-scatter", transport="nccl",
                        overlap=False),
    "etp_nccl": Variant("etp", "ETP over NCCL, prefetch and async reduce-scatter", transport="nccl"),
    "etp_default": Variant("etp", "ETP defaults: transport auto (copy-engine gathers and push reduce-scatter "
                           "on NVLink), bf16 gathers"),
    "etp_fp8": Variant("etp", "ETP defaults with FP8 gathers (fp8_tensorwise), bf16 weight-gradient GEMMs",
                       fp8=True),
    "etp_fp8_wgrad": Variant("etp", "ETP defaults with FP8 gathers and FP8 weight gradients: all six GEMMs "
                             "in FP8", fp8=True, fp8_wgrad=True),
    "etp_graphed": Variant("etp", "etp_default, forward + backward replayed from one CUDA graph", graphed=True),
    "etp_fp8_wgrad_graphed": Variant("etp", "etp_fp8_wgrad, forward + backward replayed from one CUDA graph",
                                     fp8=True, fp8_wgrad=True, graphed=True),
}
DEFAULT_VARIANTS = tuple(VARIANTS)


@dataclass
class Prepared:
    """A variant ready to step: what to call, what completes its gradients, its bytes."""

    module: nn.Module                 # called as module(x, counts)
    model: ExpertStack                # the underlying model (parameters, runtime)
    finalize: Callable[[], None]      # after backward, inside the timed region
    param_bytes: int                  # parameter bytes held by this rank
    wire_bytes: int                   # bytes received per rank per step (analytic)
    grads: str                        # "local" (this rank's own), "mean" (on every rank) or "sharded"
    info: dict = dataclasses.field(default_factory=dict)  # extra JSON fields of the result
    step: Callable | None = None      # replaces forward + backward (a graph replay); returns the output


class Unsupported(Exception):
    """This machine cannot run the variant (CUDA graphs on CPU, FSDP2 under gloo): skipped."""


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _received(world: int, numel: int, gather_bytes: int, reduce_bytes: int) -> int:
    """Bytes each rank receives per step for sharded weights of ``numel`` full elements: two
    all-gathers (forward, backward) and one reduce-scatter, each bringing (W-1)/W of them."""
    return (2 * gather_bytes + reduce_bytes) * (world - 1) * numel // world


def _replicated(shape, env: Env, variant: Variant) -> Prepared:
    model = build_model(shape, env)
    finalize = lambda: None  # noqa: E731
    info = {}
    if variant.fp8:
        for layer in model.layers:
            layer.fp8_weights, layer.fp8_copies, layer.fp8_wgrad = {}, {}, variant.fp8_wgrad
        quantize_full_weights(model)  # the first quantization, as after initialization
        finalize = lambda: quantize_full_weights(model)  # noqa: E731 - once per optimizer step in training
        info["fp8_copy_bytes"] = sum(d.numel() for layer in model.layers for d in layer.fp8_copies.values())
    return Prepared(model, model, finalize, _bytes(model.parameters()), 0, "local", info)


def _ddp(shape, env: Env, variant: Variant) -> Prepared:
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(shape, env)
    ddp = DistributedDataParallel(model, device_ids=[env.device] if env.cuda else None)
    full = _bytes(model.parameters())
    return Prepared(ddp, model, lambda: None, full, 2 * (env.world - 1) * full // env.world, "mean")


def _fsdp2(shape, env: Env, variant: Variant) -> Prepared:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not env.cuda:
        raise Unsupported("FSDP2 runs on GPUs here (gloo lacks its reduce-scatter)")
    model = build_model(shape, env)
    mesh = init_device_mesh(env.device.type, (env.world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = _bytes(p.to_local() for p in model.parameters())  # DTensor shards, padding included
    element = torch.empty((), dtype=env.dtype).element_size()
    wire = _received(env.world, local * env.world // element, element, element)
    return Prepared(model, model, lambda: None, local, wire, "sharded")


def _etp(shape, env: Env, variant: Variant, groups_cache: dict, gather_reuse: str) -> Prepared:
    cfg = etp.ETPConfig(etp_size=env.world, expert_etp_size=env.world, prefetch=variant.overlap,
                        async_reduce=variant.overlap, transport=variant.transport,
                        gather_dtype="fp8_tensorwise" if variant.fp8 else "param",
                        fp8_wgrad=variant.fp8_wgrad, gather_reuse=gather_reuse)
    # Groups depend only on the sizes: shared, every ETP variant uses the same communicators.
    if "etp" not in groups_cache:
        groups_cache["etp"] = etp.build_etp_groups(cfg)
    groups = groups_cache["etp"]
    model = build_model(shape, env)
    summary = etp.wrap_module_params_etp(model, cfg, groups)
    quantize = etp.quantize_shards if variant.fp8 else None
    if quantize is not None:
        quantize(model)  # the shards' first quantization, as after initialization

    def finalize() -> None:
        etp.finalize_grads(model, cfg, groups, replicate=False)
        if quantize is not None:
            quantize(model)
        etp.prefetch_after_step(model)
        _join_side_streams(model)

    shards = [p for p in model.parameters() if isinstance(p, etp.ETPShardedParam)]
    wire = sum(_received(env.world, p.numel() * env.world, 1 if variant.fp8 else p.element_size(), p.element_size())
               for p in shards)
    runtime = etp.runtime_of(model)
    info = {"etp_config": dataclasses.asdict(cfg),
            "transports": {str(k): (t.gather.name, t.reduce.name) for k, t in runtime.transports.items()}}
    return Prepared(model, model, finalize, summary.bytes_after, wire, "sharded", info)


def _join_side_streams(model) -> None:
    """The current stream waits for every ETP side stream (AG and RS)."""
    if not torch.cuda.is_available():
        return
    for stream in etp.runtime_of(model).streams.side_streams():
        torch.cuda.current_stream().wait_stream(stream)


def _captured(prep: Prepared, env: Env) -> Prepared:
    """``prep`` with forward + backward captured in one CUDA graph at its first step."""
    if not env.cuda:
        raise Unsupported("CUDA graphs need a GPU")
    captured = {}

    def step(work: Workload) -> torch.Tensor:
        if "graph" not in captured:
            def forward_backward(x):
                y = prep.module(x, work.counts)
                y.backward(work.grad_out)
                return y.detach()
            captured["graph"] = etp.GraphedStep(prep.model, forward_backward, work.x)
        return captured["graph"]()

    return dataclasses.replace(prep, step=step, info={**prep.info, "cuda_graph": "GraphedStep"})


def prepare(name: str, shape, env: Env, groups_cache: dict, gather_reuse: str = "chain") -> Prepared:
    """Builds variant ``name`` on this rank (a collective: every rank calls it alike).

    Example::

        prep = prepare("etp_default", shape, env, {})
        y = prep.module(work.x, work.counts)
    """
    variant = VARIANTS[name]
    if variant.kind == "etp":
        if env.world == 1:
            raise Unsupported("a world of 1: ETP shards nothing")
        prep = _etp(shape, env, variant, groups_cache, gather_reuse)
    else:
        prep = {"replicated": _replicated, "ddp": _ddp, "fsdp2": _fsdp2}[variant.kind](shape, env, variant)
    dist.barrier()  # start together, so one rank's setup does not show as another's communication
    return _captured(prep, env) if variant.graphed else prep
