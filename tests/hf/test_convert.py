"""etp-convert without a forward pass: recipes from config.json, import -> export -> import
bit for bit per tensor (the etp checkpoints read back by megatron-core's own loader into
etp's model, the exports read by safetensors' own reader), the vocabulary's padding rows,
the streaming writer's shards, and every bad input refused in one line before anything is
written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from hf_models import ARCHITECTURES, VOCAB, save  # noqa: E402

from etp.hf import ConversionError, recipe_from_hf  # noqa: E402
from etp.hf import export_hf as _export_hf  # noqa: E402
from etp.hf import import_hf as _import_hf  # noqa: E402
from etp.train.convert_command import etp_model  # noqa: E402


def import_hf(hf, recipe, out, **kw):
    return _import_hf(hf, recipe, out, etp_model, **kw)


def export_hf(checkpoint, recipe, out, **kw):
    return _export_hf(checkpoint, recipe, out, etp_model, **kw)

NO_BF16 = {"bf16": False}  # the tiny models are fp32; recipe-from-hf's default is bf16 for GPUs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (Hugging Face directory, recipe path) of each tiny architecture."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in ARCHITECTURES:
        hf = save(name, root / name)
        out[name] = hf, recipe_from_hf(hf, root / f"{name}.yaml")
    return out


def _model_state(checkpoint: Path, recipe) -> dict:
    """The etp checkpoint loaded by megatron-core's loader into etp's (real, CPU) model at one rank."""
    from etp.hf.megatron_io import one_rank_recipe, single_process
    from etp.megatron.checkpoint import load_model_checkpoint

    with single_process():
        model = etp_model(one_rank_recipe(recipe))
        load_model_checkpoint(checkpoint, model)
        return {k: v.clone() for k, v in model.state_dict().items() if v is not None}


def _safetensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_recipe_from_hf_is_each_architecture(checkpoints):
    from etp.recipe import Recipe

    expected = {"qwen3_moe": dict(rotary_base=1e6, norm_epsilon=1e-6, qk_layernorm=True, qk_layernorm_width="head",
                                  kv_channels=24, num_query_groups=2, moe_router_pre_softmax=False,
                                  moe_layer_freq=(1, 0, 1), ffn_hidden_size=96, moe_ffn_hidden_size=32),
                "olmoe": dict(rotary_base=1e4, norm_epsilon=1e-5, qk_layernorm=True, qk_layernorm_width="full",
                              kv_channels=16, moe_router_pre_softmax=True, moe_ffn_hidden_size=32),
                "mixtral": dict(rotary_base=1e6, norm_epsilon=1e-5, qk_layernorm=False, moe_router_pre_softmax=False,
                                num_experts=4, moe_router_topk=2)}
    for name, (_, path) in checkpoints.items():
        recipe = Recipe.from_yaml(path)
        assert {k: recipe[k] for k in expected[name]} == expected[name], name
        assert recipe.padded_vocab_size == VOCAB and recipe.model.untie_embeddings_and_output_weights


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_import_export_import_is_bit_exact(checkpoints, tmp_path, name):
    from etp.recipe import Recipe

    hf, path = checkpoints[name]
    recipe = Recipe.from_yaml(path, **NO_BF16)
    first = import_hf(hf, recipe, tmp_path / "ckpt", quiet=True)
    assert json.loads((first / "etp_manifest.json").read_text())["metadata"]["kind"] == "weights"
    exported = export_hf(tmp_path / "ckpt", recipe, tmp_path / "out", max_shard_bytes=200_000, quiet=True)
    import_hf(exported, recipe, tmp_path / "again", quiet=True)
    original, written = _safetensors(hf), _safetensors(exported)
    assert written.keys() == original.keys()
    for key, value in original.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key
    once, twice = _model_state(tmp_path / "ckpt", recipe), _model_state(tmp_path / "again", recipe)
    assert once.keys() == twice.keys()
    for key in once:
        assert torch.equal(once[key], twice[key]), key
    # sharded: the index names every tensor, each file within the size (one tensor may exceed it)
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original) and len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in original.values())
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == name and config["rope_theta"] == ARCHITECTURES[name][2]["rope_theta"]
    assert (exported / "generation_config.json").is_file()


def test_qkv_interleave_and_expert_rows_land_where_megatron_reads_them(checkpoints, tmp_path):
    """The layout megatron-core reads, written out by hand: linear_qkv's rows per query group
    (q heads, k head, v head), fc1's gate rows then up rows per expert."""
    from safetensors.torch import load_file

    from etp.recipe import Recipe

    hf, path = checkpoints["qwen3_moe"]
    recipe = Recipe.from_yaml(path, **NO_BF16)
    import_hf(hf, recipe, tmp_path / "ckpt", quiet=True)
    state, weights = _model_state(tmp_path / "ckpt", recipe), load_file(hf / "model.safetensors")
    q, k, v = (weights[f"model.layers.2.self_attn.{n}_proj.weight"] for n in "qkv")
    per_group = [torch.cat([q[g * 48:(g + 1) * 48], k[g * 24:(g + 1) * 24], v[g * 24:(g + 1) * 24]]) for g in range(2)]
    assert torch.equal(state["decoder.layers.2.self_attention.linear_qkv.weight"], torch.cat(per_group))
    fc1 = state["decoder.layers.2.mlp.experts.experts.fc1_weight"]
    gate, up = (weights[f"model.layers.2.mlp.experts.3.{n}_proj.weight"] for n in ("gate", "up"))
    assert torch.equal(fc1[3], torch.cat([gate, up]))
    assert torch.equal(state["decoder.layers.1.mlp.linear_fc1.weight"],  # the dense layer
                       torch.cat([weights["model.layers.1.mlp.gate_proj.weight"],
                                  weights["model.layers.1.mlp.up_proj.weight"]]))


