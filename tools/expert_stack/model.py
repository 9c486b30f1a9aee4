"""The expert stack: ``layers`` residual blocks ``x = x + experts(x, counts)`` of etp's grouped
SwiGLU experts, its per-rank data, and the replicated FP8 baseline's own weight quantization.

The replicated baselines run etp's own kernels (``etp.GroupedSwiGLUExperts`` computes a plain
weight with the same ``torch._grouped_mm`` / FP8 grouped GEMMs as a sharded one), so a
difference between variants is communication and scheduling, never the GEMM choice.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import etp
from etp.expert_swiglu import expert_swiglu
from etp.gemm import GroupedGemm

__all__ = ["Env", "ExpertStack", "Workload", "build_model", "init_distributed", "make_workload",
           "quantize_full_weights"]


@dataclass(frozen=True)
class Env:
    """This rank, its device and the weights' dtype (bf16 on GPU, float32 in the CPU smoke)."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _default_single_process_env() -> None:
    # `python tools/bench_expert_stack.py --cpu-smoke` without torchrun: a world of 1.
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


def init_distributed(cpu_smoke: bool) -> Env:
    """NCCL with one GPU per rank, or gloo on CPU (float32) for the smoke run."""
    _default_single_process_env()
    if cpu_smoke:
        torch.set_num_threads(1)  # ranks share few cores; oversubscription only adds noise
        dist.init_process_group("gloo")
        return Env(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), torch.float32)
    if not torch.cuda.is_available():
        raise SystemExit("bench_expert_stack: no CUDA device; use --cpu-smoke to check the script on CPU")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return Env(dist.get_rank(), dist.get_world_size(), device, torch.bfloat16)


class _FP8GroupedLinear(torch.autograd.Function):
    """A full weight computed through its once-per-step FP8 copy with etp's FP8 grouped GEMMs:
    what the FP8 ETP variants compute, without communication."""

    @staticmethod
    def forward(ctx, x, weight, fp8, counts, fp8_wgrad):
        ctx.save_for_backward(x, counts)
        ctx.fp8, ctx.fp8_wgrad = fp8, fp8_wgrad
        return GroupedGemm.forward(x, fp8, counts)

    @staticmethod
    def backward(ctx, grad_y):
        x, counts = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = GroupedGemm.dgrad(grad_y, ctx.fp8, counts) if ctx.needs_input_grad[0] else None
        grad_w = GroupedGemm.wgrad(grad_y, x, counts, fp8=ctx.fp8_wgrad) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None


class BenchExperts(etp.GroupedSwiGLUExperts):
    """``GroupedSwiGLUExperts`` that, given FP8 copies of its full weights (``fp8_weights``,
    the replicated FP8 baseline), runs its GEMMs through them; otherwise etp's own forward."""

    fp8_weights: dict | None = None  # name -> etp.formats.fp8.FP8Weight of this step
    fp8_copies: dict | None = None   # name -> the stable e4m3 buffer behind it
    fp8_wgrad: bool = False

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        fp8 = self.fp8_weights
        if not fp8:
            return super().forward(x, tokens_per_expert)
        gate_up = _FP8GroupedLinear.apply(x, self.fc1_weight, fp8["fc1_weight"], tokens_per_expert, self.fp8_wgrad)
        hidden = expert_swiglu(gate_up, None, quantize=True)  # hands fc2 its FP8 input
        return _FP8GroupedLinear.apply(hidden, self.fc2_weight, fp8["fc2_weight"], tokens_per_expert, self.fp8_wgrad)


