"""Imported weights in etp's model give transformers' logits: each tiny architecture imported by
etp-convert, loaded into the model etp-train builds (``build_model``: megatron-core's GPTModel
with etp's layer spec, on CPU) at ETP 1 and ETP 2 over 2 gloo ranks, against transformers' own
forward of the same checkpoint in fp32. Tolerance: max |difference| <= 2e-5 on logits of order 1
(measured ~1e-7: the same arithmetic in another order). The export, read by transformers, gives
the original's logits bit for bit (its config.json read as the original's). A wrong RoPE base, norm epsilon or
expert order is another model and fails it; so does the export of an ETP-2 fine-tune, read by
transformers, against etp's model of the checkpoint it came from."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from harness import run_distributed  # noqa: E402
from hf_models import ARCHITECTURES, save, tokens  # noqa: E402

from etp.hf import export_hf, import_hf, recipe_from_hf  # noqa: E402
from etp.recipe import Recipe  # noqa: E402
from etp.train.convert_command import etp_model  # noqa: E402

TOLERANCE = 2e-5


def _recipe(path, world: int, etp_size: int, **overrides):
    return Recipe.from_yaml(path, bf16=False, world_size=world, micro_batch_size=2, global_batch_size=2 * world,
                            cuda_graph="none", **overrides,
                            etp={"etp_size": etp_size, "expert_etp_size": etp_size, "gather_dtype": "param",
                                 "gather_reuse": "chain"})


def _etp_logits(ctx, checkpoint: str, recipe_path: str, variants: list):
    """This rank's logits (its own tokens: ETP peers see different data) of etp's model loaded from
    ``checkpoint``, one per variant ``(recipe overrides, ETP size)``."""
    from megatron.core import parallel_state as ps

    from etp.megatron.checkpoint import load_model_checkpoint
    from etp.megatron.groups import build_megatron_etp_groups
    from etp.megatron.model import apply_etp
    from etp.train.model_build import build_model

    out = []
    for overrides, etp_size in variants:
        recipe = _recipe(recipe_path, ctx.world_size, etp_size, **overrides)
        ps.initialize_model_parallel()
        try:
            groups = build_megatron_etp_groups(recipe.etp)
            model, _, _ = build_model(recipe, torch.device("cpu"))
            apply_etp(model, recipe.etp, groups)
            load_model_checkpoint(checkpoint, model)
            model.eval()
            batch = tokens(seed=ctx.rank)
            with torch.no_grad():
                out.append(model(batch, torch.arange(batch.shape[1]).expand_as(batch), None).clone())
        finally:
            ps.destroy_model_parallel()
    return out


def _transformers_logits(model, seed: int) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens(seed=seed)).logits


def _imported(name: str, tmp_path, **changes):
    hf = save(name, tmp_path / "hf", **changes)
    path = recipe_from_hf(hf, tmp_path / "recipe.yaml")
    import_hf(hf, Recipe.from_yaml(path, bf16=False), tmp_path / "ckpt", etp_model, quiet=True)
    return hf, path


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_etp_logits_are_transformers_logits_at_etp_1_and_2(name, tmp_path):
    from transformers import AutoModelForCausalLM

    hf, path = _imported(name, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(hf).eval()
    results = run_distributed(_etp_logits, 2, str(tmp_path / "ckpt"), str(path), [({}, 1), ({}, 2)])
    for rank, logits in enumerate(results):
        expected = _transformers_logits(reference, rank)
        for layout, found in zip(("ETP 1", "ETP 2"), logits):
            difference = (found - expected).abs().max().item()
            assert difference <= TOLERANCE, (name, layout, rank, difference)
    # the export: transformers reads its config.json (RoPE base, epsilon, routing) as the original's
    exported = export_hf(tmp_path / "ckpt", Recipe.from_yaml(path, bf16=False), tmp_path / "out", etp_model, quiet=True)
    again = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert torch.equal(_transformers_logits(again, 0), _transformers_logits(reference, 0))


def test_a_wrong_rope_base_epsilon_or_expert_order_is_another_model(tmp_path):
    from transformers import AutoModelForCausalLM

    hf, path = _imported("qwen3_moe", tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(hf).eval()
    right, rope, epsilon = run_distributed(_etp_logits, 1, str(tmp_path / "ckpt"), str(path),
                                           [({}, 1), ({"rotary_base": 1e4}, 1), ({"norm_epsilon": 1e-5}, 1)])[0]
    expected = _transformers_logits(reference, 0)
    assert (right - expected).abs().max() <= TOLERANCE
    for wrong in (rope, epsilon):
        assert (wrong - expected).abs().max() > 50 * TOLERANCE
    experts = reference.model.layers[0].mlp.experts
    with torch.no_grad():  # experts 0 and 1 trade weights (the router still picks by index)
        for param in experts.parameters():
            param.copy_(param[[1, 0, 2, 3]])
    assert (right - _transformers_logits(reference, 0)).abs().max() > 50 * TOLERANCE