def test_vocabulary_padding_rows_are_zeros_in_and_dropped_out(tmp_path):
    from etp.recipe import Recipe

    hf = save("mixtral", tmp_path / "hf", vocab_size=300)
    recipe_from_hf(hf, tmp_path / "r.yaml")
    recipe = Recipe.from_yaml(tmp_path / "r.yaml", make_vocab_size_divisible_by=128, **NO_BF16)
    assert recipe.padded_vocab_size == 384
    import_hf(hf, recipe, tmp_path / "ckpt", quiet=True)
    state = _model_state(tmp_path / "ckpt", recipe)
    original = _safetensors(hf)
    for megatron, name in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                           ("output_layer.weight", "lm_head.weight")):
        assert torch.equal(state[megatron][:300], original[name]) and not state[megatron][300:].any()
    exported = _safetensors(export_hf(tmp_path / "ckpt", recipe, tmp_path / "out", quiet=True))
    assert exported["model.embed_tokens.weight"].shape == (300, 64)
    assert all(torch.equal(exported[k], v) for k, v in original.items())


def test_safetensors_writer_is_what_safetensors_reads(tmp_path):
    from safetensors.torch import load_file

    from etp.hf.safetensors_io import SafetensorsDir, TensorSpec, write_safetensors

    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(2, 1, 4), "d": torch.tensor(1.5, dtype=torch.float16)}
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    write_safetensors(tmp_path / "x.safetensors", specs, iter(tensors.values()))
    loaded = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())
    reader = SafetensorsDir(tmp_path)
    assert torch.equal(reader.read("a", (1, 3)), tensors["a"][1:3]) and torch.equal(reader.read("d"), tensors["d"])


# ---------------------------------------------------------------------------------- bad input
def _one_line(error) -> str:
    message = str(error.value)
    assert len(message.splitlines()) == 1, message
    return message


def _edit_safetensors(hf: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    path = hf / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["missing", "extra", "shape", "truncated", "pickle", "auto_map",
                                  "trust_remote_code", "model_type", "deepseek_v3", "other architecture",
                                  "recipe", "out exists"])
