"""The etp-train driver on the CPU recipe (megatron-core's GPTModel, the model GPUs train): a run,
its profile and report, a run with QK norm and shared experts, ETP-sharded training against the
same model unsharded; and the global gradient norm (every logical element once: shards summed
over their group, padding never, replicated params once)."""
import contextlib
import copy
import os
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from parity import TinyMoE

from etp import ETPConfig, ETPShardedParam, build_etp_groups, finalize_grads, global_grad_norm, wrap_module_params_etp

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_moe_cpu.yaml"


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    """One etp-train run of the CPU recipe (6 iterations, logged in pairs) with --profile,
    --json, --peak-tflops and --audit: (exit code, the ranks' stdout, its directory). Both
    tests below read it (a run costs ~10 s of start-up, its iterations ~70 ms each)."""
    tmp = tmp_path_factory.mktemp("run")
    recipe = ROOT / "recipes" / "tiny_moe_cpu.yaml"
    code, out = _run_main(tmp, "--recipe", str(recipe), "--train-iters", "6", "--log-interval", "2", "--profile",
                          str(tmp / "prof"), "--json", str(tmp / "run.json"), "--peak-tflops", "1",
                          "--audit", str(tmp / "audit.json"))
    return code, out, tmp


def _run_main(tmp, *argv) -> tuple[int, str]:
    """etp-train's ``main(argv)`` with the ranks' stdout captured: (exit code, stdout)."""
    from etp.train.main import main

    stdout = tmp / "stdout.txt"
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(stdout, "w") as f:
            os.dup2(f.fileno(), 1)  # the spawned ranks write to file descriptor 1
            code = main(list(argv))
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return code, stdout.read_text()


def test_cpu_recipe_trains(profiled_run):
    """The run logs every second iteration and its loss goes down."""
    code, out, _ = profiled_run
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("iter")]
    assert len(lines) == 3 and lines[-1].startswith("iter     6/6"), lines
    losses = [float(line.split("loss ")[1].split()[0]) for line in lines]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_cpu_recipe_trains_qk_norm_and_shared_experts(tmp_path):
    """What a user types to try two architecture keys on CPU: the run trains megatron-core's
    GPTModel with them, its QK norms and shared experts there, the shared experts' linears
    ETP-sharded beside the attention's, the routed experts' and the output layer's."""
    code, out = _run_main(tmp_path, "--recipe", str(TINY), "--set", "qk_layernorm=true",
                          "--set", "moe_shared_expert_intermediate_size=64", "--train-iters", "6", "--log-interval", "3")
    assert code == 0, out
    assert "wrapped 13 weights" in out, out  # 2 layers x (qkv, proj, 2 expert stacks, 2 shared) + output
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("iter")]
    assert len(losses) == 2 and losses[1] < losses[0], losses


#: architecture keys beyond the tiny recipe's: QK norm, shared experts, sigmoid routing with an
#: expert bias (updated by megatron-core's finalize_model_grads inside TorchStep), z-loss
ARCHITECTURE = dict(qk_layernorm=True, moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_z_loss_coeff=1e-3)


def _full(param) -> torch.Tensor:
    """The logical tensor of a parameter, gathered from its shards if ETP sharded it."""
    import torch.distributed as dist

    if not isinstance(param, ETPShardedParam):
        return param.detach().clone()
    pieces = [torch.empty_like(param.data) for _ in range(param.etp_group.size)]
    dist.all_gather(pieces, param.data.contiguous(), group=param.etp_group.ag_group)
    return torch.cat(pieces)[: param.etp_layout.rows].reshape(param.logical_shape)


