"""``auto`` recipe settings ([Note: auto settings]): what each resolves to on a given machine,
with its reason; explicit values win; a global batch that does not divide names the nearest
valid values; ``etp-train --tune`` times the candidates and writes the fastest as overrides
that ``--overrides`` applies."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from etp.recipe import Recipe, RecipeError
from etp.train.auto import FP8_EAGER_TOKENS, Machine, resolve_auto

ROOT = Path(__file__).resolve().parents[2]
FLAGSHIP, WIDE, TINY = (ROOT / "recipes" / name for name in ("moe_flagship.yaml", "moe_wide.yaml", "tiny_moe_cpu.yaml"))
H100 = dict(cuda=True, gpu_name="NVIDIA H100 80GB HBM3", gpu_memory=80 * 2**30, sm90=True)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_shipped_gpu_recipes_resolve_for_every_gpu_count(world):
    for path in (FLAGSHIP, WIDE):
        recipe, notes = resolve_auto(Recipe.from_yaml(path), Machine(world, world, **H100))
        assert recipe.auto == () and recipe.parallel.world_size == world
        assert (recipe.etp.etp_size, recipe.etp.expert_etp_size) == (world, world)
        assert recipe.train.cuda_graph == "step" and not recipe.parallel.overlap_grad_reduce
        assert recipe.etp.gather_dtype == "fp8_tensorwise"  # captured: FP8 pays
        assert len(notes) == 6 and all("auto ->" in n for n in notes)
        recipe.check_world_size(world)


def test_a_recipe_that_cannot_be_captured_stays_eager_and_fp8_follows_the_batch():
    eager = Recipe.from_yaml(FLAGSHIP, moe_token_dispatcher_type="alltoall", micro_batch_size=2)
    recipe, notes = resolve_auto(eager, Machine(4, 4, **H100))
    assert recipe.train.cuda_graph == "none" and any("cannot be captured" in n for n in notes)
    assert recipe.etp.gather_dtype == "param"  # 2 x 2048 tokens per micro-batch, eager: host-bound
    wide = Recipe.from_yaml(WIDE, moe_token_dispatcher_type="alltoall", micro_batch_size=16)
    assert wide.train.micro_batch_size * wide.model.seq_length >= FP8_EAGER_TOKENS
    assert resolve_auto(wide, Machine(4, 4, **H100))[0].etp.gather_dtype == "fp8_tensorwise"


def test_etp_dispatcher_is_captured_where_its_padded_rows_fit():
    """Captured, etp's dispatcher hands the experts its padded receive buffer (EP x min(topk,
    local experts) rows per token, 16 here against topk 4): auto captures where the memory
    audit counts those rows into the GPU, stays eager and says why where they do not, and an
    explicit cuda_graph=step still captures."""
    from etp.audit import activation_bytes, padded_expert_rows

    ep = dict(moe_token_dispatcher_type="etp", expert_model_parallel_size=4, micro_batch_size=4,
              global_batch_size=16, etp={"etp_size": 4, "expert_etp_size": 1})
    h200 = Machine(4, 4, **dict(H100, gpu_name="NVIDIA H200", gpu_memory=141 * 2**30))
    recipe, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP, **ep), h200)
    assert recipe.train.cuda_graph == "step" and recipe.etp.gather_dtype == "fp8_tensorwise"
    assert any(n.startswith("cuda_graph auto -> step") and "16 expert rows per token" in n for n in notes), notes
    captured = recipe.replace(etp={"gather_dtype": "param"})
    assert padded_expert_rows(captured) == 16 and padded_expert_rows(captured.replace(cuda_graph="none")) == 4
    # The padding's SwiGLU input, 12 rows x 2 x ffn 16-bit values per token, over 8 layers.
    extra = activation_bytes(captured) - activation_bytes(captured.replace(cuda_graph="none"))
    assert extra == 8 * 12 * 2 * 1408 * 2 * 2048 * 4
    small = Machine(4, 4, **dict(H100, gpu_memory=40 * 2**30))
    eager, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP, **ep), small)
    assert eager.train.cuda_graph == "none"
    assert any(n.startswith("cuda_graph auto -> none: captured, etp's dispatcher hands the experts 16 rows") for n in notes)
    forced, _ = resolve_auto(Recipe.from_yaml(FLAGSHIP, **ep, cuda_graph="step"), small)
    assert forced.train.cuda_graph == "step" and forced.etp.gather_dtype == "fp8_tensorwise"


def test_an_eager_step_takes_fp8_gathers_where_only_they_fit():
    """Fitting comes before the host-bound rule: DeepSeek-V3's shape at 8 x 80 GiB, eager (its
    captured step's padded expert rows do not fit), needs FP8's halved gathers; with more
    memory an eager step keeps bf16."""
    dsv3 = Recipe.from_yaml(ROOT / "recipes" / "deepseek_v3_shaped.yaml")
    tight, notes = resolve_auto(dsv3, Machine(8, 8, **H100))
    assert tight.train.cuda_graph == "none" and tight.etp.gather_dtype == "fp8_tensorwise"
    assert any("only FP8 gathers fit this GPU" in n for n in notes), notes
    roomy_gpu = Machine(8, 8, **dict(H100, gpu_memory=141 * 2**30))
    roomy, _ = resolve_auto(dsv3.replace(cuda_graph="none"), roomy_gpu)
    assert roomy.etp.gather_dtype == "param"
    # With that memory auto captures the step instead (its padded expert rows fit), and FP8 pays.
    captured, notes = resolve_auto(dsv3, roomy_gpu)
    assert captured.train.cuda_graph == "step" and captured.etp.gather_dtype == "fp8_tensorwise", notes


def test_experts_that_read_token_counts_on_the_host_stay_eager():
    """fp32 experts, and any experts on a GPU older than sm90, run one GEMM per expert sized by
    counts read on the host, which a capture cannot hold: auto leaves those recipes eager and
    an explicit ``cuda_graph: step`` is refused naming the key."""
    fp32, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP, bf16=False), Machine(2, 2, **H100))
    assert fp32.train.cuda_graph == "none" and any("bf16" in n for n in notes)
    a100 = dict(H100, gpu_name="NVIDIA A100-SXM4-80GB", sm90=False)
    older, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP), Machine(2, 2, **a100))
    assert older.train.cuda_graph == "none" and any("sm90" in n for n in notes)
    with pytest.raises(RecipeError, match="bf16"):
        Recipe.from_yaml(FLAGSHIP, bf16=False, cuda_graph="step", overlap_grad_reduce=False)
    with pytest.raises(RecipeError, match="moe_ffn_hidden_size"):
        Recipe.from_yaml(FLAGSHIP, moe_ffn_hidden_size=1404, cuda_graph="step", overlap_grad_reduce=False)


def test_explicit_values_win_and_cpu_resolves_without_gpu_features():
    recipe, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP, cuda_graph="none", etp={"etp_size": 2}),
                                 Machine(4, 4, **H100))
    assert recipe.train.cuda_graph == "none" and recipe.etp.etp_size == 2 and recipe.etp.expert_etp_size == 4
    assert not any(n.startswith(("cuda_graph", "etp.etp_size ")) for n in notes)
    cpu, _ = resolve_auto(Recipe.from_yaml(TINY), Machine(2, 2))
    assert (cpu.train.cuda_graph, cpu.etp.gather_dtype, cpu.etp.gather_reuse) == ("none", "param", "chain")


def test_micro_batch_auto_takes_the_largest_share_of_the_rank_batch_that_fits():
    """Sizes are checked against the audit's own verdict for the settings auto then picks: the
    chosen one fits and every larger divisor of the rank's share does not."""
    from etp.audit import fits, predict_peak

    for world, gpu_gib, expected in ((4, 80, 8), (8, 80, 4), (2, 80, 16), (4, 36, 4)):
        machine = Machine(world, world, **dict(H100, gpu_memory=gpu_gib * 2**30))
        recipe, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP), machine)
        assert recipe.train.micro_batch_size == expected, (world, gpu_gib)
        assert recipe.global_batch_size(world) == 32  # the recipe's, split differently
        assert any(n.startswith(f"micro_batch_size auto -> {expected}: the largest") for n in notes)
        share = 32 // world
        for larger in (m for m in range(expected + 1, share + 1) if share % m == 0):
            bigger, _ = resolve_auto(Recipe.from_yaml(FLAGSHIP, micro_batch_size=larger), machine)
            assert not fits(predict_peak(bigger, world), machine.gpu_memory), (world, gpu_gib, larger)
    small, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP), Machine(4, 4, **dict(H100, gpu_memory=24 * 2**30)))
    assert small.train.micro_batch_size == 1 and any("no micro-batch fits" in n for n in notes)
    cpu, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP), Machine(4, 4))
    assert cpu.train.micro_batch_size == 8 and any("no GPU memory" in n for n in notes)
    explicit, notes = resolve_auto(Recipe.from_yaml(FLAGSHIP, micro_batch_size=2), Machine(4, 4, **H100))
    assert explicit.train.micro_batch_size == 2 and not any(n.startswith("micro_batch_size") for n in notes)


