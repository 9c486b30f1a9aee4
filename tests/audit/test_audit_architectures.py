"""The memory audit of published-architecture features: the weight inventory against the
megatron-core GPTModel that etp-train builds from the same recipe on CPU (every name and shape,
one feature at a time and all together), the parameter count of each architecture recipe
against its published shapes, and etp-audit on each recipe."""
import json
from pathlib import Path

import pytest
from harness import run_distributed

from etp.audit import weight_inventory
from etp.recipe import Recipe
from etp.train.audit_command import main

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, seq_length=16,
            vocab_size=256, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
            swiglu=True, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
            untie_embeddings_and_output_weights=True, micro_batch_size=2, train_iters=1, lr=1e-3)
FEATURES = {
    "shared experts": dict(moe_shared_expert_intermediate_size=48),
    "shared experts, gated": dict(moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True),
    "qk layernorm (RMSNorm)": dict(qk_layernorm=True),
    "qk layernorm (LayerNorm)": dict(qk_layernorm=True, normalization="LayerNorm"),
    "kv_channels, GQA": dict(kv_channels=24, num_query_groups=2),
    "GQA, one group": dict(num_query_groups=1),
    "sigmoid, expert bias, grouped top-k": dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none", moe_router_num_groups=2, moe_router_group_topk=1),
    "dense then MoE": dict(num_layers=3, moe_layer_freq=[0, 1, 1]),
    "MoE every 2nd layer": dict(num_layers=4, moe_layer_freq=2),
    "tied embeddings": dict(untie_embeddings_and_output_weights=False),
    "SequentialMLP experts, shared": dict(moe_grouped_gemm=False, moe_shared_expert_intermediate_size=48),
    "all": dict(num_layers=3, moe_layer_freq=[0, 1, 1], moe_shared_expert_intermediate_size=48,
                moe_shared_expert_gate=True, qk_layernorm=True, kv_channels=24, num_query_groups=2,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_load_balancing_type="none", moe_router_num_groups=2, moe_router_group_topk=1,
                untie_embeddings_and_output_weights=False),
}


def _built(ctx, variants):
    """name -> shape of the GPTModel etp-train builds from each recipe (CPU initialization)."""
    import torch
    from megatron.core import parallel_state as ps

    from etp.train.model_build import gpt_model, transformer_config

    torch.cuda.current_device = lambda: "cpu"  # where megatron's router puts its expert-bias buffers
    ps.initialize_model_parallel()
    try:
        out = []
        for values in variants:
            recipe = Recipe.from_dict(values)
            model = gpt_model(recipe, transformer_config(recipe, torch.device("cpu")))
            out.append({name: tuple(p.shape) for name, p in model.named_parameters()})
        return out
    finally:
        ps.destroy_model_parallel()


def test_inventory_names_every_weight_of_the_built_model():
    variants = [{**BASE, **features} for features in FEATURES.values()]
    built = run_distributed(_built, 1, variants)[0]
    for case, values, model in zip(FEATURES, variants, built):
        recipe = Recipe.from_dict(values)
        predicted = {w.name: w.shape for w in weight_inventory(recipe)}
        assert predicted == model, case
        assert recipe.num_params() == sum(_numel(shape) for shape in model.values()), case


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_inventory_can_tell_a_missing_feature():
    """The comparison above fails when the inventory forgets a feature's weights."""
    values = {**BASE, **FEATURES["all"]}
    full = {w.name for w in weight_inventory(Recipe.from_dict(values))}
    for key, off in (("qk_layernorm", False), ("moe_shared_expert_intermediate_size", None),
                     ("moe_layer_freq", 1), ("untie_embeddings_and_output_weights", True)):
        changed = {**values, key: off, **({"moe_shared_expert_gate": False} if key.startswith("moe_shared") else {})}
        assert {w.name for w in weight_inventory(Recipe.from_dict(changed))} != full, key


