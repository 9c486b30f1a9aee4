"""Run IDs ([Note: run IDs] in etp/train/checkpointing.py): every checkpoint names its run and
its model; a run that resumed adopts its checkpoint's ID, a fresh run draws a new one, and a run
that would save into another run's checkpoints (or restart another model's) is refused in one
line before any rank starts, naming the directory and the fix. The directories here are
published by ``etp.megatron.checkpoint.save_checkpoint`` with the metadata a run writes; a real
restart that adopts its ID: test_async_save."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from etp.megatron.checkpoint import find_latest, list_checkpoints, save_checkpoint
from etp.recipe import Recipe
from etp.train.checkpointing import Checkpointing, check_checkpoint_dirs, model_identity, resume_from_load
from etp.train.options import RunOptions, TrainError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_moe_cpu.yaml"


def _recipe(**keys) -> Recipe:
    return Recipe.from_yaml(TINY, **keys)


def _publish(root: Path, iteration: int, run_id: str | None, **model_keys) -> None:
    """A published checkpoint whose metadata says what an etp-train save of ``run_id`` (None: one
    written before run IDs) of the tiny model with ``model_keys`` says."""
    metadata = {} if run_id is None else {
        "run": {"id": run_id, "recipe": "tiny_moe_cpu", "model": model_identity(_recipe(**model_keys))}}
    save_checkpoint(root, iteration, lambda directory: (directory / "w.bin").write_bytes(b"w"), metadata)


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_a_fresh_run_into_another_runs_directory_is_refused_naming_it_and_the_fix(tmp_path):
    _publish(tmp_path, 2, "tiny_moe_cpu-aaaa")
    with pytest.raises(TrainError) as error:
        check_checkpoint_dirs(_recipe(save=str(tmp_path)), RunOptions())
    line = _one_line(error)
    assert f"save={tmp_path} already holds checkpoints of another run (run tiny_moe_cpu-aaaa" in line
    assert "--overwrite" in line and "--set save=NEW_DIR" in line
    notes = check_checkpoint_dirs(_recipe(save=str(tmp_path)), RunOptions(overwrite=True))
    assert f"--overwrite: deleting checkpoints [2] of {tmp_path}" in notes


def test_a_restart_with_load_equal_to_save_resumes_its_own_run(tmp_path):
    for iteration in (2, 4):
        _publish(tmp_path, iteration, "tiny_moe_cpu-aaaa")
    recipe = _recipe(load=str(tmp_path), save=str(tmp_path))
    _, options, note = resume_from_load(recipe, RunOptions())
    assert options.resume is True and note == f"load={tmp_path} holds iteration 4: resuming from it"
    assert f"resuming at iteration 4 from {tmp_path}" in check_checkpoint_dirs(recipe, options)


def test_a_restart_of_another_model_into_the_same_directory_is_refused_and_overwrite_starts_fresh(tmp_path):
    for iteration in (2, 4):
        _publish(tmp_path, iteration, "tiny_moe_cpu-aaaa")  # hidden_size 64
    other = _recipe(load=str(tmp_path), save=str(tmp_path), hidden_size=128)
    with pytest.raises(TrainError) as error:
        resume_from_load(other, RunOptions())
    line = _one_line(error)
    assert f"load={tmp_path} holds the checkpoints of run tiny_moe_cpu-aaaa, another model" in line
    assert "hidden_size 64 there, 128 here" in line and "--overwrite" in line and "save=NEW_DIR" in line
    with pytest.raises(TrainError) as error:
        check_checkpoint_dirs(other, RunOptions(resume=True))
    assert "--resume 4" in _one_line(error) and "hidden_size 64 there, 128 here" in str(error.value)

    _, options, note = resume_from_load(other, RunOptions(overwrite=True))
    assert options.resume is False and "--overwrite starts this run fresh" in note
    assert f"--overwrite: deleting checkpoints [2, 4] of {tmp_path}" in check_checkpoint_dirs(other, options)
    Checkpointing(other, options, 0, 1).prepare(None)
    assert list_checkpoints(tmp_path) == [] and find_latest(tmp_path) is None


def test_a_restart_of_another_model_is_one_line_before_any_rank_starts(tmp_path):
    _publish(tmp_path, 2, "tiny_moe_cpu-aaaa")
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "etp.train", "--recipe", str(TINY), "--train-iters", "2",
                           "--set", f"load={tmp_path}", "--set", f"save={tmp_path}", "--set", "hidden_size=128"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.strip().splitlines() if "Warning" not in line and "warn(" not in line]
    assert done.returncode == 2 and "iter " not in done.stdout and len(lines) == 1, done.stderr
    assert "another model (hidden_size 64 there, 128 here, " in lines[0] and "--overwrite" in lines[0]
    assert time.monotonic() - began < 30  # no rank was started


def test_a_resume_into_a_directory_of_another_run_is_refused_even_of_older_iterations(tmp_path):
    """Resuming run A at 4 into a ``save`` directory that holds run B's iteration 2 (older than 4,
    so no iteration would be replaced) would mix two runs in one directory; run A's own older
    checkpoint there is fine."""
    load, save = tmp_path / "a", tmp_path / "b"
    _publish(load, 4, "tiny_moe_cpu-aaaa")
    _publish(save, 2, "tiny_moe_cpu-bbbb")
    recipe = _recipe(load=str(load), save=str(save))
    with pytest.raises(TrainError) as error:
        check_checkpoint_dirs(recipe, RunOptions(resume=True))
    assert "already holds checkpoints of another run (run tiny_moe_cpu-bbbb: iterations [2]" in _one_line(error)
    ours = tmp_path / "c"
    _publish(ours, 2, "tiny_moe_cpu-aaaa")
    assert check_checkpoint_dirs(_recipe(load=str(load), save=str(ours)), RunOptions(resume=True))


def test_finetune_from_another_load_into_a_directory_with_checkpoints_is_refused(tmp_path):
    load, save = tmp_path / "a", tmp_path / "b"
    _publish(load, 4, "tiny_moe_cpu-aaaa")
    _publish(save, 2, "tiny_moe_cpu-aaaa")  # even of the run it starts from: a fine-tune is a new run
    for target in (save, load):
        with pytest.raises(TrainError) as error:
            check_checkpoint_dirs(_recipe(load=str(load), save=str(target), finetune=True), RunOptions())
        assert f"save={target} already holds checkpoints of another run" in _one_line(error)


def test_a_resumed_run_adopts_its_checkpoints_run_id_and_a_fresh_run_draws_a_new_one(monkeypatch, tmp_path):
    import etp.megatron.checkpoint as checkpoint

    saved = []
    monkeypatch.setattr(checkpoint, "save_training_checkpoint",
                        lambda root, iteration, model, optimizer, metadata: saved.append(metadata) or Path(root))
    monkeypatch.setattr(checkpoint, "load_training_checkpoint",
                        lambda root, model, optimizer, iteration=None: (4, {"run": {"id": "tiny_moe_cpu-aaaa"}}, None))
    recipe = _recipe(save=str(tmp_path))
    stepper = SimpleNamespace(model=None, optimizer=None)
    for options in (RunOptions(), RunOptions(), RunOptions(resume=True)):
        checkpoints = Checkpointing(recipe, options, 0, 1)
        checkpoints.save(stepper, checkpoints.start(stepper) + 2)
    fresh, again, resumed = (metadata["run"] for metadata in saved)
    assert resumed["id"] == "tiny_moe_cpu-aaaa"
    assert fresh["id"] != again["id"] and all(run["id"].startswith("tiny_moe_cpu-") for run in (fresh, again))
    assert len(fresh["id"]) == len("tiny_moe_cpu-") + 32  # a uuid's 32 hex digits
    assert fresh["model"] == resumed["model"] == model_identity(recipe)
    assert fresh["model"]["hidden_size"] == 64 and fresh["model"]["num_experts"] == 4  # the recipe file's values
