"""Parity checks of ETP-wrapped modules against an unsharded reference.

Every rank builds the same float64 model (same seed), keeps an unsharded copy as the
reference, and wraps the other with ETP. Rank r feeds its own input x_r. The reference sees
every rank's input locally (no collectives), so it is independent of etp's communication:

* forward: y_r(ETP) == reference(x_r);
* input grad: d loss_r / d x_r;
* weight grads: ETP shard == rows of the reference gradient of the combined loss
  (mean over ranks of loss_r for reduction="mean", sum for "sum"), padding rows exactly 0;
  replicated params (biases) after ``finalize_grads`` == the reference gradient.

float64 everywhere: the only differences are summation orders, ~1e-16 relative, so a
tolerance of 1e-10 is loose for rounding and tight for any real error (a wrong row, a
missing reduction or a perturbed shard shifts results by >= 1e-6 here).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import etp.modules
from etp import (
    ETPConfig,
    ETPShardedParam,
    GroupedSwiGLUExperts,
    build_etp_groups,
    finalize_grads,
    wrap_module_params_etp,
)
from etp.gemm import grouped_linear_reference

RTOL, ATOL = 1e-10, 1e-12

# The unsharded reference computes its experts by plain autograd through a torch.mm loop, so
# it shares no GEMM code with etp (etp.gemm is checked on its own in tests/test_gemm.py).
# ETP-sharded weights never take this path.
etp.modules.plain_grouped_linear = grouped_linear_reference


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        err = (got - want).abs().max().item()
        raise AssertionError(f"{what}: max abs error {err:.3e} exceeds rtol={RTOL}, atol={ATOL}")


@dataclass
class Case:
    """A module and how to feed it: ``make_input(generator)`` returns the forward args."""

    name: str
    make_module: Callable[[], nn.Module]
    make_input: Callable[[torch.Generator], tuple]
    forward: Callable[[nn.Module, tuple], torch.Tensor]


def _tokens(hidden, counts):
    def make(gen):
        x = torch.randn(sum(counts), hidden, generator=gen, dtype=torch.float64)
        return (x, torch.tensor(counts))
    return make


def standard_cases() -> list[Case]:
    """nn.Linear (ordinary, tiny out-dim whose padding spills over ranks, no bias) and the
    grouped SwiGLU experts (uneven tokens, one expert with none)."""
    def linear(i, o, bias=True):
        return lambda: nn.Linear(i, o, bias=bias, dtype=torch.float64)

    def dense_input(i):
        return lambda gen: (torch.randn(3, 5, i, generator=gen, dtype=torch.float64),)

    def call(m, args):
        return m(*args)

    def tied():
        # One weight consumed twice per step: both consumes gather, both gradients count.
        first, second = nn.Linear(6, 6, dtype=torch.float64), nn.Linear(6, 6, dtype=torch.float64)
        second.weight = first.weight
        return nn.Sequential(first, nn.Tanh(), second)

    return [
        Case("linear_40x24", linear(24, 40), dense_input(24), call),
        Case("tied_linears", tied, dense_input(6), call),
        Case("linear_1x8_spill", linear(8, 1), dense_input(8), call),
        Case("linear_3x5_nobias", linear(5, 3, bias=False), dense_input(5), call),
        Case(
            "grouped_swiglu",
            lambda: GroupedSwiGLUExperts(3, 8, 6, dtype=torch.float64, init_std=0.5),
            _tokens(8, [4, 0, 7]),
            call,
        ),
    ]


def _rank_generator(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + rank)


def check_case(
    ctx,
    case: Case,
    config: ETPConfig,
    perturb_rank: int | None = None,
) -> dict:
    """Runs one parity check on this rank; raises AssertionError on any mismatch.

    ``perturb_rank``: that rank adds 1e-3 to the logical rows of its shards after wrapping
    (a negative control: the check must then fail).
    """
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    torch.manual_seed(1234)
    reference = case.make_module().to(device)
    model = copy.deepcopy(reference)
    groups = build_etp_groups(config)
    summary = wrap_module_params_etp(model, config, groups)
    if perturb_rank == rank:
        with torch.no_grad():
            for p in model.parameters():
                if isinstance(p, ETPShardedParam):
                    p.valid_shard.add_(1e-3)

    def to_device(args):
        return tuple(a.to(device) if a.is_floating_point() else a for a in args)

    inputs = [to_device(case.make_input(_rank_generator(7, r))) for r in range(world)]
    projections = []
    for r in range(world):
        with torch.no_grad():
            shape = case.forward(reference, inputs[r]).shape
        projections.append(torch.randn(shape, generator=_rank_generator(11, r), dtype=torch.float64).to(device))

    # Reference: every rank's loss, combined as the ETP reduction says.
    ref_losses, ref_outputs, ref_input_grads = [], [], []
    for r in range(world):
        x = inputs[r][0].clone().requires_grad_(True)
        y = case.forward(reference, (x, *inputs[r][1:]))
        loss = (y * projections[r]).sum()
        ref_input_grads.append(torch.autograd.grad(loss, x, retain_graph=True)[0])
        ref_losses.append(loss)
        ref_outputs.append(y.detach())
    total = torch.stack(ref_losses)
    (total.mean() if config.reduction == "mean" else total.sum()).backward()

    # ETP: this rank's input only.
    x = inputs[rank][0].clone().requires_grad_(True)
    y = case.forward(model, (x, *inputs[rank][1:]))
    (y * projections[rank]).sum().backward()
    finalize_grads(model, config, groups)

    assert_close(y, ref_outputs[rank], f"{case.name}: forward output")
    assert_close(x.grad, ref_input_grads[rank], f"{case.name}: input grad")
    reference_params = dict(reference.named_parameters())
    sharded = 0
    for name, p in model.named_parameters():
        ref_grad = reference_params[name].grad
        if isinstance(p, ETPShardedParam):
            sharded += 1
            assert_close(p.grad, p.etp_layout.shard_of(ref_grad), f"{case.name}: grad of {name}")
            pad = p.grad[p.etp_layout.valid_rows :]
            if torch.count_nonzero(pad):
                raise AssertionError(f"{case.name}: padding rows of {name}.grad are not zero")
            assert_close(p.full_tensor(), reference_params[name].detach(), f"{case.name}: {name}")
        else:
            assert_close(p.grad, ref_grad, f"{case.name}: grad of replicated {name}")
    expected_sharded = 0 if world == 1 else len(
        [n for n, p in reference.named_parameters() if p.dim() >= 2]  # shared params once
    )
    if sharded != expected_sharded or summary.params_wrapped != expected_sharded:
        raise AssertionError(f"{case.name}: {sharded} params sharded, expected {expected_sharded}")
    return {"case": case.name, "sharded": sharded, "bytes_after": summary.bytes_after}


class TinyMoE(nn.Module):
    """A small model with every wrapped module type: dense in / out projections (the output
    has 3 rows, so its padding spills over ranks) around grouped SwiGLU experts."""

    def __init__(self, hidden: int = 16, experts: int = 4, ffn: int = 12, out: int = 3):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden, dtype=torch.float64)
        self.experts = GroupedSwiGLUExperts(experts, hidden, ffn, dtype=torch.float64, init_std=0.3)
        self.norm = nn.LayerNorm(hidden, dtype=torch.float64)
        self.out = nn.Linear(hidden, out, dtype=torch.float64)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        h = h + self.experts(self.norm(h), counts)
        return self.out(h)


def train_parity(ctx, config: ETPConfig, steps: int = 20, make_model=None) -> dict:
    """Trains TinyMoE (or ``make_model()``, same forward signature) with Adam for ``steps``
    steps, ETP vs an unsharded reference that sees every rank's batch; returns the max
    parameter difference after training."""
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    torch.manual_seed(99)
    reference = (make_model or TinyMoE)().to(device)
    model = copy.deepcopy(reference)
    groups = build_etp_groups(config)
    wrap_module_params_etp(model, config, groups)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    counts = torch.tensor([5, 0, 9, 2])
    losses = []
    for step in range(steps):
        batches = []
        for r in range(world):
            gen = torch.Generator().manual_seed(10_000 * step + r)
            x = torch.randn(16, 16, generator=gen, dtype=torch.float64).to(device)
            target = torch.randn(16, 3, generator=gen, dtype=torch.float64).to(device)
            batches.append((x, target))

        def loss_of(m, batch):
            x, target = batch
            return F.mse_loss(m(x, counts), target, reduction="mean" if config.reduction == "mean" else "sum")

        ref_opt.zero_grad()
        ref_total = torch.stack([loss_of(reference, b) for b in batches])
        (ref_total.mean() if config.reduction == "mean" else ref_total.sum()).backward()
        ref_opt.step()

        opt.zero_grad()
        loss = loss_of(model, batches[rank])
        loss.backward()
        finalize_grads(model, config, groups)
        opt.step()
        losses.append(loss.item())

    max_err = 0.0
    reference_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        want = reference_params[name].detach()
        got = p.full_tensor() if isinstance(p, ETPShardedParam) else p.detach()
        if isinstance(p, ETPShardedParam) and torch.count_nonzero(p.detach()[p.etp_layout.valid_rows :]):
            raise AssertionError(f"padding rows of {name} became non-zero during training")
        max_err = max(max_err, (got - want).abs().max().item())
        # See the module docstring: float64, 20 Adam steps of lr 1e-2.
        if not torch.allclose(got.cpu(), want.cpu(), rtol=1e-9, atol=1e-11):
            raise AssertionError(f"{name}: after {steps} steps max error {(got - want).abs().max():.3e}")
    return {"max_param_error": max_err, "first_loss": losses[0], "last_loss": losses[-1]}
