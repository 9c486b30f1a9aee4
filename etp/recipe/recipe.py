"""Recipe: a validated training recipe built from a flat mapping or a YAML file."""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from etp.config import REMOVED_SETTINGS, ETPConfig
from etp.recipe.architecture import check_architecture_layout
from etp.recipe.loading import load_recipe_yaml
from etp.recipe.quantities import RecipeQuantities
from etp.recipe.schema import _ETP_FIELDS, _KEY_SECTION, _SECTIONS, DataSpec, ModelSpec, ParallelSpec, TrainSpec
from etp.recipe.validation import RecipeError, _fail


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
        if key in REMOVED_SETTINGS:
            return RecipeError(name, value, f"recipe key {name!r} was removed: {REMOVED_SETTINGS[key]}")
        if key in _KEY_SECTION:
            hint = f"{key} is a top-level recipe key, not an ETP setting: move it out of etp:"
        else:
            match = _suggest(str(key), _ETP_FIELDS)
            hint = f"did you mean {match!r}?" if match else f"ETP settings are {list(_ETP_FIELDS)}"
    elif key in _ETP_FIELDS:
        hint = f"{key} is an ETP setting: put it in the etp: section"
    elif key in REMOVED_SETTINGS:
        return RecipeError(name, value, f"recipe key etp.{key} was removed: {REMOVED_SETTINGS[key]}")
    else:
        match = _suggest(str(key), list(_KEY_SECTION) + ["etp"])
        hint = (
            f"did you mean {match!r}?"
            if match
            else f"known keys are {sorted(_KEY_SECTION)} and the etp: section"
        )
    return RecipeError(name, value, f"unknown recipe key {name!r} (value {value!r}): {hint}")




#: Keys a recipe may set to ``auto``: chosen at start-up for the machine and the launcher
#: (``etp.train.auto``), each choice printed with its reason.
AUTO_KEYS = ("cuda_graph", "etp.etp_size", "etp.expert_etp_size", "etp.gather_dtype", "etp.gather_reuse",
             "micro_batch_size")


#: What ``use_megatron_fsdp`` turns on (``_hold_auto_keys``) and ``ParallelSpec`` then requires.
_MEGATRON_FSDP_NEEDS = ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather")


def _hold_micro_batch(flat: dict) -> None:
    """``micro_batch_size: auto`` splits each rank's share of ``global_batch_size`` into the largest
    micro-batches the memory audit predicts to fit; it holds 1 until resolved."""
    if flat.get("global_batch_size") is None:
        _fail("micro_batch_size", "auto", "needs global_batch_size (auto splits each rank's share of it into "
              "micro-batches): set global_batch_size=N, or micro_batch_size=N")
    for fsdp in ("use_torch_fsdp2", "use_megatron_fsdp"):
        if flat.get(fsdp) is True:
            _fail("micro_batch_size", "auto", f"cannot be sized with {fsdp}: the memory audit that sizes it "
                  f"models DDP, the distributed optimizer and ETP, not {fsdp}; set micro_batch_size=N")
    flat["micro_batch_size"] = 1


def _hold_auto_keys(flat: dict, etp_section: dict) -> tuple[list[str], list[str]]:
    """Takes the keys set to ``auto`` out of ``flat`` / ``etp_section`` (they keep their defaults
    until resolved), lets Megatron-FSDP turn on what it needs and a capture or FSDP2 turn
    ``overlap_grad_reduce`` off; returns (the auto keys, the notes of what was adjusted)."""
    auto = [key for key in AUTO_KEYS if key.startswith("etp.") and etp_section.get(key[4:]) == "auto"]
    auto += [key for key in AUTO_KEYS if not key.startswith("etp.") and flat.get(key) == "auto"]
    for key in auto:
        (etp_section if key.startswith("etp.") else flat).pop(key.removeprefix("etp."))
    if "micro_batch_size" in auto:
        _hold_micro_batch(flat)
    if flat.get("use_megatron_fsdp") is True:
        # megatron-core's MegatronFSDP forces both overlaps with optim_grads_params, and steps the
        # shards through its distributed optimizer: the recipe says what runs.
        needed = [key for key in _MEGATRON_FSDP_NEEDS if not flat.get(key)]
        if not needed:
            return auto, []
        flat.update(dict.fromkeys(needed, True))
        return auto, [f"use_megatron_fsdp: {', '.join(needed)} turned on (Megatron-FSDP's optim_grads_params "
                      "steps its shards with megatron-core's distributed optimizer and overlaps its gathers and "
                      "reduce-scatters with compute)"]
    why = ("use_torch_fsdp2: overlap_grad_reduce turned off (megatron-core DDP's; FSDP2 reduce-scatters each "
           "layer's gradients during the backward itself)" if flat.get("use_torch_fsdp2") is True else
           "cuda_graph=step: overlap_grad_reduce turned off (a captured step starts DDP's reductions after its "
           "backward)" if flat.get("cuda_graph") == "step" else None)
    if why is None or not flat.get("overlap_grad_reduce"):
        return auto, []
    flat["overlap_grad_reduce"] = False
    return auto, [why]


