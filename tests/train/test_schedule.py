"""etp-train's learning-rate and weight-decay schedule (``etp.train.schedule``): megatron-core's
``OptimizerParamScheduler`` built from the recipe as Megatron-LM builds it for an
iteration-based run. Every style's learning rate, in the optimizer's parameter groups, against
its formula written out here in float64 (warm-up, decay, WSD's annealing, past the decay); the
weight decay per group; the state a checkpoint keeps and a resume continues; and etp-train's
own log of a saved and resumed run."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from etp.recipe import Recipe
from etp.train.optimizer_steps import weight_decay_groups
from etp.train.options import TrainError
from etp.train.schedule import OptimizerSchedule

pytest.importorskip("megatron.core")
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_moe_cpu.yaml"
BATCH = 8  # the tiny recipe's global batch: the scheduler counts samples


def expected_lr(t, iteration: int, batch: int = BATCH) -> float:
    """Megatron-LM's learning rate at the optimizer step of ``iteration`` (0-based), from the
    formulas: a linear warm-up from lr_warmup_init reaching lr at lr_warmup_iters, then the decay
    style from lr down to min_lr at lr_decay_iters, min_lr after it (constant: lr throughout)."""
    peak, low, init = float(t.lr), float(t.min_lr), float(t.lr_warmup_init)
    warm, end = t.lr_warmup_iters, t.lr_decay_iters
    if warm and iteration <= warm:
        return init + (peak - init) * iteration / warm
    if t.lr_decay_style == "constant":
        return peak
    if iteration > end:
        return low
    if t.lr_decay_style == "inverse-square-root":
        # lr x sqrt(warm-up / step), both in samples; one sample without a warm-up
        return max(low, peak * math.sqrt(max(warm * batch, 1) / max(iteration * batch, 1)))
    progress = (iteration - warm) / (end - warm)  # 0 where the warm-up ends, 1 at lr_decay_iters
    if t.lr_decay_style == "linear":
        fraction = 1.0 - progress
    elif t.lr_decay_style == "cosine":
        fraction = (1.0 + math.cos(math.pi * progress)) / 2.0
    else:  # WSD: lr until the last lr_wsd_decay_iters of lr_decay_iters, then the annealing shape
        anneal = t.lr_wsd_decay_iters
        into = iteration - (end - anneal)
        if into <= 0:
            return peak
        x = into / anneal
        fraction = {"linear": 1.0 - x, "cosine": (1.0 + math.cos(math.pi * x)) / 2.0,
                    "exponential": 2.0 * 0.5 ** x - 1.0, "minus_sqrt": 1.0 - math.sqrt(x)}[t.lr_wsd_decay_style]
    return low + fraction * (peak - low)


def expected_weight_decay(t, iteration: int) -> float:
    """Megatron-LM's weight decay at ``iteration``: weight_decay, or start_weight_decay rising to
    end_weight_decay over train_iters (linear, or along half a cosine)."""
    if t.weight_decay_incr_style == "constant":
        return float(t.weight_decay)
    x = min(1.0, iteration / t.train_iters)
    rise = x if t.weight_decay_incr_style == "linear" else (1.0 - math.cos(math.pi * x)) / 2.0
    return t.start_weight_decay + rise * (t.end_weight_decay - t.start_weight_decay)


def _recipe(**overrides):
    return Recipe.from_yaml(TINY, **{"train_iters": 20, "lr": 3e-3, "min_lr": 3e-4, **overrides})


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)  # weight decays, bias does not
        self.norm = torch.nn.LayerNorm(4)


def _torch_optimizer():
    return torch.optim.AdamW(weight_decay_groups(_Block(), 0.5), lr=1.0)


def _values(schedule, optimizer, iterations: int) -> list[tuple]:
    """(schedule.lr, every group's lr, every group's weight decay) before each step."""
    seen = []
    for _ in range(iterations):
        seen.append((schedule.lr, [g["lr"] for g in optimizer.param_groups],
                     [g["weight_decay"] for g in optimizer.param_groups]))
        schedule.step()
    return seen


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18)


STYLES = {
    "constant after a warm-up from lr_warmup_init": dict(lr_decay_style="constant", lr_warmup_iters=4,
                                                          lr_warmup_init=1e-4),
    "linear, decay ending before train_iters": dict(lr_decay_style="linear", lr_warmup_iters=3, lr_decay_iters=14),
    "cosine without a warm-up": dict(lr_decay_style="cosine", lr_warmup_iters=0),
    "cosine after a warm-up": dict(lr_decay_style="cosine", lr_warmup_iters=5),
    "inverse square root after a warm-up": dict(lr_decay_style="inverse-square-root", lr_warmup_iters=4),
    "inverse square root without a warm-up": dict(lr_decay_style="inverse-square-root", lr_warmup_iters=0,
                                                  min_lr=0.0),
    **{f"WSD, {shape} annealing": dict(lr_decay_style="WSD", lr_warmup_iters=3, lr_decay_iters=18,
                                        lr_wsd_decay_iters=6, lr_wsd_decay_style=shape)
       for shape in ("exponential", "linear", "cosine", "minus_sqrt")},
    "linear weight-decay rise": dict(weight_decay_incr_style="linear", start_weight_decay=0.01,
                                     end_weight_decay=0.1),
    "cosine weight-decay rise": dict(weight_decay_incr_style="cosine", start_weight_decay=0.0,
                                     end_weight_decay=0.2),
}


@pytest.mark.parametrize("overrides", STYLES.values(), ids=STYLES.keys())
def test_each_style_follows_its_formula_in_every_parameter_group(overrides):
    recipe = _recipe(**overrides)
    t = recipe.train
    optimizer = _torch_optimizer()
    decays = [g["wd_mult"] for g in optimizer.param_groups]
    assert decays == [1.0, 0.0]  # weights, then biases and norms
    schedule = OptimizerSchedule(recipe, optimizer, BATCH)
    for iteration, (lr, group_lrs, group_decays) in enumerate(_values(schedule, optimizer, t.train_iters + 3)):
        want = expected_lr(t, iteration)
        assert _close(lr, want), (iteration, lr, want)
        assert all(_close(g, want) for g in group_lrs), (iteration, group_lrs, want)
        assert _close(group_decays[0], expected_weight_decay(t, iteration)), (iteration, group_decays)
        assert group_decays[1] == 0.0


def test_the_phases_are_where_the_keys_put_them():
    """The formula's landmarks, by hand: the first step at lr_warmup_init, lr where the warm-up
    ends, WSD stable until its annealing starts, min_lr at lr_decay_iters."""
    recipe = _recipe(lr_decay_style="WSD", lr_warmup_iters=3, lr_decay_iters=18, lr_wsd_decay_iters=6,
                     lr_wsd_decay_style="linear", lr_warmup_init=1e-4)
    schedule = OptimizerSchedule(recipe, _torch_optimizer(), BATCH)
    lrs = [lr for lr, _, _ in _values(schedule, schedule.scheduler.optimizer, 20)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[3] == pytest.approx(3e-3)
    assert lrs[3:13] == [pytest.approx(3e-3)] * 10  # stable until 18 - 6 = 12
    assert lrs[12] > lrs[13] > lrs[17] > lrs[18] == pytest.approx(3e-4)
    assert lrs[15] == pytest.approx(3e-4 + 0.5 * (3e-3 - 3e-4))  # halfway through a linear anneal


def test_megatron_cores_own_groups_decay_only_weights(monkeypatch):
    """megatron-core's parameter groups (``_get_param_groups``: ``wd_mult`` 0 for biases and
    norms, ``max_lr`` / ``min_lr`` of each group) take the schedule: the GPU path's optimizer
    decays only weights, at the scheduled rate (megatron-core's Adam alone decays every group)."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)  # groups are aligned over one rank
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(0, obj))
    recipe = _recipe(lr_decay_style="cosine", lr_warmup_iters=2, weight_decay=0.1)
    t = recipe.train
    config = OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay)
    model = _Block()
    groups = _get_param_groups([model], config, None)
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
    schedule = OptimizerSchedule(recipe, optimizer, BATCH)
    for iteration in range(t.train_iters):
        for group in optimizer.param_groups:
            assert _close(group["lr"], expected_lr(t, iteration))
            one_d = all(p.ndim == 1 for p in group["params"])
            assert group["weight_decay"] == (0.0 if one_d else pytest.approx(0.1)), (iteration, group)
        schedule.step()


