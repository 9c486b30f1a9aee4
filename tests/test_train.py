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


def test_cpu_recipe_profile_and_report(tmp_path, capfd):
    """--profile writes a trace and a breakdown per rank (CPU: no kernels, so the GPU classes are
    zero, but the schedule, the export and the classifier run); --json carries the FLOP count
    and the audit's predicted peak; --audit adds the predicted peak (measured on CUDA only)."""
    import json

    from etp.megatron.flops import training_flops
    from etp.megatron.recipe import Recipe
    from etp.megatron.train import main

    recipe = ROOT / "recipes" / "tiny_moe_cpu.yaml"
    report = tmp_path / "run.json"
    assert main(["--recipe", str(recipe), "--train-iters", "6", "--log-interval", "2", "--profile",
                 str(tmp_path / "prof"), "--json", str(report), "--peak-tflops", "1",
                 "--audit", str(tmp_path / "audit.json")]) == 0
    out = capfd.readouterr().out
    assert "time per iteration" in out and "MFU" in out
    for rank in (0, 1):
        assert (tmp_path / "prof" / f"trace_rank{rank}.json").stat().st_size > 0
        table = json.loads((tmp_path / "prof" / f"breakdown_rank{rank}.json").read_text())
        assert table["iterations"] == 2 and table["wall"] > 0
    data = json.loads(report.read_text())
    r = Recipe.from_yaml(recipe)
    assert data["flops_per_iter_per_rank"] == training_flops(r, 4 * 64)  # one microbatch of 4 x 64 tokens
    assert data["peak_tflops"] == 1.0 and data["mfu"] == data["tflops_per_rank"]
    assert data["attention_backend"] == "sdpa" and data["profile"]["iterations"] == 2
    assert data["predicted_peak_gib"] > 0
    # 6 iterations, logged in pairs: wait 2, warm-up 1 (iteration 3), active 2 (iterations 4, 5).
    assert [r["profiled"] for r in data["log"]] == [False, True, True]
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["ranks"][0]["peak"]["predicted"] > 0 and audit["ranks"][0]["peak"]["measured"] is None  # CPU


def _deterministic_flag(ctx):
    from etp.megatron.reproducible import enable_determinism

    before = torch.are_deterministic_algorithms_enabled()
    try:
        return before, enable_determinism()
    finally:
        torch.use_deterministic_algorithms(False)


def test_deterministic_runs_repeat_bitwise(tmp_path):
    import json

    from etp.megatron.train import main

    losses = []
    for run in range(2):
        path = tmp_path / f"run{run}.json"
        assert main(["--recipe", str(ROOT / "recipes" / "tiny_moe_cpu.yaml"), "--train-iters", "5",
                     "--set", "deterministic=true", "--json", str(path)]) == 0
        data = json.loads(path.read_text())
        assert data["determinism"]["use_deterministic_algorithms"] is True  # the flag reached torch
        assert data["determinism"]["CUBLAS_WORKSPACE_CONFIG"]
        losses.append(data["losses"])
    assert losses[0] == losses[1]
    before, state = run_distributed(_deterministic_flag, 1)[0]
    assert before is False and state["use_deterministic_algorithms"] is True
