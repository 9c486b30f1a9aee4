"""Training recipes: one YAML file of Megatron-LM argument names plus an ``etp:`` section.

A recipe is flat, like Megatron-LM's own command lines: every top-level key is the ``dest`` of
a Megatron-LM argument (``--num-layers`` -> ``num_layers``; the flag ``--disable-bias-linear``
-> ``add_bias_linear: false``) or one of etp's few driver keys, and the ``etp:`` section holds
exactly the fields of :class:`etp.ETPConfig`. Everything is checked here, before any process
group or GPU exists: unknown keys (with the closest known name), wrong types, out-of-range
values and inconsistent sizes raise :class:`RecipeError` (a ``ValueError``) naming the key and
the value. Checks that need the number of ranks run in :meth:`Recipe.check_world_size`, and
already at load time when the recipe sets ``world_size``.

Example::

    # recipes/tiny_moe_cpu.yaml
    num_layers: 2
    hidden_size: 64
    num_attention_heads: 4
    num_experts: 4
    ...
    etp:
      etp_size: 2
      expert_etp_size: 2

    recipe = Recipe.from_yaml("recipes/tiny_moe_cpu.yaml", train_iters=5)
    recipe.check_world_size(2)
    recipe.model.hidden_size, recipe.etp.etp_size, recipe.data_parallel_size(2)

Schema (key: default; "required" keys have none). Defaults are Megatron-LM's unless marked.

Model (``recipe.model``, :class:`ModelSpec`):
    num_layers, hidden_size, num_attention_heads, seq_length, vocab_size: required.
    ffn_hidden_size: None -> 4*hidden_size, or int(4*hidden_size*2/3 / 64)*64 with swiglu.
    num_query_groups: None -> num_attention_heads (no grouped-query attention; Megatron-LM
        also needs ``group_query_attention``, etp infers it from num_query_groups < heads).
    max_position_embeddings: None -> seq_length.
    vocab_size: etp's own reading: there is no tokenizer; data is token ids < vocab_size
        (a text corpus is read as UTF-8 bytes, so vocab_size >= 256 with a corpus).
    make_vocab_size_divisible_by: 128 (the embedding has padded_vocab_size rows).
    swiglu: false. normalization: LayerNorm (LayerNorm | RMSNorm).
    position_embedding_type: learned_absolute (learned_absolute | rope | none).
    untie_embeddings_and_output_weights: false. add_bias_linear: true.
    init_method_std: 0.02. attention_dropout: 0.1. hidden_dropout: 0.1.
    num_experts: None (a dense model; otherwise every layer is MoE).
    moe_router_topk: 2. moe_ffn_hidden_size: None -> ffn_hidden_size.
    moe_grouped_gemm: false (true: etp's GroupedSwiGLUExperts, torch._grouped_mm; false:
        megatron-core SequentialMLP experts).
    moe_token_dispatcher_type: allgather (allgather | alltoall | flex).
    moe_aux_loss_coeff: 0.0.
    moe_router_load_balancing_type: aux_loss (aux_loss | seq_aux_loss | global_aux_loss |
        sinkhorn | none; one value, not Megatron-LM's list form).

Parallelism (``recipe.parallel``, :class:`ParallelSpec`):
    tensor_model_parallel_size: 1. pipeline_model_parallel_size: 1.
    expert_model_parallel_size: 1. expert_tensor_parallel_size: None -> tensor size.
    context_parallel_size: 1. sequence_parallel: false. use_distributed_optimizer: false.
    overlap_grad_reduce: false.
    world_size: None (etp driver key: ranks the recipe is meant for; the CPU driver spawns
        this many; under torchrun it must equal WORLD_SIZE).
    backend: auto (etp driver key: auto | gloo | nccl; auto is nccl with CUDA, else gloo).

Training (``recipe.train``, :class:`TrainSpec`):
    micro_batch_size, train_iters, lr: required. global_batch_size: None -> micro_batch_size
        * data_parallel_size (one microbatch per step).
    min_lr: 0.0. lr_warmup_iters: 0. lr_decay_iters: None -> train_iters.
    lr_decay_style: linear (constant | linear | cosine | inverse-square-root | WSD).
    weight_decay: 0.01. clip_grad: 1.0 (0 = off). adam_beta1: 0.9. adam_beta2: 0.999.
    adam_eps: 1e-08. bf16: false. fp16: false. seed: 1234. log_interval: 100.
    save: None. save_interval: None (needs save). load: None.
    data: synthetic (etp's own: "synthetic" for random token ids, or the path of a text
        corpus, read as bytes; a relative path is looked up from the working directory, the
        recipe's directory and the directory holding the etp package, see
        :meth:`Recipe.resolve_data_path`).

ETP (``recipe.etp``, :class:`etp.ETPConfig`): etp_size, expert_etp_size, pad_for_alignment,
    reduction, gather_dtype, prefetch, async_reduce, debug_checks (defaults in
    configs/etp.yaml).

[Note: ETP inside the parallel layout]
Megatron-LM splits the world as ``world = TP x CP x PP x DP`` for dense weights and
``world = ETP_tp x EP x PP x EDP`` for experts (ETP_tp = expert_tensor_parallel_size, EDP the
expert-data-parallel size). ETP is a sub-axis of data parallelism: a dense weight is sharded
over ``etp_size`` ranks of its data-parallel group (so ``etp_size`` divides DP) and an expert
weight over ``expert_etp_size`` ranks of its expert-data-parallel group (so
``expert_etp_size`` divides EDP). DDP then reduces over the remaining ``DP / etp_size``
(``EDP / expert_etp_size``) replicas.

YAML 1.1 (PyYAML) reads ``3e-3`` as a string; recipes are loaded with a loader that reads it
as the float it looks like, and duplicate keys are errors.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..config import ETPConfig

__all__ = [
    "ModelSpec",
    "ParallelSpec",
    "Recipe",
    "RecipeError",
    "TrainSpec",
    "check_parallel_layout",
    "load_recipe_yaml",
    "parse_overrides",
]


class RecipeError(ValueError):
    """A bad recipe value. ``key`` is the recipe key at fault (``etp.<field>`` for the ETP
    section), ``value`` its value; the message names both."""

    def __init__(self, key: str, value: Any, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.value = value


# ---------------------------------------------------------------------------------- schema
_INT, _FLOAT, _BOOL, _STR = "int", "float", "bool", "str"


def _key(
    default: Any,
    kind: str,
    help: str,
    *,
    required: bool = False,
    minimum: float | None = None,
    exclusive_minimum: bool = False,
    below: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A recipe key: a dataclass field whose metadata drives validation.

    ``default`` None means "derived" (or unset) unless ``required``; ``minimum`` / ``below``
    bound numbers (``below`` exclusive); ``choices`` restrict strings.
    """
    return field(
        default=default,
        metadata=dict(
            kind=kind,
            help=help,
            required=required,
            minimum=minimum,
            exclusive_minimum=exclusive_minimum,
            below=below,
            choices=choices,
        ),
    )