def _json_round_trip(state: dict) -> dict:
    return json.loads(json.dumps(state, allow_nan=False))  # as a checkpoint's metadata keeps it


def test_a_resumed_schedule_continues_where_it_was_saved():
    recipe = _recipe(lr_decay_style="WSD", lr_warmup_iters=3, lr_decay_iters=18, lr_wsd_decay_iters=6)
    first = OptimizerSchedule(recipe, _torch_optimizer(), BATCH)
    _values(first, first.scheduler.optimizer, 7)
    state = _json_round_trip(first.state_dict())
    assert state["num_steps"] == 7 * BATCH and state["global_batch_size"] == BATCH
    resumed = OptimizerSchedule(recipe, _torch_optimizer(), BATCH)
    resumed.load_state_dict(state, 7)
    assert [v[0] for v in _values(resumed, resumed.scheduler.optimizer, 13)] == \
        [v[0] for v in _values(first, first.scheduler.optimizer, 13)]
    assert _close(resumed.lr, expected_lr(recipe.train, 20))
    # A checkpoint that saved no schedule restarts it at its iteration.
    bare = OptimizerSchedule(recipe, _torch_optimizer(), BATCH)
    bare.load_state_dict(None, 7)
    assert _close(bare.lr, expected_lr(recipe.train, 7))


