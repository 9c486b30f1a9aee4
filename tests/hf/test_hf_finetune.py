"""Megatron-LM's fine-tuning keys in etp-train ([Note: fine-tuning] in etp/train/checkpointing.py):
``finetune`` starts from a checkpoint's weights at iteration 0, ``skip_train`` evaluates them,
``no_load_optim`` resumes without the optimizer state, and what cannot be honoured is refused in
one line before any rank starts."""
from __future__ import annotations

from pathlib import Path

import pytest

from etp.recipe import Recipe, RecipeError
from etp.train.checkpointing import check_checkpoint_dirs
from etp.train.options import RunOptions, TrainError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_moe_cpu.yaml"
@pytest.mark.parametrize("keys,fix", [
    ({"finetune": True}, "finetune=True: needs load"),
    ({"skip_train": True}, "skip_train=True: needs load"),
    ({"pretrained_checkpoint": "imported"}, "pretrained_checkpoint='imported': needs load"),
    ({"pretrained_checkpoint": "imported", "load": "ft", "finetune": True}, "finetune=True: with pretrained_checkpoint"),
])
def test_fine_tuning_keys_need_a_checkpoint_to_load(keys, fix):
    with pytest.raises(RecipeError) as error:
        Recipe.from_yaml(TINY, **keys)
    assert fix in str(error.value) and len(str(error.value).splitlines()) == 1


def test_fine_tuning_checks_before_any_rank_starts(tmp_path):
    pytest.importorskip("megatron.core")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [({"load": str(empty), "finetune": True}, RunOptions(resume=True), "drop one of them"),
             ({"load": str(empty), "finetune": True}, RunOptions(), "holds no checkpoint"),
             ({"load": str(empty), "skip_train": True}, RunOptions(), "add --set finetune=true"),
             ({"no_load_optim": True}, RunOptions(), "applies to --resume")]
    for keys, options, fix in cases:
        with pytest.raises(TrainError) as error:
            check_checkpoint_dirs(Recipe.from_yaml(TINY, **keys), options)
        assert fix in str(error.value) and len(str(error.value).splitlines()) == 1, error.value