def test_micro_batch_auto_refuses_what_it_cannot_size():
    with pytest.raises(RecipeError, match="micro_batch_size.*needs global_batch_size"):
        Recipe.from_yaml(FLAGSHIP, global_batch_size=None)
    with pytest.raises(RecipeError, match="micro_batch_size.*use_torch_fsdp2.*set micro_batch_size=N"):
        Recipe.from_yaml(FLAGSHIP, use_torch_fsdp2=True, etp={"etp_size": 1, "expert_etp_size": 1})


def test_resident_weights_that_do_not_fit_stay_chained():
    small_gpu = dict(H100, gpu_memory=48 * 2**30)
    recipe, notes = resolve_auto(Recipe.from_yaml(WIDE), Machine(2, 2, **small_gpu))
    assert recipe.etp.gather_reuse == "chain" and any("would not fit" in n for n in notes)


def test_etp_sizes_stay_inside_one_host():
    recipe, _ = resolve_auto(Recipe.from_yaml(FLAGSHIP, global_batch_size=64), Machine(16, 8, **H100))
    assert (recipe.etp.etp_size, recipe.etp.expert_etp_size) == (8, 8)


def test_a_global_batch_that_does_not_divide_names_the_nearest_valid_values():
    with pytest.raises(RecipeError, match="nearest valid values are 24 or 36"):
        Recipe.from_yaml(FLAGSHIP, world_size=6, global_batch_size=32, micro_batch_size=2)
    with pytest.raises(RecipeError, match="nearest valid values are 30 or 36"):  # auto: any split of the share
        Recipe.from_yaml(FLAGSHIP, world_size=6, global_batch_size=32)