def test_a_resume_on_another_schedule_is_refused_unless_the_recipe_says_which_wins():
    saved = OptimizerSchedule(_recipe(), _torch_optimizer(), BATCH)
    _values(saved, saved.scheduler.optimizer, 5)
    state = _json_round_trip(saved.state_dict())
    longer = _recipe(train_iters=30)  # lr_decay_iters follows train_iters
    with pytest.raises(TrainError) as refused:
        OptimizerSchedule(longer, _torch_optimizer(), BATCH).load_state_dict(state, 5)
    message = str(refused.value)
    assert "\n" not in message
    assert "lr_decay_iters 20 -> 30" in message and "train_iters 20 -> 30" in message
    assert "override_opt_param_scheduler=true" in message and "use_checkpoint_opt_param_scheduler=true" in message
    with pytest.raises(TrainError, match=r"global_batch_size 8 -> 16 \(the schedule counts samples\)"):
        OptimizerSchedule(_recipe(), _torch_optimizer(), 16).load_state_dict(state, 5)
    with pytest.raises(TrainError, match=r"lr_decay_style cosine -> WSD, lr_wsd_decay_iters None -> 4\)"):
        OptimizerSchedule(_recipe(lr_decay_style="WSD", lr_wsd_decay_iters=4), _torch_optimizer(),
                          BATCH).load_state_dict(state, 5)
    with pytest.raises(TrainError, match=r"weight_decay 0.01 -> 0.1\)"):
        OptimizerSchedule(_recipe(weight_decay=0.1), _torch_optimizer(), BATCH).load_state_dict(state, 5)

    followed = OptimizerSchedule(_recipe(train_iters=30, override_opt_param_scheduler=True), _torch_optimizer(), BATCH)
    followed.load_state_dict(state, 5)
    assert _close(followed.lr, expected_lr(longer.train, 5))
    kept = OptimizerSchedule(_recipe(train_iters=30, use_checkpoint_opt_param_scheduler=True), _torch_optimizer(),
                             BATCH)
    kept.load_state_dict(state, 5)
    assert _close(kept.lr, expected_lr(_recipe().train, 5))
    assert kept.scheduler.lr_decay_steps == 20 * BATCH