def quantize_full_weights(model: nn.Module) -> None:
    """Per-expert e4m3 copies of every full expert weight, written in place into stable
    buffers with delayed scaling and a kept ``MultiTensorCastPlan``: what
    ``etp.quantize_shards`` runs on shards once per step. The input-gradient GEMM transposes
    the FP8 weight itself, as it does for a gathered ETP weight."""
    from etp.formats.fp8 import FP8_DTYPE, prepare_scale_rows
    from etp.formats.fp8_tensorwise import cast_tensorwise
    from etp.kernels import MultiTensorCastPlan

    weights = [(layer, name, getattr(layer, name).detach())
               for layer in model.layers for name in ("fc1_weight", "fc2_weight")]
    for layer, name, w in weights:
        if name not in layer.fp8_copies:
            layer.fp8_copies[name] = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    views = [w[e] for _, _, w in weights for e in range(w.shape[0])]
    outs = [layer.fp8_copies[name][e] for layer, name, w in weights for e in range(w.shape[0])]
    if getattr(model, "fp8_cast_plan", None) is None:  # the buffers stay: its tables are built once
        model.fp8_cast_plan = MultiTensorCastPlan(views, out=outs)
    slots = torch.arange(len(views), device=views[0].device)
    scales, model.fp8_amax = cast_tensorwise(views, slots, len(views), outs,
                                             prev_amax=getattr(model, "fp8_amax", None), plan=model.fp8_cast_plan)
    first = 0
    for layer, name, w in weights:
        experts = w.shape[0]
        _store_fp8_weight(layer, name, w, scales[first:first + experts])
        prepare_scale_rows(layer.fp8_weights[name].scale_inv, w.shape)  # as quantize_shards does
        first += experts


def _store_fp8_weight(layer: BenchExperts, name: str, w: torch.Tensor, scales: torch.Tensor) -> None:
    # In place: a captured step reads the addresses it saw at capture, so fresh scale tensors
    # each step would leave a graph reading freed memory.
    from etp.formats.fp8 import FP8Weight

    data = layer.fp8_copies[name]
    if name not in layer.fp8_weights:
        layer.fp8_weights[name] = FP8Weight(data, torch.empty_like(scales), torch.empty_like(scales), False,
                                            data.view(-1, data.shape[-1]), w.shape[0] * w.shape[1])
    fp8 = layer.fp8_weights[name]
    fp8.scale.copy_(scales)
    torch.reciprocal(fp8.scale, out=fp8.scale_inv)


class ExpertStack(nn.Module):
    """``layers`` residual expert blocks; the residual lets gradients reach every layer."""

    def __init__(self, shape, env: Env) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            BenchExperts(shape.experts, shape.hidden, shape.ffn, dtype=env.dtype, device=env.device)
            for _ in range(shape.layers)
        )

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, tokens_per_expert)
        return x


def build_model(shape, env: Env) -> ExpertStack:
    """The same full weights on every rank (ETP and FSDP2 shard one full weight)."""
    torch.manual_seed(1234)
    return ExpertStack(shape, env)


@dataclass
class Workload:
    """One step's data on this rank (data parallel: each rank draws its own tokens)."""

    x: torch.Tensor       # [T, hidden], sorted by expert, requires grad
    counts: torch.Tensor  # [experts] tokens per expert
    grad_out: torch.Tensor
    flops: float          # per step per GPU


def make_workload(shape, env: Env) -> Workload:
    """FLOPs per step = layers x 18 x T x hidden x ffn: forward 6 T H I (fc1 2 T H 2I plus fc2
    2 T I H), backward twice that; the input requires grad, so the count is exact."""
    tokens = shape.experts * shape.tokens_per_expert
    gen = torch.Generator(device=env.device).manual_seed(1000 + env.rank)
    # Scaled so that the residual SwiGLU blocks (quadratic in their input) stay O(1).
    x = 0.1 * torch.randn(tokens, shape.hidden, generator=gen, device=env.device, dtype=env.dtype)
    grad_out = torch.randn(tokens, shape.hidden, generator=gen, device=env.device, dtype=env.dtype)
    counts = torch.full((shape.experts,), shape.tokens_per_expert, dtype=torch.int64, device=env.device)
    flops = float(shape.layers) * 18 * tokens * shape.hidden * shape.ffn
    return Workload(x.requires_grad_(True), counts, grad_out, flops)