def _etp_and_unsharded(ctx, iterations: int):
    """etp-train's CPU stack (build_model, apply_etp, TorchStep, language_model_loss, Batches)
    trained ``iterations`` steps twice in the same ranks: at ETP 2 (every weight sharded over both
    ranks) and at ETP 1 (the same GPTModel unwrapped, data-parallel). Per run: the data-parallel
    mean loss and the grad norm per iteration, the expert biases and every full weight at the end."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from etp.megatron.groups import build_megatron_etp_groups
    from etp.megatron.model import apply_etp
    from etp.recipe import Recipe
    from etp.train.batches import Batches
    from etp.train.model_build import build_model
    from etp.train.optimizer_steps import TorchStep

    ps.initialize_model_parallel()
    runs = {}
    try:
        for size in (2, 1):
            recipe = Recipe.from_yaml(TINY, world_size=2, train_iters=iterations, **ARCHITECTURE,
                                      etp={"etp_size": size, "expert_etp_size": size})
            model, loss_fn, _ = build_model(recipe, torch.device("cpu"))
            groups = build_megatron_etp_groups(recipe.etp)
            summary = apply_etp(model, recipe.etp, groups)
            step = TorchStep(recipe, model, groups, ps.get_tensor_model_parallel_group())
            micro = recipe.num_microbatches(2)
            batches = Batches(recipe, ps.get_data_parallel_rank(), torch.device("cpu"), micro)
            losses, norms = [], []
            for iteration in range(iterations):
                total = torch.zeros(())
                for index, context in enumerate(step.microbatches(micro)):
                    with context:
                        loss, objective = loss_fn(model, batches.get(iteration, index))
                        (objective / micro).backward()
                    total += loss.detach() / micro
                norms.append(float(step.step(recipe.train.lr, lambda name: contextlib.nullcontext())))
                dist.all_reduce(total)
                losses.append(float(total) / 2)
            biases = [m.expert_bias.clone() for m in model.modules() if getattr(m, "expert_bias", None) is not None]
            runs[size] = dict(losses=losses, norms=norms, biases=biases, sharded=summary.bytes_after < summary.bytes_before,
                              weights={name: _full(p) for name, p in model.named_parameters()})
        return runs
    finally:
        ps.destroy_model_parallel()


def test_etp_training_matches_the_unsharded_model():
    """Three steps of the CPU recipe with QK norm, gated shared experts and sigmoid routing with
    an expert bias: the ETP-sharded run's losses, grad norms, expert biases and weights equal the
    unsharded run's within fp32 reduction-order noise (the shards' reduce-scatter against the
    replicas' all-reduce; about 1e-7 relative per sum). A gradient left unaveraged or a bias
    stepped on one rank's counts moves them by orders of magnitude more."""
    results = run_distributed(_etp_and_unsharded, 2, 3)
    for rank in results:
        sharded, reference = rank[2], rank[1]
        assert sharded["sharded"] and not reference["sharded"]
        assert sharded["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert reference["losses"][-1] < reference["losses"][0]
        assert sharded["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert len(sharded["biases"]) == 2 and any(b.abs().sum() > 0 for b in sharded["biases"])
        for mine, theirs in zip(sharded["biases"], reference["biases"]):
            torch.testing.assert_close(mine, theirs)
        assert sharded["weights"].keys() == reference["weights"].keys()
        for name, weight in sharded["weights"].items():
            torch.testing.assert_close(weight, reference["weights"][name], rtol=1e-4, atol=1e-6, msg=name)


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


def test_cpu_recipe_profile_and_report(profiled_run):
    """--profile writes a trace and a breakdown per rank (CPU: no kernels, so the GPU classes are
    zero, but the schedule, the export and the classifier run); --json carries the FLOP count
    and the audit's predicted peak; --audit adds the predicted peak (measured on CUDA only)."""
    import json

    from etp.recipe import Recipe
    from etp.train.flops import training_flops

    code, out, tmp_path = profiled_run
    assert code == 0
    recipe, report = ROOT / "recipes" / "tiny_moe_cpu.yaml", tmp_path / "run.json"
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
    assert data["predicted_peak_gib"] > 0 and isinstance(data["param_bits_sum"], int)
    # 6 iterations, logged in pairs: wait 2, warm-up 1 (iteration 3), active 2 (iterations 4, 5).
    assert [r["profiled"] for r in data["log"]] == [False, True, True]
    # [Note: collector pauses]: every rank's, the slowest per window
    assert data["gc_ms_per_iter_max_rank"] >= 0 and "garbage collection" in out
    assert all(r["gc_ms_per_iter_max_rank"] >= r["gc_ms_per_iter"] >= 0 for r in data["log"])
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["ranks"][0]["peak"]["predicted"] > 0 and audit["ranks"][0]["peak"]["measured"] is None  # CPU


def _deterministic_run(path):
    import json

    from etp.train.main import main

    assert main(["--recipe", str(ROOT / "recipes" / "tiny_moe_cpu.yaml"), "--train-iters", "5",
                 "--set", "deterministic=true", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["determinism"]["use_deterministic_algorithms"] is True  # the flag reached torch
    assert data["determinism"]["CUBLAS_WORKSPACE_CONFIG"]
    return data["losses"]


def test_deterministic_reaches_torch(tmp_path):
    _deterministic_run(tmp_path / "run.json")


@pytest.mark.slow  # gloo on CPU repeats itself without the flag too: the GPU is where this can fail
def test_deterministic_runs_repeat_bitwise(tmp_path):
    assert _deterministic_run(tmp_path / "run0.json") == _deterministic_run(tmp_path / "run1.json")


def test_enable_determinism_switches_torch(monkeypatch):
    """enable_determinism turns torch's flag on from off (in this process, restored after)."""
    from etp.train.reproducible import enable_determinism

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("ETP_DETERMINISTIC_WARN_ONLY", raising=False)
    monkeypatch.delenv("ETP_DETERMINISTIC_FILL", raising=False)
    import torch.utils.deterministic as torch_deterministic

    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch_deterministic.fill_uninitialized_memory)
    assert saved[0] is False
    try:
        state = enable_determinism()
        assert state["use_deterministic_algorithms"] is True and torch.are_deterministic_algorithms_enabled()
        assert state["CUBLAS_WORKSPACE_CONFIG"] == os.environ["CUBLAS_WORKSPACE_CONFIG"] and not state["warn_only"]
        # No NaN fill of every new allocation (etp writes what it reads) unless asked for.
        assert state["fill_uninitialized_memory"] is False and not torch_deterministic.fill_uninitialized_memory
        monkeypatch.setenv("ETP_DETERMINISTIC_FILL", "1")
        assert enable_determinism()["fill_uninitialized_memory"] and torch_deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        torch_deterministic.fill_uninitialized_memory = saved[4]


def test_param_bits_sum_sees_a_one_ulp_change():
    from etp.train.reporting import param_bits_sum

    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    b = copy.deepcopy(a)
    assert param_bits_sum(a) == param_bits_sum(b)
    with torch.no_grad():
        b[1].weight[0, 0] = torch.nextafter(b[1].weight[0, 0].float(), torch.tensor(9.0)).to(torch.bfloat16)
        if torch.equal(b[1].weight, a[1].weight):  # the fp32 step rounded back: take the next bf16 up
            b[1].weight.view(torch.int16)[0, 0] += 1
    assert not torch.equal(a[1].weight, b[1].weight)
    assert param_bits_sum(a) != param_bits_sum(b)


def test_param_bits_sum_in_chunks_equals_the_whole_sum(monkeypatch):
    from etp.train import reporting

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5).to(torch.bfloat16), torch.nn.Linear(5, 3))
    whole = sum(int(p.detach().view(torch.int16 if p.element_size() == 2 else torch.int32).to(torch.int64).sum())
                for p in model.parameters())
    monkeypatch.setattr(reporting, "_BITS_CHUNK", 3)  # chunks of 3 elements, a ragged last one
    assert reporting.param_bits_sum(model) == whole
