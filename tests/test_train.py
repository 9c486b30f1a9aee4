"""The etp-train driver on the CPU recipe, and the global gradient norm (every logical
element once: shards summed over their group, padding never, replicated params once)."""
from pathlib import Path

import torch
from harness import run_distributed
from parity import TinyMoE

from etp import ETPConfig, ETPShardedParam, build_etp_groups, finalize_grads, global_grad_norm, wrap_module_params_etp

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_recipe_trains_five_steps(capfd):
    from etp.megatron.train import main

    assert main(["--recipe", str(ROOT / "recipes" / "tiny_moe_cpu.yaml"), "--train-iters", "5",
                 "--log-interval", "1"]) == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("iter")]
    assert len(lines) == 5 and lines[-1].startswith("iter     5/5")
    losses = [float(line.split("loss ")[1].split()[0]) for line in lines]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def _norm(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)
    torch.manual_seed(0)
    reference = TinyMoE()
    model = TinyMoE()
    model.load_state_dict(reference.state_dict())
    groups = build_etp_groups(config)
    wrap_module_params_etp(model, config, groups)
    counts = torch.tensor([5, 0, 9, 2])
    inputs = [torch.randn(16, 16, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
              for r in range(ctx.world_size)]
    torch.stack([reference(x, counts).square().mean() for x in inputs]).mean().backward()
    model(inputs[ctx.rank], counts).square().mean().backward()
    finalize_grads(model, config, groups)
    # Padding rows of the 3-row output layer must not count: put garbage there.
    for p in model.parameters():
        if isinstance(p, ETPShardedParam) and p.padding_rows:
            p.grad[p.etp_layout.valid_rows:] = 1e6
    want = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in reference.parameters()))
    got = global_grad_norm(model, groups)
    assert torch.allclose(got, want, rtol=1e-12), (got.item(), want.item())
    return got.item()


def test_global_grad_norm_counts_every_element_once():
    norms = run_distributed(_norm, 2)
    assert norms[0] == norms[1]