def test_capture_turns_off_overlapped_gradient_reduction_instead_of_refusing():
    recipe = Recipe.from_yaml(FLAGSHIP, cuda_graph="step", overlap_grad_reduce=True)
    assert not recipe.parallel.overlap_grad_reduce and "overlap_grad_reduce turned off" in recipe.notes[0]


@pytest.mark.slow  # times real candidate runs; test_tune_candidates.py holds the candidate list by default
def test_tune_times_the_candidates_and_writes_overrides_etp_train_accepts(tmp_path, capsys):
    out = tmp_path / "best.yaml"
    base = [sys.executable, "-m", "etp.train", "--recipe", str(TINY), "--set", "global_batch_size=2",
            "--set", "micro_batch_size=1", "--set", "seq_length=32"]
    report = tmp_path / "tune.json"
    done = subprocess.run([*base, "--tune", str(out), "--json", str(report)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    # CPU: gather_reuse chain / kept (for one micro-batch per rank: "pass") at micro-batch 1 (the
    # only size under a global batch of 2 on 2 ranks); cuda_graph and FP8 have one choice here.
    assert done.stdout.count("etp-train --tune [") == 2 * 2
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and "ms/iter" not in line]
    assert len(table) == 2 and sum("fastest" in line for line in table) == 1
    assert {"etp.gather_reuse=chain", "etp.gather_reuse=pass"} <= {w for line in table for w in line.split()}
    best = yaml.safe_load(out.read_text())
    assert set(best) == {"cuda_graph", "micro_batch_size", "etp"} and best["etp"]["gather_reuse"] in ("chain", "pass")
    # --json: every candidate's figures, the fastest marked, and where they came from
    data = json.loads(report.read_text())
    assert data["best_overrides"] == best and "--tune" in data["provenance"]["command"]
    assert len(data["candidates"]) == 2 and sum(c["fastest"] for c in data["candidates"]) == 1
    fastest = next(c for c in data["candidates"] if c["fastest"])
    assert fastest["overrides"] == best and fastest["ms_per_iter"] == min(c["ms_per_iter"] for c in data["candidates"])
    # etp-train takes the file as it is: the recipe it builds carries the winner's values (a run of
    # it would only repeat the candidate's own run above).
    from etp.train.main import _load, _parse

    tuned = _load(_parse([*base[3:], "--overrides", str(out)]))
    assert tuned.train.micro_batch_size == best["micro_batch_size"]
    assert (tuned.train.cuda_graph, tuned.etp.gather_reuse) == (best["cuda_graph"], best["etp"]["gather_reuse"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- not a mapping\n")
    from etp.train.main import main  # refused before any rank starts: in this process

    assert main([*base[3:], "--overrides", str(bad)]) == 2
    assert "expected a YAML mapping" in capsys.readouterr().err
    assert main([*base[3:], "--tune", str(out), "--resume"]) == 2
    assert "drop --resume" in capsys.readouterr().err


def test_tune_candidates_keep_weights_as_auto_would_at_each_micro_batch():
    from etp.train.tune import candidates

    recipe = Recipe.from_yaml(TINY, global_batch_size=8, micro_batch_size="auto",
                              etp={"gather_reuse": "auto"}, world_size=2)
    found = {(c.overrides["micro_batch_size"], c.overrides["etp"]["gather_reuse"]) for c in candidates(
        recipe, Machine(world_size=2, ranks_per_host=2))}
    # 4 samples per rank: micro-batches of 4 (one per step: kept for the pass), 2 and 1 (kept for the step)
    assert found == {(4, "chain"), (4, "pass"), (2, "chain"), (2, "step"), (1, "chain"), (1, "step")}
    resolved, _ = resolve_auto(recipe, Machine(world_size=2, ranks_per_host=2, **H100))
    assert (resolved.train.micro_batch_size, resolved.etp.gather_reuse) in found


def test_tune_weighs_fp8_gathers_where_their_format_says_they_pay():
    """--tune's gather candidates are the parameters' own and, where the FP8 format says its
    GEMMs pay and it takes the recipe's dtype (sm90+, bf16), fp8_tensorwise; ``auto`` asks the same."""
    from etp.train.auto import quantized_gathers_refusal
    from etp.train.tune import candidates

    def dtypes(recipe, machine):
        return {c.overrides["etp"]["gather_dtype"] for c in candidates(recipe, machine, micro_batches=1)}

    flagship = Recipe.from_yaml(FLAGSHIP, world_size=2, etp={"gather_reuse": "chain"})
    assert dtypes(flagship, Machine(2, 2, **H100)) == {"param", "fp8_tensorwise"}
    a100 = Machine(2, 2, **dict(H100, sm90=False))
    assert dtypes(flagship, a100) == {"param"} and "sm90" in quantized_gathers_refusal(flagship, a100)
    fp32 = Recipe.from_yaml(FLAGSHIP, world_size=2, bf16=False, etp={"gather_reuse": "chain"})
    assert dtypes(fp32, Machine(2, 2, **H100)) == {"param"}
    assert "bf16" in quantized_gathers_refusal(fp32, Machine(2, 2, **H100))
