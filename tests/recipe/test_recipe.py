"""Recipes and flags (etp/recipe/, etp/megatron/args.py): the bundled recipes
validate, every kind of bad value fails before any process group exists with a message
naming the key and the value, overrides, YAML details, and the Megatron-LM flags."""
import argparse
import dataclasses
import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

import etp.recipe as recipe_module
from etp import ETPConfig
from etp.megatron.args import ETP_ARG_DESTS, add_etp_args, etp_config_from_args
from etp.recipe import (
    Recipe,
    RecipeError,
    check_parallel_layout,
    load_recipe_yaml,
    parse_overrides,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_moe_cpu.yaml"
BIG = ROOT / "recipes" / "moe_flagship.yaml"


@pytest.fixture(scope="module")
def tiny_values():
    return load_recipe_yaml(TINY)


# ---------------------------------------------------------------------------- bundled recipes
def test_tiny_cpu_recipe_validates():
    from etp.train.auto import Machine, resolve_auto

    r = Recipe.from_yaml(TINY)
    r.check_world_size(2)
    assert r.parallel.world_size == 2 and r.parallel.backend == "gloo"
    assert r.auto == ("cuda_graph", "etp.etp_size", "etp.expert_etp_size", "etp.gather_dtype", "etp.gather_reuse")
    r, _ = resolve_auto(r, Machine(2, 2))
    assert (r.etp.etp_size, r.etp.expert_etp_size) == (2, 2) and r.auto == ()
    assert r.model.num_experts == 4 and r.model.moe_router_topk == 2
    assert r.model.vocab_size == 512 and not r.train.bf16
    assert r.train.data == "synthetic" and r.data.data_path == "etp/data/tiny_corpus_text_document"
    assert (r.data.tokenizer_type, r.data.split_shares) == ("HuggingFaceTokenizer", (0.9, 0.05, 0.05))
    assert (r.data_parallel_size(), r.expert_data_parallel_size()) == (2, 2)
    assert (r.replicate_size(), r.expert_replicate_size()) == (1, 1)
    assert (r.global_batch_size(), r.num_microbatches()) == (8, 1)
    # Matches megatron-core's GPTModel(local spec) parameter count for these settings.
    assert r.num_params() == 197_440 and r.num_params(active=True) == 148_288


def test_flagship_recipe_validates_and_is_over_a_billion_parameters():
    from etp.train.auto import Machine, resolve_auto

    r, _ = resolve_auto(Recipe.from_yaml(BIG), Machine(8, 8))
    r.check_world_size(8)
    assert r.model.is_moe and r.train.bf16 and r.parallel.world_size == 8
    assert (r.etp.etp_size, r.etp.expert_etp_size) == (8, 8)
    assert r.num_params() == 4_695_558_144  # the figure in the recipe's comment
    assert r.num_params() >= 1_000_000_000
    assert (r.data_parallel_size(), r.expert_data_parallel_size()) == (8, 8)
    assert (r.train.micro_batch_size, r.num_microbatches()) == (4, 1)  # auto on CPU: the rank's whole share
    # The baseline of the GPU comparison is the same recipe with ETP off.
    baseline = r.replace(etp={"etp_size": 1, "expert_etp_size": 1})
    assert baseline.model == r.model and baseline.train == r.train
    assert baseline.replicate_size() == 8


@pytest.mark.parametrize("sets,world,want", [
    ({}, 1, 2),                                          # one rank, one micro-batch: nothing reduced or accumulated
    ({"global_batch_size": 8}, 1, 4),                    # two micro-batches accumulate: fp32
    ({"global_batch_size": 8}, 2, 4),                    # two data-parallel ranks reduce: fp32
    ({"megatron_fallbacks": "stock"}, 1, 4),             # torch's AdamW: megatron's fp32 copies
    ({"use_distributed_optimizer": True}, 1, 4),
    ({"global_batch_size": 8, "grad_reduce_in_bf16": True}, 2, 2),
    ({"bf16": False}, 1, 4),                             # fp32 parameters, fp32 gradients
])
def test_main_grad_bytes_are_bf16_only_where_they_hold_the_fp32_values(sets, world, want):
    r = Recipe.from_yaml(BIG, micro_batch_size=4, **{"global_batch_size": 4, "world_size": world, **sets})
    assert r.main_grad_bytes(world) == want


def test_main_grad_bytes_stay_fp32_where_apex_steps(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec  # what etp.installed.have_fused_kernels asks
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "apex" else find_spec(name, *a))
    r = Recipe.from_yaml(BIG, micro_batch_size=4, global_batch_size=4, world_size=1)
    assert r.main_grad_bytes(1) == 4  # apex's Adam, megatron's fp32 copies of bf16 gradients


def test_recipes_parse_3e_minus_3_as_float_and_refuse_duplicate_keys(tmp_path):
    loaded = load_recipe_yaml("lr: 3e-3\nn: 1\nx: 1.5\n", text=True)
    assert loaded == {"lr": 0.003, "n": 1, "x": 1.5}
    path = tmp_path / "dup.yaml"
    path.write_text(TINY.read_text() + "num_layers: 4\n")
    with pytest.raises(RecipeError, match="num_layers") as info:
        Recipe.from_yaml(path)
    assert "twice" in str(info.value)


# ---------------------------------------------------------------------------- validation
# (overrides, world size or None, key at fault, offending value)
BAD = {
    # unknown keys, with the closest known name
    "unknown key": ({"num_layer": 2}, None, "num_layer", 2),
    "unknown etp key": ({"etp": {"etp_sizes": 2}}, None, "etp.etp_sizes", 2),
    # wrong types (bool is a subclass of int and is refused)
    "bool for int": ({"num_layers": True}, None, "num_layers", True),
    "float for int": ({"hidden_size": 64.0}, None, "hidden_size", 64.0),
    "str for int": ({"num_experts": "4"}, None, "num_experts", "4"),
    "str for float": ({"lr": "fast"}, None, "lr", "fast"),
    "bool for float": ({"min_lr": False}, None, "min_lr", False),
    "int for bool": ({"bf16": 1}, None, "bf16", 1),
    "int for str": ({"data": 5}, None, "data", 5),
    "etp bad type": ({"etp": {"prefetch": "yes"}}, None, "etp.prefetch", "yes"),
    # out of range
    "zero size": ({"num_layers": 0}, None, "num_layers", 0),
    "negative batch": ({"micro_batch_size": -1}, None, "micro_batch_size", -1),
    "zero tp": ({"tensor_model_parallel_size": 0}, None, "tensor_model_parallel_size", 0),
    "zero etp_size": ({"etp": {"etp_size": 0}}, None, "etp.etp_size", 0),
    "zero lr": ({"lr": 0.0}, None, "lr", 0.0),
    "beta2 of 1": ({"adam_beta2": 1.0}, None, "adam_beta2", 1.0),
    "dropout above 1": ({"hidden_dropout": 1.5}, None, "hidden_dropout", 1.5),
    "min_lr above lr": ({"min_lr": 1.0}, None, "min_lr", 1.0),
    # choices
    "dispatcher": (
        {"moe_token_dispatcher_type": "all2all"}, None, "moe_token_dispatcher_type", "all2all"
    ),
    "load balancing": (
        {"moe_router_load_balancing_type": "aux"}, None, "moe_router_load_balancing_type", "aux"
    ),
    "normalization": ({"normalization": "rmsnorm"}, None, "normalization", "rmsnorm"),
    "lr decay": ({"lr_decay_style": "exp"}, None, "lr_decay_style", "exp"),
    "backend": ({"backend": "mpi"}, None, "backend", "mpi"),
    "no timeout": ({"distributed_timeout_minutes": 0}, None, "distributed_timeout_minutes", 0.0),
    "negative timeout": ({"distributed_timeout_minutes": -1}, None, "distributed_timeout_minutes", -1.0),
    "timeout past a timedelta": ({"distributed_timeout_minutes": 1e300}, None, "distributed_timeout_minutes", 1e300),
    "etp reduction": ({"etp": {"reduction": "avg"}}, None, "etp.reduction", "avg"),
    "etp pad for fp8_blockwise": (
        {"bf16": True, "etp": {"gather_dtype": "fp8_blockwise"}}, None, "etp.pad_for_alignment", 16
    ),
    # inconsistent sizes and settings
    "hidden % heads": ({"hidden_size": 66}, None, "hidden_size", 66),
    "heads % query groups": ({"num_query_groups": 3}, None, "num_query_groups", 3),
    "heads % TP": (
        {"tensor_model_parallel_size": 3, "world_size": None}, None, "num_attention_heads", 4
    ),
    "experts % EP": ({"expert_model_parallel_size": 3, "world_size": None}, None, "num_experts", 4),
    "topk > experts": ({"moe_router_topk": 5}, None, "moe_router_topk", 5),
    # settings etp-train cannot honour (refused, never run as something else)
    "pipeline parallelism": ({"pipeline_model_parallel_size": 2, "world_size": None}, None,
                             "pipeline_model_parallel_size", 2),
    "virtual pipeline stages": ({"virtual_pipeline_model_parallel_size": 2}, None,
                                "virtual_pipeline_model_parallel_size", 2),
    "context parallelism": ({"context_parallel_size": 2, "world_size": None}, None, "context_parallel_size", 2),
    "fp16": ({"fp16": True}, None, "fp16", True),
    "bf16 reductions under FSDP2": ({"use_torch_fsdp2": True, "grad_reduce_in_bf16": True}, None,
                                    "grad_reduce_in_bf16", True),
    "DDP buckets under FSDP2": ({"use_torch_fsdp2": True, "ddp_bucket_size": 1000}, None, "ddp_bucket_size", 1000),
    # the learning-rate schedule (megatron-core's OptimizerParamScheduler, Megatron-LM's checks)
    "warm-up init above lr": ({"lr_warmup_init": 0.01}, None, "lr_warmup_init", 0.01),
    "warm-up as long as an explicit decay": ({"lr_warmup_iters": 40, "lr_decay_iters": 40}, None,
                                             "lr_warmup_iters", 40),
    "warm-up past an explicit decay": ({"lr_warmup_iters": 50, "lr_decay_iters": 40}, None, "lr_warmup_iters", 50),
    "WSD without its decay iterations": ({"lr_decay_style": "WSD"}, None, "lr_decay_style", "WSD"),
    "WSD decay iterations without WSD": ({"lr_wsd_decay_iters": 10}, None, "lr_wsd_decay_iters", 10),
    "WSD decay style": ({"lr_decay_style": "WSD", "lr_wsd_decay_iters": 10, "lr_wsd_decay_style": "sqrt"}, None,
                        "lr_wsd_decay_style", "sqrt"),
    "weight decay rise without its ends": ({"weight_decay_incr_style": "linear", "end_weight_decay": 0.1}, None,
                                           "weight_decay_incr_style", "linear"),
    "weight decay ends without a rise": ({"start_weight_decay": 0.0}, None, "start_weight_decay", 0.0),
    "weight decay falling": ({"weight_decay_incr_style": "cosine", "start_weight_decay": 0.1,
                              "end_weight_decay": 0.01}, None, "end_weight_decay", 0.01),
    "weight decay rise style": ({"weight_decay_incr_style": "exponential"}, None, "weight_decay_incr_style",
                                "exponential"),
    "both schedule overrides": ({"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": True},
                                None, "override_opt_param_scheduler", True),
    "max positions < seq": ({"max_position_embeddings": 32}, None, "max_position_embeddings", 32),
    "bf16 and fp16": ({"bf16": True, "fp16": True}, None, "fp16", True),
    "sequence parallel without TP": ({"sequence_parallel": True}, None, "sequence_parallel", True),
    "EP and TP without SP": (
        {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "world_size": None},
        None, "sequence_parallel", False,
    ),
    "etp dispatcher with TP": (
        {"moe_token_dispatcher_type": "etp", "tensor_model_parallel_size": 2, "world_size": None,
         "etp": {"etp_size": 1, "expert_etp_size": 1}},
        None, "tensor_model_parallel_size", 2,
    ),
    "fp8 gathers without bf16": (
        {"etp": {"gather_dtype": "fp8_tensorwise"}}, None, "etp.gather_dtype", "fp8_tensorwise"
    ),
    "expert ETP on a dense model": (
        {"num_experts": None, "moe_ffn_hidden_size": None, "etp": {"expert_etp_size": 2}}, None,
        "etp.expert_etp_size", 2,
    ),
    "moe width on a dense model": (
        {"num_experts": None, "etp": {"expert_etp_size": 1}}, None, "moe_ffn_hidden_size", 64
    ),
    "EP on a dense model": (
        {"num_experts": None, "moe_ffn_hidden_size": None, "expert_model_parallel_size": 2,
         "etp": {"expert_etp_size": 1}}, None, "expert_model_parallel_size", 2,
    ),
    "byte corpus needs 256 ids": ({"vocab_size": 100, "data": "etp/data/tiny_corpus.txt", "data_path": None,
                                   "tokenizer_type": None, "tokenizer_model": None, "data_cache_path": None},
                                  None, "vocab_size", 100),
    "save_interval without save": ({"save_interval": 10}, None, "save_interval", 10),
    # checks that need the world size (the recipe's world_size, or check_world_size(n))
    "world % (TP x PP x CP)": (
        {"tensor_model_parallel_size": 2, "world_size": 3}, None, "world_size", 3
    ),
    "DP % etp_size": ({"world_size": None, "etp": {"etp_size": 4}}, 6, "etp.etp_size", 4),
    "expert DP % expert_etp_size": (
        {"world_size": None, "expert_model_parallel_size": 2, "etp": {"expert_etp_size": 4}},
        4, "etp.expert_etp_size", 4,
    ),
    "world % (ETP_tp x EP x PP)": (
        {"world_size": None, "num_experts": 6, "expert_model_parallel_size": 3}, 4,
        "expert_model_parallel_size", 3,
    ),
    "global batch % (micro x DP)": ({"global_batch_size": 12}, None, "global_batch_size", 12),
    "recipe world != launched world": ({}, 4, "world_size", 2),
    "bad world": ({"world_size": None}, 0, "world_size", 0),
    # activation recompute (megatron-core TransformerConfig pass-through; tiny: 2 MoE layers)
    "recompute granularity": (
        {"recompute_granularity": "partial"}, None, "recompute_granularity", "partial"
    ),
    "recompute method": (
        {"recompute_granularity": "full", "recompute_method": "even", "recompute_num_layers": 1},
        None, "recompute_method", "even",
    ),
    "recompute zero layers": (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 0},
        None, "recompute_num_layers", 0,
    ),
    "full without method": (
        {"recompute_granularity": "full", "recompute_num_layers": 1}, None, "recompute_method", None
    ),
    "full without num layers": (
        {"recompute_granularity": "full", "recompute_method": "uniform"},
        None, "recompute_num_layers", None,
    ),
    "full, block past the layers of a stage": (
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
        None, "recompute_num_layers", 3,
    ),
    "full with modules": (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
         "recompute_modules": ["moe"]}, None, "recompute_modules", ["moe"],
    ),
    "selective with method": (
        {"recompute_granularity": "selective", "recompute_method": "uniform"},
        None, "recompute_method", "uniform",
    ),
    "selective with num layers": (
        {"recompute_granularity": "selective", "recompute_num_layers": 1},
        None, "recompute_num_layers", 1,
    ),
    "method without granularity": ({"recompute_method": "block"}, None, "recompute_method", "block"),
    "num layers without granularity": (
        {"recompute_num_layers": 1}, None, "recompute_num_layers", 1
    ),
    "modules without granularity": (
        {"recompute_modules": ["core_attn"]}, None, "recompute_modules", ["core_attn"]
    ),
    "modules not a list": (
        {"recompute_granularity": "selective", "recompute_modules": "core_attn"},
        None, "recompute_modules", "core_attn",
    ),
    "unknown module": (
        {"recompute_granularity": "selective", "recompute_modules": ["attn"]},
        None, "recompute_modules", ["attn"],
    ),
    "module twice": (
        {"recompute_granularity": "selective", "recompute_modules": ["moe", "moe"]},
        None, "recompute_modules", ["moe", "moe"],
    ),
    "no modules": (
        {"recompute_granularity": "selective", "recompute_modules": []},
        None, "recompute_modules", [],
    ),
    "moe_act (megatron's grouped-GEMM experts)": (
        {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "moe_act"]},
        None, "recompute_modules", ["core_attn", "moe_act"],
    ),
    "mla_up_proj without MLA": (
        {"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"]},
        None, "recompute_modules", ["mla_up_proj"],
    ),
    "shared_experts without shared experts": (
        {"recompute_granularity": "selective", "recompute_modules": ["shared_experts"]},
        None, "recompute_modules", ["shared_experts"],
    ),
    "mlp on an MoE model": (
        {"recompute_granularity": "selective", "recompute_modules": ["mlp"]},
        None, "recompute_modules", ["mlp"],
    ),
    "moe on a dense model": (
        {"num_experts": None, "moe_ffn_hidden_size": None, "etp": {"expert_etp_size": 1},
         "recompute_granularity": "selective", "recompute_modules": ["moe"]},
        None, "recompute_modules", ["moe"],
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_recipe_raises_value_error_naming_key_and_value(tiny_values, case):
    overrides, world, key, value = BAD[case]
    with pytest.raises(ValueError) as info:
        recipe = Recipe.from_dict(tiny_values, **overrides)
        assert world is not None, "expected the recipe itself to be refused"
        recipe.check_world_size(world)
    error = info.value
    assert isinstance(error, RecipeError)
    assert (error.key, error.value) == (key, value)
    message = str(error)
    assert key in message, message
    assert repr(value) in message, message


def test_missing_required_key(tiny_values):
    values = {k: v for k, v in tiny_values.items() if k != "num_layers"}
    with pytest.raises(RecipeError, match=r"num_layers is required") as info:
        Recipe.from_dict(values)
    assert info.value.key == "num_layers"


@pytest.mark.parametrize(
    "key,suggestion",
    [
        ("num_layer", "num_layers"),
        ("moe_router_top_k", "moe_router_topk"),
        ("num-attention-heads", "num_attention_heads"),
        ("tensor_parallel_size", "tensor_model_parallel_size"),
    ],
)
def test_unknown_key_suggests_closest_name(tiny_values, key, suggestion):
    with pytest.raises(RecipeError, match=rf"did you mean '{suggestion}'\?"):
        Recipe.from_dict({**tiny_values, key: 1})


def test_unknown_keys_in_the_wrong_section(tiny_values):
    with pytest.raises(RecipeError, match=r"etp_size is an ETP setting: put it in the etp:"):
        Recipe.from_dict({**tiny_values, "etp_size": 2})
    with pytest.raises(RecipeError, match=r"num_layers is a top-level recipe key"):
        Recipe.from_dict({**tiny_values, "etp": {"num_layers": 2}})
    with pytest.raises(RecipeError, match=r"did you mean 'gather_dtype'\?"):
        Recipe.from_dict({**tiny_values, "etp": {"gather_dtypes": "bf16"}})
    with pytest.raises(RecipeError, match=r"expected a mapping"):
        Recipe.from_dict({**tiny_values, "etp": 2})


def test_several_unknown_keys_are_all_named(tiny_values):
    with pytest.raises(RecipeError) as info:
        Recipe.from_dict({**tiny_values, "num_layer": 1, "hiden_size": 2})
    assert "num_layer" in str(info.value) and "hiden_size" in str(info.value)


# ---------------------------------------------------------------------------- overrides
def test_overrides(tiny_values):
    r = Recipe.from_yaml(TINY, train_iters=5, lr=1, etp_size=1, etp={"gather_dtype": "fp32"})
    assert r.train.train_iters == 5 and r.train.lr_decay_iters == 5
    assert r.train.lr == 1.0 and isinstance(r.train.lr, float)
    # etp_size routed to the etp section; etp={...} merged into it, not replacing it (the
    # recipe's expert_etp_size and gather_reuse stay auto, at their defaults until resolved)
    assert r.etp == ETPConfig(etp_size=1, gather_dtype="fp32")
    assert r.auto == ("cuda_graph", "etp.expert_etp_size", "etp.gather_reuse")
    assert r.source == TINY
    # replace() derives the derived defaults again
    wide = Recipe.from_dict({**tiny_values}).replace(hidden_size=128, world_size=None)
    assert wide.model.ffn_hidden_size == int(4 * 128 * 2 / 3 / 64) * 64 == 320
    assert wide.parallel.world_size is None


def test_parse_overrides_feeds_from_yaml():
    overrides = parse_overrides(
        ["train_iters=5", "lr=3e-4", "etp.etp_size=1", "save=/tmp/x", "load="]
    )
    assert overrides == {
        "train_iters": 5, "lr": 3e-4, "etp": {"etp_size": 1}, "save": "/tmp/x", "load": None
    }
    r = Recipe.from_yaml(TINY, **overrides)
    assert (r.train.train_iters, r.etp.etp_size, r.train.save) == (5, 1, "/tmp/x")
    with pytest.raises(ValueError, match="expected key=value"):
        parse_overrides(["train_iters"])


def test_derived_defaults_follow_megatron_lm(tiny_values):
    minimal = {k: tiny_values[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                           "seq_length", "vocab_size", "micro_batch_size",
                                           "train_iters", "lr")}
    r = Recipe.from_dict(minimal)
    m, p, t = r.model, r.parallel, r.train
    assert m.ffn_hidden_size == 4 * 64 and m.num_query_groups == 4
    assert m.max_position_embeddings == 64 and m.moe_ffn_hidden_size is None and not m.is_moe
    assert (m.normalization, m.position_embedding_type, m.add_bias_linear) == (
        "LayerNorm", "learned_absolute", True)
    assert p.expert_tensor_parallel_size == 1 and p.world_size is None and p.backend == "auto"
    assert p.distributed_timeout_minutes == 10.0 and p.distributed_timeout == datetime.timedelta(minutes=10)
    assert Recipe.from_dict({**minimal, "distributed_timeout_minutes": 0.5}).parallel.distributed_timeout.seconds == 30
    assert (t.weight_decay, t.clip_grad, t.adam_beta2, t.seed, t.log_interval) == (
        0.01, 1.0, 0.999, 1234, 100)
    assert t.global_batch_size is None and t.data == "synthetic"
    assert r.etp == ETPConfig()
    assert r.global_batch_size(4) == 4 * tiny_values["micro_batch_size"]
    assert Recipe.from_dict({**minimal, "num_experts": 2}).model.moe_ffn_hidden_size == 256
    assert Recipe.from_dict({**minimal, "vocab_size": 300}).padded_vocab_size == 384
    with pytest.raises(RecipeError, match="world_size is not set"):
        r.data_parallel_size()


def test_to_dict_round_trip_and_lookup():
    r = Recipe.from_yaml(BIG, etp={"etp_size": 8})
    flat = r.to_dict()
    assert Recipe.from_dict(flat) == r
    assert set(flat) == set(Recipe.keys()) | {"etp"}
    assert r["num_experts"] == 64 and r["etp_size"] == 8 and r["expert_tensor_parallel_size"] == 1
    with pytest.raises(KeyError, match="num_expert"):
        r["num_expert"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.model.num_layers = 3


def test_every_key_is_documented_in_the_module_docstring():
    doc = recipe_module.__doc__
    missing = [k for k in (*Recipe.keys(), *ETP_ARG_DESTS) if k not in doc]
    assert not missing


def test_resolve_data_path(tmp_path):
    assert Recipe.from_yaml(BIG, data="synthetic").resolve_data_path() is None
    (tmp_path / "corpus.txt").write_text("hello world\n")
    path = tmp_path / "r.yaml"
    path.write_text(BIG.read_text().replace("etp/data/tiny_corpus.txt", "corpus.txt"))
    assert Recipe.from_yaml(path).resolve_data_path() == tmp_path / "corpus.txt"
    missing = Recipe.from_yaml(BIG, data="no/such/corpus.txt")
    with pytest.raises(RecipeError, match=r"data='no/such/corpus.txt': no such file") as info:
        missing.resolve_data_path()
    assert info.value.key == "data"


def test_the_bundled_corpus_is_found_from_any_directory(tmp_path, monkeypatch):
    """A recipe copied anywhere and run from anywhere finds ``etp/data/tiny_corpus.txt`` in the
    installed package (the lookup once pointed inside the package and found nothing)."""
    from importlib.resources import files

    copy = tmp_path / "elsewhere.yaml"
    copy.write_text(BIG.read_text())
    monkeypatch.chdir(tmp_path)
    bundled = Path(str(files("etp") / "data" / "tiny_corpus.txt")).resolve()  # the installed package data
    assert Recipe.from_yaml(copy).resolve_data_path().resolve() == bundled


def test_check_parallel_layout():
    assert check_parallel_layout(8, tensor_model_parallel_size=2, etp_size=4) == (4, 4)
    assert check_parallel_layout(
        8, tensor_model_parallel_size=2, expert_model_parallel_size=2,
        expert_tensor_parallel_size=1, etp_size=2, expert_etp_size=4,
    ) == (4, 4)
    with pytest.raises(RecipeError, match=r"etp.etp_size=8 does not divide the data-parallel size"):
        check_parallel_layout(8, tensor_model_parallel_size=2, etp_size=8)


# ---------------------------------------------------------------------------- Megatron-LM flags
def test_add_etp_args_defaults_are_etp_config_defaults():
    args = add_etp_args(argparse.ArgumentParser()).parse_args([])
    assert etp_config_from_args(args) == ETPConfig()


def test_add_etp_args_round_trip():
    parser = add_etp_args(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(
        ["--etp-size", "4", "--etp-gather-dtype", "fp8_tensorwise", "--expert-etp-size", "2",
         "--etp-no-prefetch", "--etp-no-async-reduce", "--etp-pad-for-alignment", "128",
         "--etp-reduction", "sum", "--etp-debug-checks"]
    )
    assert etp_config_from_args(args) == ETPConfig(
        etp_size=4, expert_etp_size=2, gather_dtype="fp8_tensorwise", prefetch=False,
        async_reduce=False, pad_for_alignment=128, reduction="sum", debug_checks=True,
    )
    short = parser.parse_args(["--etp-size", "4", "--etp-gather-dtype", "fp8_tensorwise"])
    assert etp_config_from_args(short) == ETPConfig(etp_size=4, gather_dtype="fp8_tensorwise")


def test_add_etp_args_is_idempotent():
    parser = argparse.ArgumentParser()
    assert add_etp_args(parser) is parser
    assert add_etp_args(parser) is parser  # no "conflicting option string"
    assert [g.title for g in parser._action_groups].count("etp") == 1
    assert parser.format_help().count("\n  --etp-size") == 1  # once in the options list
    assert etp_config_from_args(parser.parse_args(["--etp-size", "2"])).etp_size == 2


@pytest.mark.parametrize(
    "argv", [["--etp-size", "0"], ["--etp-size", "two"], ["--etp-gather-dtype", "int8"],
             ["--etp-reduction", "avg"]]
)
def test_bad_flags_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit):
        add_etp_args(argparse.ArgumentParser()).parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_etp_config_from_args_errors():
    with pytest.raises(ValueError, match=r"args has no 'etp_size'.*add_etp_args"):
        etp_config_from_args(SimpleNamespace())
    args = add_etp_args(argparse.ArgumentParser()).parse_args(["--etp-pad-for-alignment", "12"])
    with pytest.raises(ValueError, match=r"pad_for_alignment=12"):
        etp_config_from_args(args)
    # Megatron-LM's args after validate_args carry the world and parallel sizes.
    args = add_etp_args(argparse.ArgumentParser()).parse_args(["--etp-size", "4"])
    args.world_size, args.tensor_model_parallel_size = 8, 4
    args.pipeline_model_parallel_size = args.context_parallel_size = 1
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = 1, 4
    with pytest.raises(RecipeError, match=r"etp_size=4 does not divide the data-parallel size 2"):
        etp_config_from_args(args)
    assert etp_config_from_args(args, check_layout=False).etp_size == 4


# ---------------------------------------------------------------------------- activation recompute
def _transformer_config(recipe):
    """megatron-core's TransformerConfig on CPU with the recipe's recompute arguments (its own
    __post_init__ checks run)."""
    pytest.importorskip("megatron.core")
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = recipe.model
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
        num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size, gated_linear_unit=m.swiglu,
        activation_func=F.silu, add_bias_linear=m.add_bias_linear, use_cpu_initialization=True,
        **recipe.recompute_kwargs(),
    )


RECOMPUTE_OK = {  # --set overrides on the tiny recipe (2 MoE layers) that megatron-core accepts
    "full uniform": ["recompute_granularity=full", "recompute_method=uniform",
                     "recompute_num_layers=1"],
    "full block, every layer": ["recompute_granularity=full", "recompute_method=block",
                                "recompute_num_layers=2"],
    "selective, megatron's default modules": ["recompute_granularity=selective"],
    "selective modules": ["recompute_granularity=selective",
                          "recompute_modules=[core_attn, layernorm, moe]"],
    "selective mlp on a dense model": [
        "recompute_granularity=selective", "recompute_modules=[mlp]", "num_experts=null",
        "moe_ffn_hidden_size=null", "etp.expert_etp_size=1"],
}


def test_recompute_defaults_leave_megatron_without_recompute():
    r = Recipe.from_yaml(TINY)
    assert r.recompute_kwargs() == dict(recompute_granularity=None, recompute_method=None,
                                        recompute_num_layers=None, recompute_modules=None)
    config = _transformer_config(r)
    assert (config.recompute_granularity, config.recompute_method,
            config.recompute_num_layers) == (None, None, None)


@pytest.mark.parametrize("case", list(RECOMPUTE_OK), ids=list(RECOMPUTE_OK))
def test_recompute_set_overrides_reach_megatron_transformer_config(case):
    r = Recipe.from_yaml(TINY, **parse_overrides(RECOMPUTE_OK[case]))
    kwargs = r.recompute_kwargs()
    config = _transformer_config(r)  # megatron-core accepts what the recipe accepted
    for key, value in kwargs.items():
        if key == "recompute_modules" and value is None:
            value = ["core_attn"]  # megatron-core's default
        assert getattr(config, key) == value, (key, getattr(config, key), value)
    assert Recipe.from_dict(r.to_dict()) == r
    assert r.replace() == r


def test_recompute_set_parses_yaml_lists():
    overrides = parse_overrides(["recompute_granularity=selective",
                                 "recompute_modules=[core_attn,moe]", "recompute_num_layers=null"])
    assert overrides == {"recompute_granularity": "selective",
                         "recompute_modules": ["core_attn", "moe"], "recompute_num_layers": None}
    r = Recipe.from_yaml(TINY, **overrides)
    assert r.train.recompute_modules == ("core_attn", "moe")
    assert r["recompute_modules"] == ("core_attn", "moe")
    assert r.recompute_kwargs()["recompute_modules"] == ["core_attn", "moe"]  # a list: megatron appends


def test_recompute_error_names_the_fix(tiny_values):
    with pytest.raises(ValueError) as info:
        Recipe.from_dict(tiny_values, recompute_granularity="full")
    message = str(info.value)
    assert "recompute_granularity='full' needs recompute_method ('uniform' or 'block') and " \
        "recompute_num_layers" in message, message
    with pytest.raises(ValueError, match=r"<= the layers per pipeline stage.*= 2: use 1\.\.2"):
        Recipe.from_dict(tiny_values, recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=3)


def test_etp_train_passes_recompute_to_its_transformer_config(monkeypatch):
    """etp-train's megatron-core builder (etp.train.model_build.build_model) hands the
    recipe's recompute keys to TransformerConfig: the config is captured before GPTModel (which
    needs CUDA and parallel state) is built."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import transformer_config

    from etp.train.model_build import build_model

    class Built(Exception):
        pass

    real = transformer_config.TransformerConfig
    built = []

    def capture(**kwargs):
        built.append(real(**kwargs))
        raise Built

    capture.__dataclass_fields__ = real.__dataclass_fields__  # etp.megatron.compat reads the config's fields
    monkeypatch.setattr(transformer_config, "TransformerConfig", capture)
    monkeypatch.setattr(mcore_random, "model_parallel_cuda_manual_seed", lambda seed: None)
    for overrides in ({}, {"recompute_granularity": "full", "recompute_method": "block",
                           "recompute_num_layers": 1}):
        with pytest.raises(Built):
            build_model(Recipe.from_yaml(TINY, **overrides), torch.device("meta"))
    default, full = built
    assert default.recompute_granularity is None and default.recompute_method is None
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == (
        "full", "block", 1)


def test_etp_audit_accepts_recompute_keys(capsys):
    import json

    from etp.train.audit_command import main as audit_main

    sets = ["--set", "recompute_granularity=full", "--set", "recompute_method=uniform",
            "--set", "recompute_num_layers=1"]
    assert audit_main(["--recipe", str(BIG), "--world-size", "8", "--json", "-", *sets]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] > 0
    assert audit_main(["--recipe", str(BIG), "--world-size", "8", "--set", "recompute_granularity=full"]) != 0
    assert "recompute_method" in capsys.readouterr().err


def test_module_doc_lists_every_etp_field():
    import dataclasses
    import re

    import etp
    import etp.recipe as recipe_module

    section = recipe_module.__doc__.split("ETP (``recipe.etp``")[1].split("(defaults")[0]
    listed = re.findall(r"[a-z_][a-z0-9_]*", section.split("):", 1)[1])
    assert listed == [f.name for f in dataclasses.fields(etp.ETPConfig)]


def test_fp8_eager_hint_only_where_a_capture_would_validate():
    from etp.train.reporting import fp8_eager_hint

    def flagship(**overrides):
        etp = {"gather_dtype": "fp8_tensorwise", "etp_size": 2, "expert_etp_size": 2} | overrides.pop("etp", {})
        return Recipe.from_yaml(BIG, etp=etp, world_size=2, global_batch_size=8,
                                **overrides)

    hint = fp8_eager_hint(flagship(), "cuda")
    assert "--set cuda_graph=step --set overlap_grad_reduce=false" in hint and "fp8_tensorwise" in hint
    assert fp8_eager_hint(flagship(), "cpu") is None  # no graphs on CPU
    assert fp8_eager_hint(flagship(cuda_graph="step", overlap_grad_reduce=False), "cuda") is None  # captured already
    assert fp8_eager_hint(flagship(etp={"gather_dtype": "param"}), "cuda") is None  # bf16 gathers
    assert fp8_eager_hint(flagship(etp={"etp_size": 1, "expert_etp_size": 1}), "cuda") is None  # ETP off
    # A recipe that cannot be captured as it stands gets no advice that would fail.
    assert fp8_eager_hint(flagship(moe_token_dispatcher_type="alltoall"), "cuda") is None
    assert fp8_eager_hint(flagship(recompute_granularity="full", recompute_method="uniform",
                                   recompute_num_layers=1), "cuda") is None


def test_a_warm_up_longer_than_the_run_is_clipped_and_remembered():
    # The tiny recipe warms up over 5; the warm-up ends before lr_decay_iters (= train_iters).
    recipe = Recipe.from_yaml(TINY, train_iters=4)
    assert recipe.train.lr_warmup_iters == 3 and recipe.train.warmup_clipped_from == 5
    longer_decay = Recipe.from_yaml(TINY, train_iters=4, lr_decay_iters=100)
    assert longer_decay.train.lr_warmup_iters == 4
    whole_run = Recipe.from_yaml(TINY, train_iters=5)  # a warm-up over the whole run leaves no decay
    assert whole_run.train.lr_warmup_iters == 4 and whole_run.train.warmup_clipped_from == 5
    assert Recipe.from_yaml(TINY).train.warmup_clipped_from is None