def _positive(default: Any, help: str, **kw: Any) -> Any:
    return _key(default, _INT, help, minimum=1, **kw)


_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
_DISPATCHERS = ("allgather", "alltoall", "flex")
_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_BACKENDS = ("auto", "gloo", "nccl")
SYNTHETIC = "synthetic"


def _describe_kind(kind: str) -> str:
    return {
        _INT: "an integer",
        _FLOAT: "a number",
        _BOOL: "true or false",
        _STR: "a string",
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


# ---------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class ModelSpec:
    """The GPT / MoE model of a recipe (Megatron-LM argument names; see the module docstring
    for defaults). Derived defaults (``ffn_hidden_size``, ``num_query_groups``,
    ``max_position_embeddings``, ``moe_ffn_hidden_size``) are filled in on construction.

    Example::

        spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                         vocab_size=256, num_experts=4)
        spec.moe_ffn_hidden_size   # 256 (= ffn_hidden_size = 4 * 64)
    """

    num_layers: int = _positive(None, "transformer layers", required=True)
    hidden_size: int = _positive(None, "model width", required=True)
    ffn_hidden_size: int | None = _positive(None, "dense MLP width")
    num_attention_heads: int = _positive(None, "attention heads", required=True)
    num_query_groups: int | None = _positive(None, "key/value heads (grouped-query attention)")
    seq_length: int = _positive(None, "tokens per sample", required=True)
    max_position_embeddings: int | None = _positive(None, "positions of the position embedding")
    vocab_size: int = _positive(None, "token ids are < vocab_size", required=True)
    make_vocab_size_divisible_by: int = _positive(128, "pad the vocabulary to this x TP")
    swiglu: bool = _key(False, _BOOL, "SwiGLU MLPs")
    normalization: str = _key("LayerNorm", _STR, "norm layers", choices=_NORMALIZATIONS)
    position_embedding_type: str = _key(
        "learned_absolute", _STR, "position embedding", choices=_POSITION_EMBEDDINGS
    )
    untie_embeddings_and_output_weights: bool = _key(False, _BOOL, "separate output layer weight")
    add_bias_linear: bool = _key(True, _BOOL, "biases in linear layers")
    init_method_std: float = _key(
        0.02, _FLOAT, "weight init std", minimum=0.0, exclusive_minimum=True
    )
    attention_dropout: float = _key(0.1, _FLOAT, "attention dropout", minimum=0.0, below=1.0)
    hidden_dropout: float = _key(0.1, _FLOAT, "hidden dropout", minimum=0.0, below=1.0)
    num_experts: int | None = _positive(None, "routed experts per MoE layer (None: dense)")
    moe_router_topk: int = _positive(2, "experts per token")
    moe_ffn_hidden_size: int | None = _positive(None, "width of each expert's MLP")
    moe_grouped_gemm: bool = _key(False, _BOOL, "grouped expert GEMMs")
    moe_token_dispatcher_type: str = _key(
        "allgather", _STR, "token dispatcher", choices=_DISPATCHERS
    )
    moe_aux_loss_coeff: float = _key(0.0, _FLOAT, "load-balancing loss weight", minimum=0.0)
    moe_router_load_balancing_type: str = _key(
        "aux_loss", _STR, "router load balancing", choices=_LOAD_BALANCING
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        if self.ffn_hidden_size is None:
            # Megatron-LM's validate_args rule.
            h = self.hidden_size
            ffn = int((4 * h * 2 / 3) / 64) * 64 if self.swiglu else 4 * h
            if ffn < 1:
                _fail(
                    "hidden_size",
                    h,
                    "is too small for the swiglu ffn_hidden_size default: set ffn_hidden_size",
                )
            object.__setattr__(self, "ffn_hidden_size", ffn)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        if self.hidden_size % self.num_attention_heads:
            _fail(
                "hidden_size",
                self.hidden_size,
                f"must be divisible by num_attention_heads={self.num_attention_heads} "
                "(the head width is hidden_size / num_attention_heads)",
            )
        if self.num_attention_heads % self.num_query_groups:
            _fail(
                "num_query_groups",
                self.num_query_groups,
                f"must divide num_attention_heads={self.num_attention_heads}",
            )
        if self.max_position_embeddings < self.seq_length:
            _fail(
                "max_position_embeddings",
                self.max_position_embeddings,
                f"must be >= seq_length={self.seq_length}",
            )
        if self.num_experts is None:
            if self.moe_ffn_hidden_size is not None:
                _fail(
                    "moe_ffn_hidden_size",
                    self.moe_ffn_hidden_size,
                    "is set but num_experts is not (a dense model has no experts)",
                )
        else:
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
            if self.moe_router_topk > self.num_experts:
                _fail(
                    "moe_router_topk",
                    self.moe_router_topk,
                    f"must be <= num_experts={self.num_experts}",
                )

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def kv_channels(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ParallelSpec:
    """Parallel sizes of a recipe (Megatron-LM names) and etp's driver keys ``world_size`` and
    ``backend``. ``expert_tensor_parallel_size`` defaults to the tensor size.

    Example::

        spec = ParallelSpec(tensor_model_parallel_size=2, sequence_parallel=True)
        spec.expert_tensor_parallel_size   # 2
    """

    tensor_model_parallel_size: int = _positive(1, "tensor-parallel size (TP)")
    pipeline_model_parallel_size: int = _positive(1, "pipeline-parallel size (PP)")
    expert_model_parallel_size: int = _positive(1, "expert-parallel size (EP)")
    expert_tensor_parallel_size: int | None = _positive(None, "tensor-parallel size of experts")
    context_parallel_size: int = _positive(1, "context-parallel size (CP)")
    sequence_parallel: bool = _key(False, _BOOL, "sequence parallelism (needs TP > 1)")
    use_distributed_optimizer: bool = _key(False, _BOOL, "shard optimizer state over DP")
    overlap_grad_reduce: bool = _key(False, _BOOL, "overlap DDP gradient reduction with backward")
    world_size: int | None = _positive(None, "ranks the recipe is meant for (etp driver key)")
    backend: str = _key("auto", _STR, "process-group backend (etp driver key)", choices=_BACKENDS)

    def __post_init__(self) -> None:
        _validate_fields(self)
        if self.expert_tensor_parallel_size is None:
            object.__setattr__(self, "expert_tensor_parallel_size", self.tensor_model_parallel_size)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            _fail(
                "sequence_parallel",
                True,
                "needs tensor_model_parallel_size > 1 (it splits the sequence over the TP group)",
            )

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: the ranks one dense replica spans."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    @property
    def expert_model_parallel_span(self) -> int:
        """ETP_tp x EP x PP: the ranks one expert replica spans."""
        return (
            self.expert_tensor_parallel_size
            * self.expert_model_parallel_size
            * self.pipeline_model_parallel_size
        )


@dataclass(frozen=True)
class TrainSpec:
    """Batch sizes, optimizer, schedule, precision, logging, checkpoints and data of a recipe.
    ``lr_decay_iters`` defaults to ``train_iters``; ``global_batch_size`` stays None (one
    microbatch per step) until a world size is known, see :meth:`Recipe.global_batch_size`.

    Example::

        TrainSpec(micro_batch_size=4, train_iters=60, lr=3e-3).lr_decay_iters   # 60
    """

    micro_batch_size: int = _positive(None, "samples per rank per microbatch", required=True)
    global_batch_size: int | None = _positive(None, "samples per optimizer step, all ranks")
    train_iters: int = _positive(None, "optimizer steps", required=True)
    lr: float = _key(
        None, _FLOAT, "peak learning rate", required=True, minimum=0.0, exclusive_minimum=True
    )
    min_lr: float = _key(0.0, _FLOAT, "final learning rate", minimum=0.0)
    lr_warmup_iters: int = _key(0, _INT, "linear warmup steps", minimum=0)
    lr_decay_iters: int | None = _positive(None, "decay steps")
    lr_decay_style: str = _key("linear", _STR, "learning-rate decay", choices=_LR_DECAY_STYLES)
    weight_decay: float = _key(0.01, _FLOAT, "AdamW weight decay", minimum=0.0)
    clip_grad: float = _key(1.0, _FLOAT, "global grad-norm clip (0 = off)", minimum=0.0)
    adam_beta1: float = _key(0.9, _FLOAT, "Adam beta1", minimum=0.0, below=1.0)
    adam_beta2: float = _key(0.999, _FLOAT, "Adam beta2", minimum=0.0, below=1.0)
    adam_eps: float = _key(1e-8, _FLOAT, "Adam epsilon", minimum=0.0, exclusive_minimum=True)
    bf16: bool = _key(False, _BOOL, "bf16 parameters and compute")
    fp16: bool = _key(False, _BOOL, "fp16 parameters and compute")
    seed: int = _key(1234, _INT, "random seed", minimum=0)
    log_interval: int = _positive(100, "steps between log lines")
    save: str | None = _key(None, _STR, "checkpoint directory to save to")
    save_interval: int | None = _positive(None, "steps between checkpoints")
    load: str | None = _key(None, _STR, "checkpoint directory to load from")
    data: str = _key(SYNTHETIC, _STR, "'synthetic' or a text corpus path")

    def __post_init__(self) -> None:
        _validate_fields(self)
        if self.lr_decay_iters is None:
            object.__setattr__(self, "lr_decay_iters", self.train_iters)
        if self.min_lr > self.lr:
            _fail("min_lr", self.min_lr, f"must be <= lr={self.lr}")
        if self.lr_warmup_iters > self.train_iters:
            _fail(
                "lr_warmup_iters",
                self.lr_warmup_iters,
                f"must be <= train_iters={self.train_iters}",
            )
        if self.bf16 and self.fp16:
            _fail("fp16", True, "bf16 and fp16 are both true: choose one")
        if self.save_interval is not None and self.save is None:
            _fail("save_interval", self.save_interval, "needs save: a checkpoint directory")

    @property
    def is_synthetic(self) -> bool:
        return self.data == SYNTHETIC


_SECTIONS: dict[str, type] = {"model": ModelSpec, "parallel": ParallelSpec, "train": TrainSpec}
#: flat recipe key -> section attribute of Recipe
_KEY_SECTION: dict[str, str] = {
    f.name: section for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)
}
_ETP_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ETPConfig))


