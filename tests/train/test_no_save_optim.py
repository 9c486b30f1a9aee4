"""``no_save_optim`` (Megatron-LM's ``--no-save-optim``, [Note: fine-tuning]): a save holds the
model weights and the iteration, no optimizer state; resuming it needs ``no_load_optim`` (refused
in one line otherwise), and then continues as a full save of the same run resumed with
``no_load_optim`` does (same weights, a fresh optimizer): the reference is the full save."""
from __future__ import annotations

from pathlib import Path

import pytest

from etp.recipe import Recipe
from etp.train.checkpointing import check_checkpoint_dirs, checkpoint_bytes
from etp.train.options import RunOptions, TrainError

pytest.importorskip("megatron.core")
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_moe_cpu.yaml"


def _recipe(**keys):
    return Recipe.from_yaml(TINY, world_size=1, global_batch_size=4, log_interval=1, **keys)


def _runs(ctx, directory: str):
    from etp.train.loop import train

    losses = {}
    for name, keys in (("full", {}), ("weights", {"no_save_optim": True})):
        train(ctx.rank, ctx.world_size, _recipe(train_iters=5, save_interval=3, save=f"{directory}/{name}", **keys),
              RunOptions())
        losses[name] = train(ctx.rank, ctx.world_size, _recipe(train_iters=5, load=f"{directory}/{name}",
                                                               save=f"{directory}/{name}_resumed", no_load_optim=True),
                             RunOptions(resume=3))
    return losses


def _saved_keys(directory: Path) -> set:
    from torch.distributed.checkpoint import FileSystemReader

    return {key.split(".")[0] for key in FileSystemReader(str(directory)).read_metadata().state_dict_metadata}


def test_a_save_without_the_optimizer_resumes_as_the_full_save_does(tmp_path):
    from harness import run_distributed

    losses = run_distributed(_runs, 1, str(tmp_path))[0]
    assert len(losses["full"]) == len(losses["weights"]) == 2  # iterations 4 and 5
    assert losses["weights"] == losses["full"]  # the same weights continued, bit for bit
    full, weights = tmp_path / "full" / "iter_0000003", tmp_path / "weights" / "iter_0000003"
    assert _saved_keys(full) == _saved_keys(weights) | {"optimizer"} and "optimizer" not in _saved_keys(weights)
    size = sum(f.stat().st_size for f in weights.rglob("*") if f.is_file())
    assert size < 0.5 * sum(f.stat().st_size for f in full.rglob("*") if f.is_file())
    with pytest.raises(TrainError) as error:  # resuming it as a full save: one line naming the fix
        check_checkpoint_dirs(_recipe(train_iters=5, load=str(tmp_path / "weights")), RunOptions(resume=3))
    assert "no_load_optim=true" in str(error.value) and len(str(error.value).splitlines()) == 1
    assert checkpoint_bytes(_recipe(no_save_optim=True)) < checkpoint_bytes(_recipe())