# The published configurations (Hugging Face config.json of each model; see each recipe's header)
# and their published parameter counts.
PUBLISHED = {
    "olmoe_1b_7b": dict(layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=16, kv_channels=128,
                        num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=1024, vocab_size=50304,
                        qk_layernorm=True, total=6.9e9, active=1.3e9),
    "qwen3_30b_a3b": dict(layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
                          num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, vocab_size=151936,
                          qk_layernorm=True, total=30.5e9, active=3.3e9),
    "mixtral_8x7b": dict(layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, kv_channels=128,
                         num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336, vocab_size=32000,
                         qk_layernorm=False, total=46.7e9, active=12.9e9),
    # MLA replaced by standard attention: the shapes below are DeepSeek-V3's, the counts are not
    "deepseek_v3_shaped": dict(layers=61, hidden_size=7168, num_attention_heads=128, num_experts=256,
                               moe_router_topk=8, moe_ffn_hidden_size=2048, vocab_size=129280, ffn_hidden_size=18432,
                               moe_shared_expert_intermediate_size=2048, moe_router_num_groups=8,
                               moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5, qk_layernorm=False),
}


def _full_depth(name):
    recipe = Recipe.from_yaml(ROOT / f"recipes/{name}.yaml")
    layers = PUBLISHED[name]["layers"]
    dense = recipe.model.moe_layers.count(False)  # the leading dense layers stay
    freq = f"([0]*{dense}+[1]*{layers - dense})" if dense else 1
    return recipe, recipe.replace(num_layers=layers, moe_layer_freq=freq)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_architecture_recipes_have_the_published_shapes(name):
    published = dict(PUBLISHED[name])
    layers, total, active = published.pop("layers"), published.pop("total", None), published.pop("active", None)
    recipe, full = _full_depth(name)
    for key, value in published.items():
        assert recipe[key] == value, key
    assert recipe.model.untie_embeddings_and_output_weights  # none of the four ties them
    assert len(full.model.moe_layers) == layers
    if total is not None:  # published counts, rounded to 0.1 B (Qwen's 3.3 B active is 3.35 B)
        assert abs(full.num_params() / total - 1) < 0.02, full.num_params()
        assert abs(full.num_params(active=True) / active - 1) < 0.02, full.num_params(active=True)
    if name == "mixtral_8x7b":  # the count Mixtral's checkpoint holds
        assert full.num_params() == 46_702_792_704
    if name == "deepseek_v3_shaped":
        assert full.model.moe_layers[:4] == (False, False, False, True) and all(full.model.moe_layers[3:])
        m = recipe.model
        assert (m.moe_router_score_function, m.moe_router_enable_expert_bias, m.moe_router_load_balancing_type,
                m.moe_aux_loss_coeff) == ("sigmoid", True, "none", 0.0)


#: recipe -> the GPUs its depth was chosen for
SHIPPED_ON = {"olmoe_1b_7b": 4, "qwen3_30b_a3b": 4, "mixtral_8x7b": 4, "deepseek_v3_shaped": 8}


@pytest.mark.parametrize("name", list(SHIPPED_ON))
def test_architecture_recipes_fit_their_gpus_with_etp_only_as_their_header_says(name, capsys):
    import re

    gpus, path = SHIPPED_ON[name], ROOT / f"recipes/{name}.yaml"
    assert main(["--recipe", str(path), "--world-size", str(gpus), "--gpu-memory", "80GiB", "--json", "-"]) == 0
    peaks = json.loads(capsys.readouterr().out)["peaks"]
    assert peaks["with_etp"]["fits"] and not peaks["without_etp"]["fits"]
    # the header's figures for this depth and GPU count are the audit's
    header = re.search(rf"{gpus} GPUs:\s+without ETP ([\d.]+) GiB, does not fit; with ETP ([\d.]+) \+ ([\d.]+) GiB, fits",
                       path.read_text())
    assert header, f"{path.name}: no {gpus}-GPU verdict in the header"
    gib = 2**30
    assert float(header.group(1)) == round(peaks["without_etp"]["peak"] / gib, 1)
    assert float(header.group(2)) == round(peaks["with_etp"]["peak"] / gib, 1)
    assert float(header.group(3)) == round(peaks["with_etp"]["outside_allocator"] / gib, 1)
    # and the peer's: megatron-core's distributed optimizer without ETP, at micro-batch 1 (the
    # architectures' share per rank is a few samples; the peer fits at 1 or not at all)
    assert main(["--recipe", str(path), "--world-size", str(gpus), "--gpu-memory", "80GiB", "--json", "-",
                 "--distributed-optimizer", "--set", "use_distributed_optimizer=true", "--set", "cuda_graph=none",
                 "--set", "micro_batch_size=1"]) == 0
    peer = json.loads(capsys.readouterr().out)["peaks"]["without_etp"]
    said = re.search(r"distributed optimizer\s+(?:#\s+)?without ETP ([\d.]+) GiB, (fits|does not fit)", path.read_text())
    assert said, f"{path.name}: no verdict for the distributed optimizer"
    assert (float(said.group(1)), said.group(2) == "fits") == (round(peer["peak"] / gib, 1), peer["fits"])