# ---------------------------------------------------------------------------------- recipe
@dataclass(frozen=True)
class Recipe(RecipeQuantities):
    """A validated training recipe: model, parallel sizes, training settings and ETP settings.

    Build with :meth:`from_yaml` or :meth:`from_dict`; keys are flat (Megatron-LM argument
    names) plus an ``etp:`` mapping; ``recipe["num_layers"]`` looks a flat key up.

    Example::

        recipe = Recipe.from_yaml("recipes/moe_flagship.yaml")
        recipe.check_world_size(8)
        baseline = recipe.replace(etp={"etp_size": 1, "expert_etp_size": 1})
        recipe.num_params() / 1e9, recipe.data_parallel_size(8)
    """

    model: ModelSpec
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    train: TrainSpec = None  # type: ignore[assignment]  # required; None fails validation
    etp: ETPConfig = field(default_factory=ETPConfig)
    #: the corpus, tokenizer, masks and validation (``data_path``, ``tokenizer_type``, ``eval_interval``, ...)
    data: DataSpec = field(default_factory=DataSpec)
    #: the YAML file it came from (relative data paths are also looked up next to it)
    source: Path | None = field(default=None, compare=False, repr=False)
    #: the flat mapping it was built from (before derived defaults), for :meth:`replace`
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    #: keys the recipe sets to "auto" (``AUTO_KEYS``), held at their defaults until
    #: ``etp.train.auto.resolve_auto`` picks them for the machine
    auto: tuple[str, ...] = field(default=(), compare=False, repr=False)
    #: what building the recipe adjusted, one sentence each (etp-train prints them)
    notes: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, cls in (*_SECTIONS.items(), ("etp", ETPConfig)):
            if not isinstance(getattr(self, name), cls):
                raise RecipeError(
                    name, getattr(self, name), f"Recipe.{name} must be a {cls.__name__}"
                )
        if self.parallel.fsdp_peer:
            self._check_fsdp_peer()
        self._check_capture()
        self._check_tensor_parallel()
        if self.model.is_moe:
            self._check_moe()
        else:
            self._check_dense()
        self._check_data()
        self._check_recompute()
        check_architecture_layout(self)
        if self.parallel.world_size is not None:
            self.check_world_size(self.parallel.world_size)

    def _check_fsdp_peer(self) -> None:
        """What etp-train's FSDP peers (``use_torch_fsdp2``, ``use_megatron_fsdp``) cannot hold beside
        the parallel sizes (``ParallelSpec``). Nothing a recipe reaches needs TransformerEngine:
        megatron-core needs it with Megatron-FSDP only for FP8 parameters and tensor parallelism."""
        m, t, e = self.model, self.train, self.etp
        key = self.parallel.fsdp_peer
        name = {"use_torch_fsdp2": "FSDP2", "use_megatron_fsdp": "Megatron-FSDP"}[key]
        for etp_key, value in (("etp.etp_size", e.etp_size), ("etp.expert_etp_size", e.expert_etp_size)):
            if value != 1:
                _fail(etp_key, value, f"must be 1 (or auto) with {key}: {name} shards every weight itself, "
                      f"ETP is off; set {etp_key}=1")
        if t.cuda_graph == "step":
            _fail("cuda_graph", "step", f"must be none with {key} ({name} gathers and reduce-scatters in module "
                  "hooks, which a replay does not run): set cuda_graph=none or auto")
        for checkpoint in ("save", "load"):
            if getattr(t, checkpoint) is not None:
                _fail(checkpoint, getattr(t, checkpoint), f"is not supported with {key} (etp's checkpoints do not "
                      f"describe {name}'s DTensor shards): remove {checkpoint} for a {name} run")
        if t.fp16:
            _fail("fp16", True, f"must be false with {key} (etp-train runs its FSDP peers in bf16 or fp32): "
                  "use bf16: true")
        if m.is_moe and m.moe_token_dispatcher_type not in ("local", "alltoall", "allgather"):
            _fail("moe_token_dispatcher_type", m.moe_token_dispatcher_type, "must be local, alltoall or allgather "
                  f"with {key} (expert parallelism is off): set moe_token_dispatcher_type=local")

    def _check_capture(self) -> None:
        """What ``cuda_graph: step`` cannot hold."""
        m, p, t = self.model, self.parallel, self.train
        if t.cuda_graph != "step":
            return
        if p.overlap_grad_reduce:
            _fail("overlap_grad_reduce", True, "must be false with cuda_graph=step (DDP's bucket "
                  "hooks run only at capture; the reductions start after the replayed backward)")
        if t.recompute_granularity is not None:
            _fail("recompute_granularity", t.recompute_granularity,
                  "must be unset with cuda_graph=step (not captured yet)")
        if p.tensor_model_parallel_size != 1:
            _fail("tensor_model_parallel_size", p.tensor_model_parallel_size,
                  "must be 1 with cuda_graph=step (capture-safe embedding)")
        if m.is_moe and m.moe_token_dispatcher_type not in ("local", "etp"):
            _fail("moe_token_dispatcher_type", m.moe_token_dispatcher_type,
                  "must be local or etp with cuda_graph=step (megatron's dispatchers synchronize with the host)")
        if m.is_moe and m.moe_token_dispatcher_type == "etp" and not m.moe_grouped_gemm:
            _fail("moe_grouped_gemm", False, "must be true with cuda_graph=step and moe_token_dispatcher_type=etp "
                  "(megatron's per-expert MLPs size their GEMMs by token counts read on the host)")
        if p.overlap_param_gather:
            _fail("overlap_param_gather", True, "must be false with cuda_graph=step (its all-gathers are "
                  "waited for in forward hooks, which a replay does not run)")
        if m.is_moe and not t.bf16:
            _fail("bf16", False, "must be true with cuda_graph=step in an MoE recipe (fp32 experts run one "
                  "GEMM per expert, sized by token counts read on the host)")
        if m.is_moe and (m.hidden_size % 8 or m.moe_ffn_hidden_size % 8):
            _fail("moe_ffn_hidden_size", m.moe_ffn_hidden_size, "and hidden_size must be multiples of 8 with "
                  "cuda_graph=step (other widths run one GEMM per expert, sized on the host)")

    def _check_tensor_parallel(self) -> None:
        m, p = self.model, self.parallel
        tp = p.tensor_model_parallel_size
        for key, value, why in (
            ("num_attention_heads", m.num_attention_heads, f"must be divisible by tensor_model_parallel_size={tp}"),
            ("ffn_hidden_size", m.ffn_hidden_size, f"must be divisible by tensor_model_parallel_size={tp}"),
        ):
            if value % tp:
                _fail(key, value, why)
        if m.num_query_groups % tp and tp % m.num_query_groups:
            _fail("num_query_groups", m.num_query_groups,
                  f"must be a multiple or a divisor of tensor_model_parallel_size={tp}")
        if m.num_layers % p.pipeline_model_parallel_size:
            _fail("num_layers", m.num_layers,
                  f"must be divisible by pipeline_model_parallel_size={p.pipeline_model_parallel_size}")
        cp = p.context_parallel_size
        if cp > 1 and m.seq_length % (2 * cp):
            _fail("seq_length", m.seq_length, f"must be divisible by 2 x context_parallel_size = {2 * cp}")
        if p.sequence_parallel and m.seq_length % tp:
            _fail("seq_length", m.seq_length,
                  f"must be divisible by tensor_model_parallel_size={tp} with sequence_parallel")

    def _check_moe(self) -> None:
        m, p = self.model, self.parallel
        tp, ep, etp_tp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_tensor_parallel_size
        if m.num_experts % ep:
            _fail("num_experts", m.num_experts, f"must be divisible by expert_model_parallel_size={ep}")
        if m.moe_ffn_hidden_size % etp_tp:
            _fail("moe_ffn_hidden_size", m.moe_ffn_hidden_size,
                  f"must be divisible by expert_tensor_parallel_size={etp_tp}")
        if m.moe_token_dispatcher_type == "local":
            for name, value in (("expert_model_parallel_size", ep), ("tensor_model_parallel_size", tp),
                                ("expert_tensor_parallel_size", etp_tp)):
                if value != 1:
                    _fail(name, value, "must be 1 with moe_token_dispatcher_type=local (every expert "
                          "on its rank); use alltoall for expert or tensor parallelism")
            if not m.moe_grouped_gemm:
                _fail("moe_grouped_gemm", False, "must be true with moe_token_dispatcher_type=local "
                      "(etp's grouped experts take the device token counts)")
        if m.moe_token_dispatcher_type == "etp":
            for name, value in (("tensor_model_parallel_size", tp), ("expert_tensor_parallel_size", etp_tp)):
                if value != 1:
                    _fail(name, value, "must be 1 with moe_token_dispatcher_type=etp (etp.ep's dispatcher "
                          "moves whole tokens over the expert-parallel group); use alltoall for tensor parallelism")
        if ep > 1 and tp > 1 and not p.sequence_parallel:
            _fail("sequence_parallel", False, f"must be true with expert_model_parallel_size={ep} and "
                  f"tensor_model_parallel_size={tp} (Megatron-LM's rule)")

    def _check_dense(self) -> None:
        if self.parallel.expert_model_parallel_size > 1:
            _fail("expert_model_parallel_size", self.parallel.expert_model_parallel_size,
                  "needs num_experts (the model is dense)")
        if self.etp.expert_etp_size > 1:
            _fail("etp.expert_etp_size", self.etp.expert_etp_size, "needs num_experts (the model is dense)")

    def _check_data(self) -> None:
        m, t, e = self.model, self.train, self.etp
        if self.parallel.overlap_param_gather and (e.etp_size > 1 or e.expert_etp_size > 1):
            _fail("overlap_param_gather", True, "is for models without ETP weights (etp.etp_size and "
                  "etp.expert_etp_size 1): ETP would prefetch shards whose parameter all-gather is in flight")
        refused = e.gather_format.unsupported(t.params_dtype)
        if refused:
            _fail("etp.gather_dtype", e.gather_dtype, refused)
        if not t.is_synthetic and self.data.has_dataset:
            _fail("data", t.data, "is etp's own corpus key (synthetic ids or a text file's bytes); with data_path / "
                  "mock_data remove it (or set data=synthetic)")
        if not t.is_synthetic and m.vocab_size < 256:
            _fail("vocab_size", m.vocab_size, f"must be >= 256 with data={t.data!r}: a text corpus is read as bytes")
        if self.data.reset_attention_mask and m.attention_backend == "local":
            _fail("attention_backend", "local", "must be sdpa with reset_attention_mask (megatron-core's local "
                  "attention takes its fused causal softmax where it can, which ignores a per-document mask)")
        if self.data.tokenizer_type == "NullTokenizer" and m.vocab_size < 2:
            _fail("vocab_size", m.vocab_size, "must be >= 2 with tokenizer_type=NullTokenizer (ids below "
                  "vocab_size - 1, and vocab_size - 1 ends a document)")

    def _check_recompute(self) -> None:
        """Recompute settings against the model (TrainSpec checked the combinations alone)."""
        m, p, t = self.model, self.parallel, self.train
        if t.recompute_granularity == "full":
            pp = p.pipeline_model_parallel_size
            per_stage = m.num_layers // pp
            if t.recompute_num_layers > per_stage:
                unit = (
                    "the recomputed layers of each stage"
                    if t.recompute_method == "block"
                    else "the layers of each recompute unit"
                )
                _fail(
                    "recompute_num_layers",
                    t.recompute_num_layers,
                    f"with recompute_method={t.recompute_method!r} counts {unit}, so it must be "
                    f"<= the layers per pipeline stage, num_layers / pipeline_model_parallel_size "
                    f"= {m.num_layers} / {pp} = {per_stage}: use 1..{per_stage}",
                )

    def recompute_kwargs(self) -> dict[str, Any]:
        """The activation-recompute arguments of megatron-core's ``TransformerConfig``, as the
        recipe sets them (all None by default: no recompute; ``recompute_modules`` None lets
        megatron-core fill in its default ``["core_attn"]``, used only with selective).

        Example::

            TransformerConfig(num_layers=2, ..., **recipe.recompute_kwargs())
        """
        t = self.train
        modules = t.recompute_modules
        return {
            "recompute_granularity": t.recompute_granularity,
            "recompute_method": t.recompute_method,
            "recompute_num_layers": t.recompute_num_layers,
            "recompute_modules": None if modules is None else list(modules),
        }

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

        raw = {**flat, "etp": dict(etp_section)}
        auto, notes = _hold_auto_keys(flat, etp_section)
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
        return cls(
            **built,
            etp=etp_config,
            source=Path(source) if source is not None else None,
            raw=raw,
            auto=tuple(sorted(auto)),
            notes=tuple(notes),
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
            import etp  # the directory above the package: etp/data/... names the bundled corpus

            candidates.append(Path(etp.__file__).resolve().parent.parent / given)
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        raise RecipeError(
            "data",
            self.train.data,
            f"recipe key data={self.train.data!r}: no such file (looked at "
            f"{[str(c) for c in candidates]}); use 'synthetic' or a text file",
        )