def test_bad_input_is_one_line_before_anything_is_written(checkpoints, tmp_path, case):
    import shutil

    from etp.recipe import Recipe

    source, path = checkpoints["qwen3_moe"]
    hf = Path(shutil.copytree(source, tmp_path / "hf"))
    recipe = Recipe.from_yaml(path, **NO_BF16)
    config = json.loads((hf / "config.json").read_text())
    expected = {
        "missing": "lacks 1 tensor(s) of the recipe's model: model.layers.0.mlp.experts.3.up_proj.weight",
        "extra": "has 1 tensor(s) the recipe's model does not: model.layers.0.mlp.experts.4.up_proj.weight",
        "shape": "model.layers.0.self_attn.q_norm.weight is [12], the recipe's model needs [24]",
        "truncated": "is truncated",
        "pickle": "pytorch_model.bin (pickled weights) and no *.safetensors",
        "auto_map": "sets auto_map: the model's code ships with the checkpoint",
        "trust_remote_code": "sets trust_remote_code",
        "model_type": "model_type 'llama' is not one etp-convert converts",
        "deepseek_v3": "DeepSeek-V3's multi-latent attention needs megatron-core's MLASelfAttention",
        "other architecture": "disagree on",
        "recipe": "disagree on 3 key(s): num_layers 3 in",
        "out exists": "exists and is not empty",
    }[case]
    out = tmp_path / "ckpt"
    if case == "missing":
        _edit_safetensors(hf, lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"))
    elif case == "extra":
        _edit_safetensors(hf, lambda t: t.update({"model.layers.0.mlp.experts.4.up_proj.weight": torch.zeros(1)}))
    elif case == "shape":
        _edit_safetensors(hf, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(12)}))
    elif case == "truncated":
        data = (hf / "model.safetensors").read_bytes()
        (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif case == "pickle":
        (hf / "model.safetensors").unlink()
        (hf / "pytorch_model.bin").write_bytes(b"not opened")
    elif case in ("auto_map", "trust_remote_code"):
        config[case] = {"AutoModelForCausalLM": "modeling.Model"} if case == "auto_map" else True
    elif case in ("model_type", "deepseek_v3"):
        config["model_type"] = "llama" if case == "model_type" else "deepseek_v3"
    elif case == "other architecture":  # OLMoE's checkpoint, Qwen3's recipe
        shutil.rmtree(hf)
        hf = Path(shutil.copytree(checkpoints["olmoe"][0], hf))
        config = json.loads((hf / "config.json").read_text())
    elif case == "recipe":
        recipe = recipe.replace(num_layers=2, moe_layer_freq=[1, 0], rotary_base=1e4)
    elif case == "out exists":
        out.mkdir()
        (out / "keep").write_text("")
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError) as error:
        import_hf(hf, recipe, out, quiet=True)
    assert expected in _one_line(error)
    assert case == "out exists" or not out.exists()


def test_export_refuses_a_checkpoint_of_another_recipe(checkpoints, tmp_path):
    from etp.recipe import Recipe

    hf, path = checkpoints["mixtral"]
    recipe = Recipe.from_yaml(path, **NO_BF16)
    import_hf(hf, recipe, tmp_path / "ckpt", quiet=True)
    with pytest.raises(ConversionError) as error:
        export_hf(tmp_path / "ckpt", recipe.replace(moe_ffn_hidden_size=48), tmp_path / "out", quiet=True)
    assert "export it with the recipe it was trained with" in _one_line(error)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))