def test_resuming_a_weights_only_checkpoint_is_refused_naming_finetune(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import save

    from etp.hf import import_hf, recipe_from_hf
    from etp.train.convert_command import etp_model

    hf = save("mixtral", tmp_path / "hf")
    recipe = Recipe.from_yaml(recipe_from_hf(hf, tmp_path / "r.yaml"), bf16=False)
    import_hf(hf, recipe, tmp_path / "ckpt", etp_model, quiet=True)
    from etp.train.checkpointing import resume_from_load

    loading = recipe.replace(load=str(tmp_path / "ckpt"))
    for options in (RunOptions(resume=True), resume_from_load(loading, RunOptions())[1]):  # --resume, or load alone
        with pytest.raises(TrainError) as error:
            check_checkpoint_dirs(loading, options)
        assert "holds model weights only" in str(error.value) and "finetune=true" in str(error.value)
    notes = check_checkpoint_dirs(recipe.replace(load=str(tmp_path / "ckpt"), finetune=True), RunOptions())
    assert any("fine-tuning from the model weights" in note for note in notes)


def _three_runs(ctx, directory: str):
    """A 3-iteration run saving, then from its checkpoint a skip_train run and a 2-iteration
    fine-tune, each through etp-train's ``train`` on this rank: their losses."""
    from etp.train.loop import train

    def run(**keys):
        recipe = Recipe.from_yaml(TINY, world_size=1, global_batch_size=4, log_interval=1, **keys)
        return train(ctx.rank, ctx.world_size, recipe, RunOptions())

    saved = run(train_iters=3, save=f"{directory}/ckpt")
    skipped = run(train_iters=3, load=f"{directory}/ckpt", finetune=True, skip_train=True)
    tuned = run(train_iters=2, load=f"{directory}/ckpt", finetune=True, save=f"{directory}/tuned")
    return saved, skipped, tuned


def test_finetune_starts_from_the_weights_at_iteration_zero_and_skip_train_evaluates_them(tmp_path):
    pytest.importorskip("megatron.core")
    from harness import run_distributed

    fresh, skipped, tuned = run_distributed(_three_runs, 1, str(tmp_path))[0]
    assert len(fresh) == 3 and len(skipped) == 1 and len(tuned) == 2
    # iteration 0's batch is the fresh run's first: the loaded weights see it, not a fresh model
    assert abs(skipped[0] - tuned[0]) < 1e-6 and abs(tuned[0] - fresh[0]) > 0.05, (skipped, tuned, fresh)
    assert (tmp_path / "tuned" / "latest").read_text().strip() == "2"  # its own count, from 0
    assert not (tmp_path / "ckpt" / "iter_0000005").exists()


def _from_an_import(ctx, directory: str, recipe_path: str):
    """On 2 ranks at ETP 2, from an etp-convert import: skip_train's loss, a 2-iteration fine-tune
    saving, the fine-tuned checkpoint's logits in a fresh model (this rank's tokens), and the
    tokens skip_train evaluated (this rank's micro-batches of iteration 0)."""
    import torch
    from hf_models import tokens
    from megatron.core import parallel_state as ps

    from etp.megatron.checkpoint import load_model_checkpoint
    from etp.megatron.groups import build_megatron_etp_groups
    from etp.megatron.model import apply_etp
    from etp.train.batches import Batches
    from etp.train.loop import train
    from etp.train.model_build import build_model

    def recipe(**keys):
        return Recipe.from_yaml(recipe_path, bf16=False, world_size=2, micro_batch_size=2, global_batch_size=8,
                                train_iters=2, lr=1e-2, min_lr=1e-2, lr_warmup_iters=0, log_interval=1,
                                cuda_graph="none", load=f"{directory}/ckpt", finetune=True, **keys,
                                etp={"etp_size": 2, "expert_etp_size": 2, "gather_dtype": "param",
                                     "gather_reuse": "chain"})

    skipped = train(ctx.rank, ctx.world_size, recipe(skip_train=True), RunOptions())
    tuned = train(ctx.rank, ctx.world_size, recipe(save=f"{directory}/tuned"), RunOptions())
    read = [Batches(recipe(), ctx.rank, torch.device("cpu"), 2).get(0, i) for i in range(2)]
    # each micro-batch's [b, s + 1] ids: its inputs and its last label (etp.data.batch.Batch)
    evaluated = [torch.cat([batch.tokens, batch.labels[:, -1:]], dim=1) for batch in read]
    ps.initialize_model_parallel()
    try:
        r = recipe()
        model, _, _ = build_model(r, torch.device("cpu"))
        apply_etp(model, r.etp, build_megatron_etp_groups(r.etp))
        load_model_checkpoint(f"{directory}/tuned", model)
        model.eval()
        batch = tokens(seed=ctx.rank)
        with torch.no_grad():
            logits = model(batch, torch.arange(batch.shape[1]).expand_as(batch), None).clone()
    finally:
        ps.destroy_model_parallel()
    return skipped, tuned, logits, evaluated


def _stored_chunk_reads(monkeypatch):
    """Counts, from now until the test ends, torch DCP's reads of each stored chunk (its key and offset)."""
    import collections

    from torch.distributed.checkpoint.filesystem import FileSystemReader

    reads, read_data = collections.Counter(), FileSystemReader.read_data

    def counted(self, plan, planner):
        for item in plan.items:
            reads[(item.storage_index.fqn, tuple(item.storage_index.offset or ()))] += 1
        return read_data(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", counted)
    return reads


def test_an_import_fine_tuned_at_etp_2_exports_what_etp_trained(tmp_path, monkeypatch):
    """skip_train's loss of an import is transformers' loss on the same samples; the export of
    a fine-tune saved at ETP 2 (no --model-type: the import's config.json rides along) gives, in
    transformers, the logits etp's model of that checkpoint gives."""
    pytest.importorskip("transformers")
    import torch
    import torch.nn.functional as F
    from harness import run_distributed
    from hf_models import save, tokens
    from transformers import AutoModelForCausalLM

    from etp.hf import export_hf, import_hf, recipe_from_hf
    from etp.train.convert_command import etp_model

    hf = save("olmoe", tmp_path / "hf")
    path = recipe_from_hf(hf, tmp_path / "r.yaml")
    import_hf(hf, Recipe.from_yaml(path, bf16=False), tmp_path / "ckpt", etp_model, quiet=True)
    results = run_distributed(_from_an_import, 2, str(tmp_path), str(path))
    original = AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        samples = torch.cat([batch for r in results for batch in r[3]])
        logits = original(samples[:, :-1]).logits
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), samples[:, 1:].reshape(-1))
    assert abs(results[0][0][0] - expected.item()) < 1e-5, (results[0][0], expected)
    recipe = Recipe.from_yaml(path, bf16=False)
    reads = _stored_chunk_reads(monkeypatch)
    exported = export_hf(tmp_path / "tuned", recipe, tmp_path / "out", etp_model, quiet=True)
    # etp-train saves a layer's experts as one chunk (per ETP rank): the export reads each once,
    # not once per expert (torch DCP loads a whole chunk for every request touching it).
    assert reads and max(reads.values()) == 1, sorted(reads.items(), key=lambda kv: -kv[1])[:2]
    tuned = AutoModelForCausalLM.from_pretrained(exported).eval()
    for rank, (_, losses, etp_logits, _) in enumerate(results):
        assert len(losses) == 2
        with torch.no_grad():
            found, before = tuned(tokens(seed=rank)).logits, original(tokens(seed=rank)).logits
        assert (found - etp_logits).abs().max() <= 2e-5
        assert (before - etp_logits).abs().max() > 1e-3  # the fine-tune moved the weights
