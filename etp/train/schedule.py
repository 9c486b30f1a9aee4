"""etp-train's learning-rate and weight-decay schedule: megatron-core's
``OptimizerParamScheduler``, built from a recipe as Megatron-LM builds it for an
iteration-based run, driving the optimizer's parameter groups.

[Note: the schedule counts samples]
Megatron-LM's ``get_optimizer_param_scheduler`` (``train_iters`` set) gives the scheduler its
lengths in samples: ``lr_warmup_iters``, ``lr_decay_iters`` and ``lr_wsd_decay_iters`` times
the global batch, and ``train_iters`` times the global batch for the weight-decay increment;
after each optimizer step it advances the scheduler by the global batch (micro-batches x
micro-batch size x data-parallel size). So iteration ``i`` (0-based) steps at ``num_steps =
i x global batch``: with a warm-up, iteration 0 runs at ``lr_warmup_init`` and iteration
``lr_warmup_iters`` at ``lr``; past ``lr_decay_iters`` every style but constant holds
``min_lr``. Ratios of the two are the same counted either way, except inverse square root
without a warm-up: ``lr / sqrt(max(num_steps, 1))``, in samples, as Megatron-LM runs it.

Each step the scheduler writes every parameter group's ``lr`` (``max_lr`` / ``min_lr`` of the
group when it has them: megatron-core's groups do) and ``weight_decay`` times the group's
``wd_mult`` (0 for biases and 1-D parameters: megatron-core's groups and
``etp.train.optimizer_steps.weight_decay_groups`` carry it). A checkpoint keeps the
scheduler's state (``metadata["opt_param_scheduler"]``, Megatron-LM's name), and a resumed run
continues it: a recipe whose schedule differs from the checkpoint's is refused unless
``override_opt_param_scheduler`` (the recipe's from the checkpoint's iteration on) or
``use_checkpoint_opt_param_scheduler`` (the checkpoint's) says which wins, as in Megatron-LM.
"""
from __future__ import annotations

from etp.train.options import TrainError

__all__ = ["OptimizerSchedule"]

#: the scheduler's quantities etp adds to megatron-core's ``state_dict`` (which leaves them out),
#: so a resume compares them too
_EXTRA_STATE = ("init_lr", "wsd_decay_steps", "lr_wsd_decay_style")
#: scheduler quantity -> the recipe key it comes from (``_steps``: that key x the global batch)
_RECIPE_KEYS = {
    "max_lr": "lr", "min_lr": "min_lr", "init_lr": "lr_warmup_init", "lr_warmup_steps": "lr_warmup_iters",
    "lr_decay_steps": "lr_decay_iters", "lr_decay_style": "lr_decay_style",
    "wsd_decay_steps": "lr_wsd_decay_iters", "lr_wsd_decay_style": "lr_wsd_decay_style",
    "start_wd": "start_weight_decay", "end_wd": "end_weight_decay", "wd_incr_steps": "train_iters",
    "wd_incr_style": "weight_decay_incr_style",
}