def _suggest(key: str, known: Iterable[str]) -> str | None:
    known = list(known)
    normalized = key.strip().replace("-", "_").lstrip("_")
    if normalized in known and normalized != key:
        return normalized
    match = difflib.get_close_matches(normalized, known, n=1, cutoff=0.6)
    return match[0] if match else None


def _unknown_key_error(key: str, value: Any, *, in_etp: bool) -> RecipeError:
    name = f"etp.{key}" if in_etp else str(key)
    if in_etp:
        if key in _KEY_SECTION:
            hint = f"{key} is a top-level recipe key, not an ETP setting: move it out of etp:"
        else:
            match = _suggest(str(key), _ETP_FIELDS)
            hint = f"did you mean {match!r}?" if match else f"ETP settings are {list(_ETP_FIELDS)}"
    elif key in _ETP_FIELDS:
        hint = f"{key} is an ETP setting: put it in the etp: section"
    else:
        match = _suggest(str(key), list(_KEY_SECTION) + ["etp"])
        hint = (
            f"did you mean {match!r}?"
            if match
            else f"known keys are {sorted(_KEY_SECTION)} and the etp: section"
        )
    return RecipeError(name, value, f"unknown recipe key {name!r} (value {value!r}): {hint}")


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


# ---------------------------------------------------------------------------------- recipe
@dataclass(frozen=True)
class Recipe:
    """A validated training recipe: model, parallel sizes, training settings and ETP settings.

    Build with :meth:`from_yaml` or :meth:`from_dict`; keys are flat (Megatron-LM argument
    names) plus an ``etp:`` mapping; ``recipe["num_layers"]`` looks a flat key up.

    Example::

        recipe = Recipe.from_yaml("recipes/moe_h200x8.yaml")
        recipe.check_world_size(8)
        baseline = recipe.replace(etp={"etp_size": 1, "expert_etp_size": 1})
        recipe.num_params() / 1e9, recipe.data_parallel_size(8)
    """

    model: ModelSpec
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    train: TrainSpec = None  # type: ignore[assignment]  # required; None fails validation
    etp: ETPConfig = field(default_factory=ETPConfig)
    #: the YAML file it came from (relative data paths are also looked up next to it)
    source: Path | None = field(default=None, compare=False, repr=False)
    #: the flat mapping it was built from (before derived defaults), for :meth:`replace`
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, cls in (*_SECTIONS.items(), ("etp", ETPConfig)):
            if not isinstance(getattr(self, name), cls):
                raise RecipeError(
                    name, getattr(self, name), f"Recipe.{name} must be a {cls.__name__}"
                )
        m, p, t, e = self.model, self.parallel, self.train, self.etp
        tp = p.tensor_model_parallel_size
        if m.num_attention_heads % tp:
            _fail(
                "num_attention_heads",
                m.num_attention_heads,
                f"must be divisible by tensor_model_parallel_size={tp}",
            )
        if m.num_query_groups % tp and tp % m.num_query_groups:
            _fail(
                "num_query_groups",
                m.num_query_groups,
                f"must be a multiple or a divisor of tensor_model_parallel_size={tp}",
            )
        if m.ffn_hidden_size % tp:
            _fail(
                "ffn_hidden_size",
                m.ffn_hidden_size,
                f"must be divisible by tensor_model_parallel_size={tp}",
            )
        if m.num_layers % p.pipeline_model_parallel_size:
            _fail(
                "num_layers",
                m.num_layers,
                f"must be divisible by pipeline_model_parallel_size="
                f"{p.pipeline_model_parallel_size}",
            )
        cp = p.context_parallel_size
        if cp > 1 and m.seq_length % (2 * cp):
            _fail(
                "seq_length",
                m.seq_length,
                f"must be divisible by 2 x context_parallel_size = {2 * cp}",
            )
        if p.sequence_parallel and m.seq_length % tp:
            _fail(
                "seq_length",
                m.seq_length,
                f"must be divisible by tensor_model_parallel_size={tp} with sequence_parallel",
            )
        if m.is_moe:
            ep, etp_tp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
            if m.num_experts % ep:
                _fail(
                    "num_experts",
                    m.num_experts,
                    f"must be divisible by expert_model_parallel_size={ep}",
                )
            if m.moe_ffn_hidden_size % etp_tp:
                _fail(
                    "moe_ffn_hidden_size",
                    m.moe_ffn_hidden_size,
                    f"must be divisible by expert_tensor_parallel_size={etp_tp}",
                )
            if ep > 1 and tp > 1 and not p.sequence_parallel:
                _fail(
                    "sequence_parallel",
                    False,
                    f"must be true with expert_model_parallel_size={ep} and "
                    f"tensor_model_parallel_size={tp} (Megatron-LM's rule)",
                )
        else:
            if p.expert_model_parallel_size > 1:
                _fail(
                    "expert_model_parallel_size",
                    p.expert_model_parallel_size,
                    "needs num_experts (the model is dense)",
                )
            if e.expert_etp_size > 1:
                _fail(
                    "etp.expert_etp_size",
                    e.expert_etp_size,
                    "needs num_experts (the model is dense)",
                )
        if e.gather_dtype.startswith("fp8") and not t.bf16:
            _fail(
                "etp.gather_dtype",
                e.gather_dtype,
                "FP8 gathers need bf16: true (the FP8 GEMMs take bf16 activations)",
            )
        if not t.is_synthetic and m.vocab_size < 256:
            _fail(
                "vocab_size",
                m.vocab_size,
                f"must be >= 256 with data={t.data!r}: a text corpus is read as bytes",
            )
        if p.world_size is not None:
            self.check_world_size(p.world_size)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(
        cls,
        values: Mapping[str, Any],
        *,
        source: str | Path | None = None,
        **overrides: Any,
    ) -> "Recipe":
        """Builds and validates a recipe from a flat mapping plus keyword overrides.

        Overrides take flat recipe keys, ``etp={...}`` (merged into the etp section) and the
        ETP field names themselves (``etp_size=1``: no Megatron-LM argument has these names,
        so they go to the etp section). In ``values`` ETP fields belong in ``etp:`` only.

        Example::

            Recipe.from_dict({"num_layers": 2, ..., "etp": {"etp_size": 2}}, train_iters=5)
        """
        if not isinstance(values, Mapping):
            raise RecipeError(
                "<recipe>", values, f"a recipe must be a mapping, got {type(values).__name__}"
            )
        flat = dict(values)
        etp_section = flat.pop("etp", None)
        etp_section = {} if etp_section is None else etp_section
        if not isinstance(etp_section, Mapping):
            raise RecipeError(
                "etp",
                etp_section,
                f"recipe key etp={etp_section!r}: expected a mapping of ETP settings",
            )
        etp_section = dict(etp_section)
        for key, value in overrides.items():
            if key == "etp":
                if not isinstance(value, Mapping):
                    raise RecipeError("etp", value, f"override etp={value!r}: expected a mapping")
                etp_section.update(value)
            elif key in _ETP_FIELDS:
                etp_section[key] = value
            else:
                flat[key] = value

        unknown = [k for k in flat if k not in _KEY_SECTION]
        if unknown:
            errors = [_unknown_key_error(k, flat[k], in_etp=False) for k in unknown]
            if len(errors) == 1:
                raise errors[0]
            raise RecipeError(errors[0].key, errors[0].value, "; ".join(map(str, errors)))
        unknown_etp = [k for k in etp_section if k not in _ETP_FIELDS]
        if unknown_etp:
            raise _unknown_key_error(unknown_etp[0], etp_section[unknown_etp[0]], in_etp=True)

        sections = {name: {} for name in _SECTIONS}
        for key, value in flat.items():
            sections[_KEY_SECTION[key]][key] = value
        built = {name: spec(**sections[name]) for name, spec in _SECTIONS.items()}
        try:
            etp_config = ETPConfig.from_dict(etp_section)
        except ValueError as error:
            key = next((k for k in _ETP_FIELDS if f"ETPConfig.{k}=" in str(error)), "etp")
            defaults = {f.name: f.default for f in dataclasses.fields(ETPConfig)}
            value = etp_section.get(key, defaults.get(key))
            raise RecipeError(
                f"etp.{key}", value, f"recipe key etp.{key}={value!r}: {error}"
            ) from error
        raw = {**flat, "etp": etp_section}
        return cls(
            **built,
            etp=etp_config,
            source=Path(source) if source is not None else None,
            raw=raw,
        )

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "Recipe":
        """Loads a YAML recipe plus overrides (see :meth:`from_dict`).

        Example::

            Recipe.from_yaml("recipes/tiny_moe_cpu.yaml", train_iters=5, etp={"etp_size": 1})
        """
        path = Path(path)
        return cls.from_dict(load_recipe_yaml(path), source=path, **overrides)

    def replace(self, **overrides: Any) -> "Recipe":
        """A new recipe from this one's keys plus overrides (derived defaults are derived
        again, so ``replace(hidden_size=128)`` also changes a derived ``ffn_hidden_size``)."""
        return self.from_dict(self.raw, source=self.source, **overrides)

    # ------------------------------------------------------------------ access
    def __getitem__(self, key: str) -> Any:
        """The value of a flat recipe key (derived defaults filled in)."""
        if key in _ETP_FIELDS:
            return getattr(self.etp, key)
        if key not in _KEY_SECTION:
            raise KeyError(str(_unknown_key_error(key, None, in_etp=False)))
        return getattr(getattr(self, _KEY_SECTION[key]), key)

    def to_dict(self) -> dict[str, Any]:
        """The flat mapping with derived defaults filled in; ``from_dict`` of it is equal."""
        flat = {
            key: getattr(getattr(self, section), key) for key, section in _KEY_SECTION.items()
        }
        flat["etp"] = dataclasses.asdict(self.etp)
        return flat

    @staticmethod
    def keys() -> tuple[str, ...]:
        """Every flat recipe key (the ``etp`` section's keys are ETPConfig's fields)."""
        return tuple(_KEY_SECTION)

    # ------------------------------------------------------------------ world size
    def _world(self, world_size: int | None) -> int:
        world = self.parallel.world_size if world_size is None else world_size
        if world is None:
            raise RecipeError(
                "world_size", None, "world_size is not set in the recipe: pass the number of ranks"
            )
        return world

    def check_world_size(self, world_size: int) -> None:
        """Checks the sizes that depend on the number of ranks: TP x PP x CP divides it, ETP
        fits inside data parallelism (dense and expert), and the global batch is a whole
        number of microbatches over data-parallel ranks. Raises :class:`RecipeError`.

        Example::

            Recipe.from_yaml("recipes/tiny_moe_cpu.yaml").check_world_size(2)
        """
        p, e, t = self.parallel, self.etp, self.train
        if p.world_size is not None and world_size != p.world_size:
            raise RecipeError(
                "world_size",
                p.world_size,
                f"recipe key world_size={p.world_size} but {world_size!r} ranks were started: "
                f"launch {p.world_size} ranks or override world_size",
            )
        dp, _ = check_parallel_layout(
            world_size,
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
            etp_size=e.etp_size,
            expert_etp_size=e.expert_etp_size,
        )
        per_step = t.micro_batch_size * dp
        if t.global_batch_size is not None and t.global_batch_size % per_step:
            raise RecipeError(
                "global_batch_size",
                t.global_batch_size,
                f"recipe key global_batch_size={t.global_batch_size} is not divisible by "
                f"micro_batch_size x data_parallel_size = {t.micro_batch_size} x {dp} = "
                f"{per_step} (world_size {world_size})",
            )

    def data_parallel_size(self, world_size: int | None = None) -> int:
        """Megatron's DP = world / (TP x PP x CP); ETP ranks are part of it."""
        world = self._world(world_size)
        self.check_world_size(world)
        return world // self.parallel.model_parallel_size

    def expert_data_parallel_size(self, world_size: int | None = None) -> int:
        """Megatron's expert DP = world / (ETP_tp x EP x PP); expert ETP ranks are part of it."""
        world = self._world(world_size)
        self.check_world_size(world)
        return world // self.parallel.expert_model_parallel_span

    def replicate_size(self, world_size: int | None = None) -> int:
        """Dense replicas DDP reduces over: DP / etp_size."""
        return self.data_parallel_size(world_size) // self.etp.etp_size

    def expert_replicate_size(self, world_size: int | None = None) -> int:
        """Expert replicas DDP reduces over: expert DP / expert_etp_size."""
        return self.expert_data_parallel_size(world_size) // self.etp.expert_etp_size

    def global_batch_size(self, world_size: int | None = None) -> int:
        """Samples per optimizer step (``global_batch_size``, or one microbatch per DP rank)."""
        dp = self.data_parallel_size(world_size)
        if self.train.global_batch_size is not None:
            return self.train.global_batch_size
        return self.train.micro_batch_size * dp

    def num_microbatches(self, world_size: int | None = None) -> int:
        """Microbatches per rank per optimizer step (gradient accumulation steps)."""
        dp = self.data_parallel_size(world_size)
        return self.global_batch_size(world_size) // (self.train.micro_batch_size * dp)

    # ------------------------------------------------------------------ sizes
    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding: vocab_size rounded up to make_vocab_size_divisible_by x TP
        (Megatron-LM's rule)."""
        m, p = self.model, self.parallel
        multiple = m.make_vocab_size_divisible_by * p.tensor_model_parallel_size
        return -(-self.model.vocab_size // multiple) * multiple

    def num_params(self, active: bool = False) -> int:
        """Parameters of the unsharded GPT model megatron-core builds from this recipe
        (every layer MoE when num_experts is set; no shared experts). ``active=True`` counts
        ``moe_router_topk`` experts per layer instead of all of them.

        Example::

            Recipe.from_yaml("recipes/moe_h200x8.yaml").num_params() / 1e9   # ~4.70
        """
        m = self.model
        h, kv = m.hidden_size, m.kv_channels
        bias = m.add_bias_linear
        norm = 2 * h if m.normalization == "LayerNorm" else h
        gated = 2 if m.swiglu else 1
        qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * kv
        attention = h * qkv_out + m.num_attention_heads * kv * h
        if bias:
            attention += qkv_out + h

        def mlp(ffn: int) -> int:
            n = h * gated * ffn + ffn * h
            return n + (gated * ffn + h if bias else 0)

        if m.is_moe:
            experts = m.moe_router_topk if active else m.num_experts
            router = m.num_experts * h + (m.num_experts if bias else 0)
            ffn_block = router + experts * mlp(m.moe_ffn_hidden_size)
        else:
            ffn_block = mlp(m.ffn_hidden_size)
        layer = norm + attention + norm + ffn_block
        embedding = self.padded_vocab_size * h
        if m.position_embedding_type == "learned_absolute":
            embedding += m.max_position_embeddings * h
        output = self.padded_vocab_size * h if m.untie_embeddings_and_output_weights else 0
        return embedding + m.num_layers * layer + norm + output

    # ------------------------------------------------------------------ data
    def resolve_data_path(self) -> Path | None:
        """The corpus file of ``data`` (None for synthetic data). A relative path is looked up
        in the working directory, next to the recipe file, and in the directory that holds the
        ``etp`` package (so ``etp/data/tiny_corpus.txt`` works from a checkout and from an
        installed package). Raises :class:`RecipeError` naming ``data`` when none exists.
        """
        if self.train.is_synthetic:
            return None
        given = Path(self.train.data).expanduser()
        if given.is_absolute():
            candidates = [given]
        else:
            candidates = [Path.cwd() / given]
            if self.source is not None:
                candidates.append(Path(self.source).resolve().parent / given)
            candidates.append(Path(__file__).resolve().parents[2] / given)
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        raise RecipeError(
            "data",
            self.train.data,
            f"recipe key data={self.train.data!r}: no such file (looked at "
            f"{[str(c) for c in candidates]}); use 'synthetic' or a text file",
        )


# ---------------------------------------------------------------------------------- YAML
@functools.lru_cache(maxsize=None)
def _yaml_loader() -> type:
    import yaml  # local: pyyaml is only needed when reading files

    class RecipeLoader(yaml.SafeLoader):
        """SafeLoader reading ``3e-3`` as a float (YAML 1.2) and refusing duplicate keys."""

        def construct_mapping(self, node, deep=False):  # type: ignore[override]
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise RecipeError(
                        str(key), None, f"recipe key {key!r} appears twice ({key_node.start_mark})"
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    RecipeLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
            |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
            re.X,
        ),
        list("-+0123456789."),
    )
    return RecipeLoader


def load_recipe_yaml(path_or_text: str | Path, *, text: bool = False) -> Any:
    """Reads YAML with the recipe loader (``3e-3`` is a float, duplicate keys are errors).
    ``text=True`` parses ``path_or_text`` itself instead of reading a file."""
    import yaml

    source = str(path_or_text) if text else Path(path_or_text).read_text(encoding="utf-8")
    try:
        return yaml.load(source, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        raise RecipeError(
            "<yaml>", str(path_or_text), f"recipe is not valid YAML: {error}"
        ) from error


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parses command-line overrides ``key=value`` (values read as YAML) into keyword
    arguments for :meth:`Recipe.from_yaml`; ``etp.key=value`` goes to the etp section.

    Example::

        parse_overrides(["train_iters=5", "lr=3e-4", "etp.etp_size=1"])
        # {'train_iters': 5, 'lr': 0.0003, 'etp': {'etp_size': 1}}
    """
    result: dict[str, Any] = {}
    for item in items:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(str(item), None, f"override {item!r}: expected key=value")
        value = load_recipe_yaml(text, text=True) if text.strip() else None
        if key.startswith("etp."):
            result.setdefault("etp", {})[key[4:]] = value
        else:
            result[key] = value
    return result
