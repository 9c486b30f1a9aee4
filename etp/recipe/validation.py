"""Recipe value checks: the error type, per-key type and range checks, and the parallel layout
(which sizes must divide which), all raising ``RecipeError`` naming the key and the value."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping


class RecipeError(ValueError):
    """A bad recipe value. ``key`` is the recipe key at fault (``etp.<field>`` for the ETP
    section), ``value`` its value; the message names both."""

    def __init__(self, key: str, value: Any, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.value = value



_INT, _FLOAT, _BOOL, _STR = "int", "float", "bool", "str"
#: a list of strings (YAML ``[a, b]``; ``--set key=[a,b]``), kept as a tuple; ``choices``
#: restrict each element
_STR_LIST = "str_list"
#: megatron-core's ``moe_layer_freq``: an integer N (one MoE layer every N, the first one MoE) or
#: a 0 / 1 pattern per layer (1: MoE), given as a list or as Megatron-LM's string form
#: ``([0]*3+[1]*58)``; kept as an int or a tuple of ints
_LAYER_FREQ = "layer_freq"


def _describe_kind(kind: str) -> str:
    return {
        _INT: "an integer",
        _FLOAT: "a number",
        _BOOL: "true or false",
        _STR: "a string",
        _STR_LIST: "a list of strings",
        _LAYER_FREQ: "an integer or a list of 0 / 1 per layer",
    }[kind]


def _check_value(key: str, value: Any, meta: Mapping[str, Any]) -> Any:
    """Type-checks and range-checks one value; returns it normalized (ints given for float
    keys become floats). ``None`` must have been handled by the caller."""
    kind = meta["kind"]
    got = type(value).__name__
    if kind == _INT:
        # bool is a subclass of int: `num_layers: true` is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(
                key, value, f"recipe key {key}={value!r}: expected an integer, got {got}"
            )
    elif kind == _FLOAT:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ""
            if isinstance(value, str):
                try:
                    float(value)
                    hint = " (quote-free numbers are numbers; write e.g. 3.0e-3)"
                except ValueError:
                    pass
            raise RecipeError(
                key, value, f"recipe key {key}={value!r}: expected a number, got {got}{hint}"
            )
        value = float(value)
        if not math.isfinite(value):
            raise RecipeError(key, value, f"recipe key {key}={value!r}: must be finite")
    elif kind == _BOOL:
        if not isinstance(value, bool):
            raise RecipeError(
                key, value, f"recipe key {key}={value!r}: expected true or false, got {got}"
            )
    elif kind == _STR:
        if not isinstance(value, str):
            raise RecipeError(
                key, value, f"recipe key {key}={value!r}: expected a string, got {got}"
            )
        if not value:
            raise RecipeError(key, value, f"recipe key {key}={value!r}: must not be empty")
    elif kind == _STR_LIST:
        return _check_str_list(key, value, meta["choices"])
    elif kind == _LAYER_FREQ:
        return _check_layer_freq(key, value)
    minimum = meta["minimum"]
    if minimum is not None:
        if meta["exclusive_minimum"] and not value > minimum:
            raise RecipeError(key, value, f"recipe key {key}={value!r}: must be > {minimum}")
        if not meta["exclusive_minimum"] and value < minimum:
            raise RecipeError(key, value, f"recipe key {key}={value!r}: must be >= {minimum}")
    below = meta["below"]
    if below is not None and not value < below:
        raise RecipeError(key, value, f"recipe key {key}={value!r}: must be < {below}")
    choices = meta["choices"]
    if choices is not None and value not in choices:
        raise RecipeError(
            key, value, f"recipe key {key}={value!r}: allowed values are {list(choices)}"
        )
    return value


def _check_str_list(key: str, value: Any, choices: Any) -> tuple[str, ...]:
    """A list of distinct strings (each one of ``choices`` when given), returned as a tuple."""
    if not isinstance(value, (list, tuple)):
        raise RecipeError(
            key,
            value,
            f"recipe key {key}={value!r}: expected a list of strings, got "
            f"{type(value).__name__} (YAML `{key}: [a, b]`, or `--set {key}=[a,b]`)",
        )
    for item in value:
        if not isinstance(item, str) or not item:
            raise RecipeError(
                key, value, f"recipe key {key}={value!r}: {item!r} is not a non-empty string"
            )
        if choices is not None and item not in choices:
            raise RecipeError(
                key,
                value,
                f"recipe key {key}={value!r}: {item!r} is not one of {list(choices)}",
            )
    repeated = sorted({item for item in value if list(value).count(item) > 1})
    if repeated:
        raise RecipeError(key, value, f"recipe key {key}={value!r}: {repeated} listed twice")
    return tuple(value)


_PATTERN_TERM = re.compile(r"\[\s*([01](?:\s*,\s*[01])*)\s*\](?:\s*\*\s*(\d+))?")


def _parse_layer_pattern(key: str, text: str) -> list[int]:
    """Megatron-LM's ``--moe-layer-freq`` string: ``[0,1]*n`` terms joined by ``+``, optionally
    in parentheses (``([0]*3+[1]*58)``). Parsed, never evaluated."""
    body = text.strip()
    if body.startswith("(") and body.endswith(")"):
        body = body[1:-1]
    pattern: list[int] = []
    for term in body.split("+"):
        match = _PATTERN_TERM.fullmatch(term.strip())
        if match is None:
            raise RecipeError(key, text, f"recipe key {key}={text!r}: {term.strip()!r} is not a term like "
                              "[0]*3 or [0,1]: write e.g. ([0]*3+[1]*5), a list [0, 0, 0, 1] or an integer")
        items = [int(v) for v in match.group(1).split(",")]
        pattern += items * int(match.group(2) or 1)
    return pattern


def _check_layer_freq(key: str, value: Any) -> int | tuple[int, ...]:
    """An integer >= 1, or a non-empty pattern of 0 / 1 (a list, or Megatron-LM's string form)."""
    if isinstance(value, str):
        value = _parse_layer_pattern(key, value)
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise RecipeError(key, value, f"recipe key {key}={value!r}: expected an integer or a list of 0 / 1 "
                          f"per layer, got {type(value).__name__}")
    if isinstance(value, int):
        if value < 1:
            raise RecipeError(key, value, f"recipe key {key}={value!r}: must be >= 1")
        return value
    if not value or any(type(v) is not int or v not in (0, 1) for v in value):
        raise RecipeError(key, value, f"recipe key {key}={value!r}: a pattern has one 0 (dense) or 1 (MoE) "
                          "per layer")
    return tuple(value)


def _validate_fields(obj: Any) -> None:
    """Checks every recipe key of a spec dataclass in place (frozen: via object.__setattr__)."""
    for f in dataclasses.fields(obj):
        meta = f.metadata
        if "kind" not in meta:
            continue
        value = getattr(obj, f.name)
        if value is None:
            if meta["required"]:
                raise RecipeError(
                    f.name,
                    None,
                    f"recipe key {f.name} is required ({meta['help']}): add `{f.name}: <value>`",
                )
            if f.default is not None:
                raise RecipeError(
                    f.name,
                    None,
                    f"recipe key {f.name}=None: expected {_describe_kind(meta['kind'])} "
                    f"(default {f.default!r})",
                )
            continue
        object.__setattr__(obj, f.name, _check_value(f.name, value, meta))


def _fail(key: str, value: Any, message: str) -> None:
    raise RecipeError(key, value, f"recipe key {key}={value!r}: {message}")



# ---------------------------------------------------------------------------------- schedule
def check_schedule(train: Any) -> None:
    """The learning-rate and weight-decay keys of a ``TrainSpec`` (after its warm-up clip), as
    Megatron-LM's ``validate_args`` and megatron-core's ``OptimizerParamScheduler`` assert them,
    refused with the fix instead (etp-train builds that scheduler: ``etp.train.schedule``).

    Example::

        check_schedule(TrainSpec(micro_batch_size=4, train_iters=60, lr=3e-3))   # passes
    """
    t = train
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        _fail("override_opt_param_scheduler", True, "and use_checkpoint_opt_param_scheduler are both true: choose "
              "the recipe's schedule (override_opt_param_scheduler) or the checkpoint's")
    if t.lr_warmup_init > t.lr:
        _fail("lr_warmup_init", t.lr_warmup_init, f"must be <= lr={t.lr} (the warm-up rises from it to lr)")
    if t.lr_warmup_iters >= t.lr_decay_iters:
        _fail("lr_warmup_iters", t.lr_warmup_iters, f"must be < lr_decay_iters={t.lr_decay_iters} (the decay "
              "starts where the warm-up ends; lr_decay_iters counts from iteration 0, warm-up included)")
    if t.lr_decay_style == "WSD" and t.lr_wsd_decay_iters is None:
        _fail("lr_decay_style", "WSD", "needs lr_wsd_decay_iters: the iterations of its annealing phase, "
              "the last ones of lr_decay_iters (e.g. --set lr_wsd_decay_iters=N)")
    if t.lr_decay_style != "WSD" and t.lr_wsd_decay_iters is not None:
        _fail("lr_wsd_decay_iters", t.lr_wsd_decay_iters, f"does nothing with lr_decay_style={t.lr_decay_style!r}: "
              "set `lr_decay_style: WSD` or remove lr_wsd_decay_iters")
    if t.weight_decay_incr_style == "constant":
        for key in ("start_weight_decay", "end_weight_decay"):
            if getattr(t, key) is not None:
                _fail(key, getattr(t, key), "does nothing with weight_decay_incr_style: constant (weight_decay "
                      "holds throughout): set weight_decay_incr_style to linear or cosine, or remove "
                      f"{key}")
        return
    for key in ("start_weight_decay", "end_weight_decay"):
        if getattr(t, key) is None:
            _fail("weight_decay_incr_style", t.weight_decay_incr_style, f"needs {key} (the weight decay goes "
                  "from start_weight_decay to end_weight_decay over train_iters; weight_decay is not used)")
    if t.end_weight_decay < t.start_weight_decay:
        _fail("end_weight_decay", t.end_weight_decay, f"must be >= start_weight_decay={t.start_weight_decay} "
              "(megatron-core's schedule only increases the weight decay)")



# ---------------------------------------------------------------------------------- layout
def check_parallel_layout(
    world_size: int,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    etp_size: int = 1,
    expert_etp_size: int = 1,
) -> tuple[int, int]:
    """Checks that ETP fits Megatron's parallel layout on ``world_size`` ranks (see
    [Note: ETP inside the parallel layout]); returns ``(data_parallel_size,
    expert_data_parallel_size)``. Raises :class:`RecipeError` naming the key at fault.

    Example::

        check_parallel_layout(8, tensor_model_parallel_size=2, etp_size=4)   # (4, 4)
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise RecipeError(
            "world_size", world_size, f"world_size={world_size!r}: expected a positive integer"
        )
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep = expert_model_parallel_size
    etp_tp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    span = tp * pp * cp
    if world_size % span:
        raise RecipeError(
            "world_size",
            world_size,
            f"world_size={world_size} is not divisible by tensor_model_parallel_size x "
            f"pipeline_model_parallel_size x context_parallel_size = {tp} x {pp} x {cp} = {span}",
        )
    dp = world_size // span
    if dp % etp_size:
        raise RecipeError(
            "etp.etp_size",
            etp_size,
            f"etp.etp_size={etp_size} does not divide the data-parallel size {dp} (world_size "
            f"{world_size} / (TP {tp} x PP {pp} x CP {cp})): ETP shards each dense weight over "
            "ranks of its data-parallel group",
        )
    expert_span = etp_tp * ep * pp
    if world_size % expert_span:
        raise RecipeError(
            "expert_model_parallel_size",
            ep,
            f"expert_model_parallel_size={ep}: world_size={world_size} is not divisible by "
            f"expert_tensor_parallel_size x expert_model_parallel_size x "
            f"pipeline_model_parallel_size = {etp_tp} x {ep} x {pp} = {expert_span}",
        )
    edp = world_size // expert_span
    if edp % expert_etp_size:
        raise RecipeError(
            "etp.expert_etp_size",
            expert_etp_size,
            f"etp.expert_etp_size={expert_etp_size} does not divide the expert-data-parallel "
            f"size {edp} (world_size {world_size} / (expert_tensor_parallel_size {etp_tp} x "
            f"expert_model_parallel_size {ep} x PP {pp})): ETP shards each expert weight over "
            "ranks of its expert-data-parallel group",
        )
    return dp, edp