def test_etp_convert_command(checkpoints, tmp_path, capsys):
    from etp.train.convert_command import main

    hf, _ = checkpoints["olmoe"]
    recipe = tmp_path / "olmoe.yaml"
    assert main(["recipe-from-hf", "--hf", str(hf), "--out", str(recipe)]) == 0
    assert main(["import-hf", "--hf", str(hf), "--recipe", str(recipe), "--out", str(tmp_path / "ckpt"),
                 "--set", "bf16=false"]) == 0
    assert main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--recipe", str(recipe), "--out",
                 str(tmp_path / "out"), "--max-shard-size", "100KB"]) == 0
    captured, count = capsys.readouterr(), len(_safetensors(hf))
    assert f"import-hf {count}/{count} tensors" in captured.err and f"export-hf {count}/{count} tensors" in captured.err
    assert all(torch.equal(_safetensors(tmp_path / "out")[k], v) for k, v in _safetensors(hf).items())
    assert main(["import-hf", "--hf", str(hf), "--recipe", str(recipe), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("etp-convert: --out") and "exists" in err[0], err


def _load_at_tp2_and_ep2(ctx, checkpoint: str, recipe_path: str):
    """This rank's tensors of etp's model at TP 2, then at EP 2 (2 ranks), after loading
    ``checkpoint``, each with how it is split (TP's partition dim, the expert axis, or None)."""
    from megatron.core import parallel_state as ps

    from etp.megatron.checkpoint import load_model_checkpoint
    from etp.recipe import Recipe

    out = []
    for tp, ep in ((2, 1), (1, 2)):
        recipe = Recipe.from_yaml(recipe_path, bf16=False, tensor_model_parallel_size=tp, expert_tensor_parallel_size=1,
                                  expert_model_parallel_size=ep, moe_token_dispatcher_type="allgather", world_size=2,
                                  micro_batch_size=1, global_batch_size=2 // tp)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1)
        try:
            model = etp_model(recipe)
            load_model_checkpoint(checkpoint, model)
            out.append({name: (p.detach().clone(), getattr(p, "partition_dim", None)
                               if getattr(p, "tensor_model_parallel", False) and tp > 1
                               else ("experts" if ep > 1 and "experts" in name else None))
                        for name, p in model.named_parameters()})
        finally:
            ps.destroy_model_parallel()
    return out


def test_an_import_loads_at_tp_2_and_at_ep_2(checkpoints, tmp_path):
    from harness import run_distributed

    from etp.recipe import Recipe

    hf, path = checkpoints["mixtral"]
    recipe = Recipe.from_yaml(path, **NO_BF16)
    import_hf(hf, recipe, tmp_path / "ckpt", quiet=True)
    full = _model_state(tmp_path / "ckpt", recipe)  # one rank, checked against the safetensors above
    ranks = run_distributed(_load_at_tp2_and_ep2, 2, str(tmp_path / "ckpt"), str(path))
    for layout in range(2):
        mine_all, theirs_all = ranks[0][layout], ranks[1][layout]
        assert mine_all.keys() == set(full)
        for name, (mine, split) in mine_all.items():
            theirs = theirs_all[name][0]
            if split is None:
                assert torch.equal(mine, full[name]) and torch.equal(theirs, full[name]), name
            else:  # TP: halves along the partition dim; EP: experts 0-1 on rank 0, 2-3 on rank 1
                joined = torch.cat([mine, theirs], dim=0 if split == "experts" else split)
                if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    # TP 2 pads the vocabulary to a multiple of 2 x 128: megatron-core loads what the
                    # checkpoint has (its embedding allows another padding) and zeros the rest
                    assert not joined[VOCAB:].any(), name
                    joined = joined[:VOCAB]
                assert torch.equal(joined, full[name]), (layout, name)


def test_a_bf16_checkpoint_loads_into_an_fp32_model_and_exports_as_bf16(tmp_path):
    """Published weights are bf16 and CPU runs are fp32: the import keeps the checkpoint's dtype,
    loading casts exactly, the export writes what the etp checkpoint holds."""
    from hf_models import build

    from etp.recipe import Recipe

    build("mixtral").to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    recipe = Recipe.from_yaml(recipe_from_hf(tmp_path / "hf", tmp_path / "r.yaml"), **NO_BF16)
    import_hf(tmp_path / "hf", recipe, tmp_path / "ckpt", quiet=True)
    state, original = _model_state(tmp_path / "ckpt", recipe), _safetensors(tmp_path / "hf")
    assert state["output_layer.weight"].dtype == torch.float32
    assert torch.equal(state["output_layer.weight"], original["lm_head.weight"].float())
    exported = _safetensors(export_hf(tmp_path / "ckpt", recipe, tmp_path / "out", quiet=True))
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, original[k]) for k, v in exported.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