def test_checkpoints_keep_the_schedule_and_a_resume_restores_it(monkeypatch, tmp_path):
    """``Checkpointing.save`` puts the schedule's state in the checkpoint's metadata (JSON, under
    Megatron-LM's name) and ``resume`` hands it back to the run's schedule."""
    from types import SimpleNamespace

    import etp.megatron.checkpoint as checkpoint
    from etp.train.checkpointing import Checkpointing
    from etp.train.options import RunOptions

    kept = {}

    def save(root, iteration, model, optimizer, metadata):
        kept.update(iteration=iteration, metadata=_json_round_trip(metadata))
        return Path(root)

    monkeypatch.setattr(checkpoint, "save_training_checkpoint", save)
    monkeypatch.setattr(checkpoint, "load_training_checkpoint",
                        lambda root, model, optimizer, iteration=None: (kept["iteration"], kept["metadata"], None))
    recipe = _recipe(save=str(tmp_path))
    stepper = SimpleNamespace(model=None, optimizer=_torch_optimizer())
    schedule = OptimizerSchedule(recipe, stepper.optimizer, BATCH)
    _values(schedule, stepper.optimizer, 6)
    Checkpointing(recipe, RunOptions(), 0, 1).save(stepper, 6, schedule)
    assert kept["metadata"]["opt_param_scheduler"]["num_steps"] == 6 * BATCH
    fresh = SimpleNamespace(model=None, optimizer=_torch_optimizer())
    restored = OptimizerSchedule(recipe, fresh.optimizer, BATCH)
    assert Checkpointing(recipe, RunOptions(resume=True), 0, 1).resume(fresh, restored) == 6
    assert _close(restored.lr, expected_lr(recipe.train, 6))
    assert all(_close(g["lr"], expected_lr(recipe.train, 6)) for g in fresh.optimizer.param_groups)


@pytest.mark.slow  # three CPU runs; the pieces are tested above
def test_etp_train_logs_the_schedule_and_a_resume_continues_it(tmp_path, capsys):
    """A real run (one CPU rank) logs every iteration's learning rate as the formula gives it,
    saves the schedule with its checkpoint, and the resumed run continues it; a resume on another
    schedule is one line."""
    from etp.megatron.checkpoint.manifest import MANIFEST_NAME, iteration_dir
    from etp.train.main import main

    keys = ["--set", "world_size=1", "--set", "lr_decay_style=WSD", "--set", "lr_warmup_iters=2",
            "--set", "lr_wsd_decay_iters=3", "--set", "lr_wsd_decay_style=linear"]
    base = ["--recipe", str(TINY), "--train-iters", "6", "--log-interval", "1", *keys]
    save = ["--set", f"save={tmp_path / 'ckpt'}"]
    assert main([*base, *save, "--exit-after", "3", "--json", str(tmp_path / "first.json")]) == 0
    assert main([*base, *save, "--resume", "--json", str(tmp_path / "resumed.json")]) == 0
    t = Recipe.from_yaml(TINY, train_iters=6, world_size=1, lr_decay_style="WSD", lr_warmup_iters=2,
                         lr_wsd_decay_iters=3, lr_wsd_decay_style="linear").train
    batch = Recipe.from_yaml(TINY, world_size=1).global_batch_size()
    logged = [r["lr"] for name in ("first", "resumed")
              for r in json.loads((tmp_path / f"{name}.json").read_text())["log"]]
    want = [expected_lr(t, i, batch) for i in range(6)]
    assert len(logged) == 6 and all(_close(a, b) for a, b in zip(logged, want)), (logged, want)
    saved = json.loads((iteration_dir(tmp_path / "ckpt", 3) / MANIFEST_NAME).read_text())["metadata"]
    assert saved["opt_param_scheduler"]["num_steps"] == 3 * batch
    capsys.readouterr()
    elsewhere = ["--set", f"load={tmp_path / 'ckpt'}", "--set", f"save={tmp_path / 'other'}"]
    assert main([*base, *elsewhere, "--set", "lr_wsd_decay_iters=2", "--resume", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lr_wsd_decay_iters 3 -> 2" in err[0], err