class OptimizerSchedule:
    """megatron-core's ``OptimizerParamScheduler`` of a recipe over ``optimizer``'s parameter
    groups (a torch optimizer or megatron-core's; anything with ``param_groups``), counted as
    [Note: the schedule counts samples] says. Construction sets iteration 0's values.

    Args:
        recipe: the run's recipe (its ``train`` section's schedule keys).
        optimizer: what the run steps.
        global_batch_size: samples per optimizer step (``recipe.global_batch_size(world)``).

    Example::

        schedule = OptimizerSchedule(recipe, stepper.optimizer, recipe.global_batch_size(world))
        for iteration in range(start, stop):
            ...forward, backward...
            stepper.step(schedule.lr, phase)
            schedule.step()
    """

    def __init__(self, recipe, optimizer, global_batch_size: int) -> None:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        t, g = recipe.train, global_batch_size
        self.global_batch_size = g
        constant_wd = t.weight_decay_incr_style == "constant"  # Megatron-LM: start = end = weight_decay
        self.scheduler = OptimizerParamScheduler(
            optimizer, init_lr=t.lr_warmup_init, max_lr=t.lr, min_lr=t.min_lr,
            lr_warmup_steps=t.lr_warmup_iters * g, lr_decay_steps=t.lr_decay_iters * g,
            lr_decay_style=t.lr_decay_style,
            start_wd=t.weight_decay if constant_wd else t.start_weight_decay,
            end_wd=t.weight_decay if constant_wd else t.end_weight_decay,
            wd_incr_steps=t.train_iters * g, wd_incr_style=t.weight_decay_incr_style,
            # etp compares the checkpoint's values itself (load_state_dict) and names the fix;
            # megatron-core's own check is an assertion.
            use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler=t.override_opt_param_scheduler,
            wsd_decay_steps=None if t.lr_wsd_decay_iters is None else t.lr_wsd_decay_iters * g,
            lr_wsd_decay_style=t.lr_wsd_decay_style)
        self._compare = not (t.override_opt_param_scheduler or t.use_checkpoint_opt_param_scheduler)
        #: the learning rate of the last step taken (None before the first): what the log shows
        self.stepped_lr: float | None = None

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step (a group without its own ``max_lr``)."""
        return self.scheduler.get_lr({})

    @property
    def weight_decay(self) -> float:
        """The weight decay of the next optimizer step (before a group's ``wd_mult``)."""
        return self.scheduler.get_wd()

    def step(self) -> None:
        """One optimizer step done: the next iteration's values go into the parameter groups."""
        self.stepped_lr = self.lr
        self.scheduler.step(increment=self.global_batch_size)

    def state_dict(self) -> dict:
        """megatron-core's scheduler state, the quantities it leaves out, and the global batch
        (JSON: a checkpoint's metadata holds it)."""
        state = dict(self.scheduler.state_dict())
        state.update({key: getattr(self.scheduler, key) for key in _EXTRA_STATE})
        state["global_batch_size"] = self.global_batch_size
        return state

    def load_state_dict(self, state: dict | None, iteration: int) -> None:
        """Continues a checkpoint's schedule (``state``; None for a checkpoint that saved none:
        the schedule then restarts at ``iteration``). Raises ``TrainError`` naming the keys when
        the recipe's schedule differs from the checkpoint's and the recipe does not say which
        wins."""
        if not state:
            self.scheduler.step(increment=iteration * self.global_batch_size)
            return
        if self._compare:
            self._refuse_differences(state, iteration)
        elif self.scheduler.use_checkpoint_opt_param_scheduler:
            for key in _EXTRA_STATE:  # megatron-core restores the rest
                if key in state:
                    setattr(self.scheduler, key, state[key])
        self.scheduler.load_state_dict(state)

    def _refuse_differences(self, state: dict, iteration: int) -> None:
        mine, g = self.state_dict(), self.global_batch_size
        their_batch = state.get("global_batch_size") or g
        differences = [] if their_batch == g else [f"global_batch_size {their_batch} -> {g} (the schedule counts "
                                                   "samples)"]
        for name, key in _RECIPE_KEYS.items():
            if name not in state:
                continue
            saved, ours = state[name], mine[name]
            if name.endswith("_steps"):  # in iterations, as the recipe writes them
                saved = None if saved is None else saved // their_batch
                ours = None if ours is None else ours // g
            if name in ("start_wd", "end_wd") and self.scheduler.wd_incr_style == "constant":
                key = "weight_decay"
            if saved != ours:
                differences.append(f"{key} {saved} -> {ours}")
        differences = list(dict.fromkeys(differences))  # a constant weight decay is both start and end
        if differences:
            raise TrainError(
                f"the checkpoint of iteration {iteration} was trained on another learning-rate schedule "
                f"(checkpoint -> recipe: {', '.join(differences)}): restore those keys, or set "
                "override_opt_param_scheduler=true (the recipe's schedule from this iteration on) or "
                "use_checkpoint_opt_param_scheduler=true (the checkpoint's)")