# Peaks allocated (GiB, rank 0) that etp-train --audit measured on 4 x H100 80GB (79.2 GiB each)
# with each recipe's defaults and the overrides listed (BENCHMARKS.md, "The memory audit against
# measured peaks"): the experts rebuilding both GEMMs' inputs in backward (etp/rebuilt_activations.py), 2026-11-27;
# DeepSeek-V3's 64-expert run at 6491b6f, when fc2's input was still kept (the prediction of today's
# code is lower by the six MoE layers' SwiGLU outputs, and still within the tolerance).
MEASURED_PEAKS_4XH100 = {
    "moe_flagship": ((), 26.11),
    "moe_wide": ((), 54.46),
    "olmoe_1b_7b": ((), 45.29),
    "qwen3_30b_a3b": ((), 52.48),
    "mixtral_8x7b": ((), 43.06),
    "deepseek_v3_shaped": (("num_experts=64", "expert_model_parallel_size=1", "moe_token_dispatcher_type=local",
                            "cuda_graph=none", "seq_length=4096"), 57.51),
}


@pytest.mark.parametrize("name", sorted(MEASURED_PEAKS_4XH100))
def test_predicted_peak_of_each_recipe_within_five_percent_of_measured(name, capsys):
    overrides, measured = MEASURED_PEAKS_4XH100[name]
    sets = [arg for o in overrides for arg in ("--set", o)]
    assert main(["--recipe", str(ROOT / f"recipes/{name}.yaml"), "--world-size", "4", "--gpu-memory", "79.18GiB",
                 "--json", "-", *sets]) == 0
    peak = json.loads(capsys.readouterr().out)["peaks"]["with_etp"]["peak"] / 2**30
    assert abs(peak / measured - 1) < 0.05, (name, peak, measured)


# Peaks allocated (GiB, rank 0) of megatron-core's distributed optimizer at its recommended
# settings (ETP off, overlapped gathers and reductions), measured beside etp's runs (BENCHMARKS.md,
# "The memory audit against measured peaks"): recipe, world size, overrides -> GiB. Their
# backward holds a grouped expert weight's whole 16-bit gradient until megatron's DDP hook adds
# it into main_grad (DeepSeek-V3's features: 3.5 GiB; the prediction without it was -5.4%).
PEER = ("etp.etp_size=1", "etp.expert_etp_size=1", "use_distributed_optimizer=true", "overlap_grad_reduce=true",
        "overlap_param_gather=true", "cuda_graph=none")
MEASURED_PEER_PEAKS = {
    "flagship_mb8_4xh100": ("moe_flagship", 4, ("micro_batch_size=8",), 48.55),
    "wide_mb16_4xh100": ("moe_wide", 4, ("micro_batch_size=16",), 57.55),
    "olmoe_1b_7b_mb2_4xh100": ("olmoe_1b_7b", 4, ("micro_batch_size=2",), 68.34),
    "deepseek_v3_features_mb4_2xh200": ("deepseek_v3_shaped", 2, (
        "num_experts=64", "expert_model_parallel_size=1", "moe_token_dispatcher_type=local", "seq_length=4096",
        "micro_batch_size=4"), 119.60),
}


@pytest.mark.parametrize("name", sorted(MEASURED_PEER_PEAKS))
def test_predicted_peak_of_the_distributed_optimizer_within_five_percent_of_measured(name, capsys):
    recipe, world, overrides, measured = MEASURED_PEER_PEAKS[name]
    sets = [arg for o in PEER + overrides for arg in ("--set", o)]
    assert main(["--recipe", str(ROOT / f"recipes/{recipe}.yaml"), "--world-size", str(world), "--gpu-memory",
                 "140GiB", "--json", "-", *sets]) == 0
    peak = json.loads(capsys.readouterr().out)["peaks"]["with_etp"]["peak"] / 2**30
    assert abs(peak / measured - 1) < 0.05, (name, peak, measured)
