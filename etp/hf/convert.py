"""etp-convert's library: ``import_hf`` (a Hugging Face checkpoint into an etp checkpoint),
``export_hf`` (an etp checkpoint into a Hugging Face checkpoint) and ``recipe_from_hf``.
See [Note: Hugging Face checkpoints] in ``etp/hf/__init__.py``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import torch

from etp.hf.adapter import ConversionError, HFConfig, MoEAdapter, Piece, check_recipe
from etp.hf.architectures import adapter_for
from etp.hf.safetensors_io import INDEX_NAME, SafetensorsDir, TensorSpec, write_safetensors

__all__ = ["export_hf", "import_hf", "read_config", "recipe_from_hf"]

#: what marks an etp checkpoint etp-convert wrote: weights only, no optimizer state
WEIGHTS_KIND = "weights"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_config(directory: str | os.PathLike) -> HFConfig:
    """``config.json`` of a Hugging Face checkpoint directory; code it points to (``auto_map``,
    ``trust_remote_code``) and quantized checkpoints are refused, one line each.

    Example::

        read_config("Qwen3-30B-A3B").model_type   # 'qwen3_moe'
    """
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{directory} has no config.json: point --hf at a Hugging Face checkpoint directory")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path} is not JSON ({error}): download it again") from None
    if not isinstance(values, dict):
        raise ConversionError(f"{path} is not a JSON object: download it again")
    for key in ("auto_map", "trust_remote_code"):
        if key in values:
            raise ConversionError(f"{path} sets {key}: the model's code ships with the checkpoint, and etp-convert "
                                  "never runs a checkpoint's code; convert a checkpoint transformers builds itself")
    if values.get("quantization_config"):
        raise ConversionError(f"{path} has a quantization_config: etp-convert reads unquantized weights; convert "
                              "the bf16 checkpoint")
    return HFConfig(values, str(path))


class Progress:
    """One line of tensors and bytes done, rewritten in place on a terminal, else printed at
    every tenth of the bytes."""

    def __init__(self, what: str, tensors: int, nbytes: int, quiet: bool = False) -> None:
        self.what, self.tensors, self.nbytes, self.quiet = what, tensors, max(nbytes, 1), quiet
        self.done_tensors = self.done_bytes = 0
        self.began = self.shown = time.monotonic()
        self.tenth = 0
        self.tty = sys.stderr.isatty()

    def add(self, tensors: int, nbytes: int) -> None:
        self.done_tensors += tensors
        self.done_bytes += nbytes
        now, tenth = time.monotonic(), 10 * self.done_bytes // self.nbytes
        if self.quiet:
            return
        if (self.tty and now - self.shown > 0.5) or (not self.tty and tenth > self.tenth):
            self._show("\r" if self.tty else "")
            self.shown, self.tenth = now, tenth

    def finish(self) -> float:
        seconds = time.monotonic() - self.began
        if not self.quiet:
            self._show("\r" if self.tty else "", end="\n", seconds=seconds)
        return seconds

    def _show(self, lead: str, end: str = "", seconds: float | None = None) -> None:
        unit, size = ("GiB", 2**30) if self.nbytes >= 2**30 else ("MiB", 2**20)
        tail = f" in {seconds:.1f} s" if seconds is not None else ""
        line = (f"{lead}etp-convert: {self.what} {self.done_tensors}/{self.tensors} tensors, "
                f"{self.done_bytes / size:.2f}/{self.nbytes / size:.2f} {unit}{tail}")
        print(line, end=end if self.tty else "\n", file=sys.stderr, flush=True)


def _hf_shapes(pieces: list[Piece], tensors: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every Hugging Face tensor the pieces read, each read exactly once;
    every megatron-core tensor filled exactly once (an adapter that does otherwise is a bug)."""
    rows: dict[str, list[tuple[int, int]]] = {}
    trailing: dict[str, tuple[int, ...]] = {}
    spans: dict[str, list[tuple[int, int]]] = {name: [] for name in tensors}
    for piece in pieces:
        if piece.megatron not in tensors:
            raise ConversionError(f"etp's model has no {piece.megatron} (the adapter's piece for {piece.hf}): "
                                  "report this")
        shape = tensors[piece.megatron].shape
        spans[piece.megatron].append(piece.megatron_span(shape))
        if piece.hf is not None:
            rows.setdefault(piece.hf, []).append(piece.hf_rows)
            trailing.setdefault(piece.hf, piece.row_shape(shape))
    for name, found in spans.items():
        if _tiles(found) != math.prod(tensors[name].shape):
            raise ConversionError(f"the adapter does not fill {name} exactly once: report this")
    shapes = {}
    for name, found in rows.items():
        count = _tiles(found)
        if count is None:
            raise ConversionError(f"the adapter reads {name} in overlapping pieces: report this")
        shapes[name] = (count, *trailing[name])
    return shapes


def _tiles(spans: list[tuple[int, int]]) -> int | None:
    """The end of ``spans`` if they tile ``[0, end)`` without gap or overlap, else None."""
    cursor = 0
    for start, stop in sorted(spans):
        if start != cursor:
            return None
        cursor = stop
    return cursor


def _check_hf_tensors(weights: SafetensorsDir, shapes: dict, tied: bool, where: str) -> None:
    found = set(weights.specs) - ({"lm_head.weight"} if tied else set())  # tied checkpoints may keep a copy
    missing, extra = sorted(set(shapes) - found), sorted(found - set(shapes))

    def listed(names):
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    if missing:
        raise ConversionError(f"{where} lacks {len(missing)} tensor(s) of the recipe's model: {listed(missing)} "
                              "(another architecture's checkpoint, or an incomplete download?)")
    if extra:
        raise ConversionError(f"{where} has {len(extra)} tensor(s) the recipe's model does not: {listed(extra)} "
                              "(another architecture's checkpoint, or a recipe with fewer layers or experts?)")
    for name, shape in shapes.items():
        if weights.specs[name].shape != shape:
            raise ConversionError(f"{where}: {name} is {list(weights.specs[name].shape)}, the recipe's model needs "
                                  f"{list(shape)}: the recipe and the checkpoint are different models")


def _megatron_dtypes(pieces: list[Piece], weights: SafetensorsDir) -> dict[str, torch.dtype]:
    """Each megatron-core tensor's dtype: its Hugging Face tensors', which must agree."""
    dtypes: dict[str, torch.dtype] = {}
    for piece in pieces:
        if piece.hf is None:
            continue
        dtype = weights.specs[piece.hf].dtype
        if dtypes.setdefault(piece.megatron, dtype) != dtype:
            raise ConversionError(f"{piece.hf} is {dtype} and the other tensors of {piece.megatron} are "
                                  f"{dtypes[piece.megatron]}: convert the checkpoint to one dtype first")
    return dtypes


def _fresh_output(path: Path, flag: str) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConversionError(f"{flag} {path} exists and is not empty: etp-convert never overwrites; choose a new "
                              "directory")


def _load_recipe(recipe, overrides: dict | None):
    from etp.recipe import Recipe

    return recipe if isinstance(recipe, Recipe) else Recipe.from_yaml(Path(recipe), **(overrides or {}))


def import_hf(hf: str | os.PathLike, recipe, out: str | os.PathLike, model_builder, overrides: dict | None = None,
              quiet: bool = False) -> Path:
    """Converts the Hugging Face checkpoint ``hf`` (``config.json`` and (sharded) safetensors)
    into a weights-only etp checkpoint in ``out`` (iteration 0; etp-train loads it with
    ``load: OUT`` and ``finetune: true`` at any layout). ``recipe`` (a path, with ``overrides``,
    or a ``Recipe``) must be the checkpoint's architecture: every disagreeing key is named.
    ``model_builder(recipe)`` is etp-train's model of a recipe
    (``etp.train.convert_command.etp_model``), built on the meta device for the checkpoint's
    layout. Tensors are read one box at a time. Returns the checkpoint directory.

    Raises:
        ConversionError: anything about the inputs, before anything is written.

    Example::

        import_hf("Qwen3-30B-A3B", "recipes/qwen3_30b_a3b.yaml", "ckpt", etp_model, {"num_layers": 48})
    """
    from etp.hf.megatron_io import model_tensors, single_process, write_weights

    hf, out = Path(hf), Path(out)
    cfg = read_config(hf)
    adapter = adapter_for(cfg.model_type, cfg.where)
    recipe = _load_recipe(recipe, overrides)
    check_recipe(adapter.recipe_model_keys(cfg), recipe.model, str(recipe.source or "the recipe"), cfg.where)
    _fresh_output(out, "--out")
    weights = SafetensorsDir(hf)
    with single_process():
        tensors, objects = model_tensors(recipe, model_builder)
        pieces = adapter.pieces(recipe.model, recipe.padded_vocab_size)
        shapes = _hf_shapes(pieces, tensors)
        _check_hf_tensors(weights, shapes, not recipe.model.untie_embeddings_and_output_weights, str(hf))
        dtypes = _megatron_dtypes(pieces, weights)
        left = {name: math.prod(shape) for name, shape in shapes.items()}
        progress = Progress("import-hf", len(shapes), sum(weights.specs[n].nbytes for n in shapes), quiet)

        def source(piece: Piece, start: int, count: int, shape: tuple) -> torch.Tensor:
            if piece.hf is None:  # vocabulary padding
                return torch.zeros(shape, dtype=dtypes[piece.megatron])
            data = weights.read(piece.hf, piece.hf_rows).reshape(-1)[start:start + count].view(shape)
            left[piece.hf] -= count
            progress.add(int(left[piece.hf] == 0), count * data.element_size())
            return data

        generation = hf / "generation_config.json"
        metadata = {"kind": WEIGHTS_KIND, "source": "etp-convert import-hf", "hf_dir": str(hf.resolve()),
                    "recipe": str(recipe.source), "hf_config": cfg.values,
                    "hf_generation_config": json.loads(generation.read_text()) if generation.is_file() else None}
        path = write_weights(out, tensors, objects, pieces, dtypes, source, metadata)
    progress.finish()
    return path


def _export_plan(adapter: MoEAdapter, recipe, tensors: dict, stored: dict) -> tuple[list[TensorSpec], dict]:
    """(every Hugging Face tensor's spec in file order, name -> its pieces)."""
    pieces = adapter.pieces(recipe.model, recipe.padded_vocab_size)
    shapes = _hf_shapes(pieces, tensors)
    by_name: dict[str, list[Piece]] = {}
    for piece in pieces:
        if piece.hf is not None:
            by_name.setdefault(piece.hf, []).append(piece)
    specs = []
    for name, found in by_name.items():
        entry = tensors[found[0].megatron].entry
        specs.append(TensorSpec(name, stored[entry.key + tensors[found[0].megatron].pieces.segments[0].suffix][1],
                                shapes[name]))
    return specs, by_name


def _shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _export_tensors(directory: Path, tensors: dict, shard: list[TensorSpec], by_name: dict, batch_bytes: int,
                    progress: Progress):
    """The shard's tensors in order, read from the checkpoint in batches of about ``batch_bytes``."""
    from etp.hf.megatron_io import read_boxes

    i = 0
    while i < len(shard):
        batch, size = [], 0
        while i < len(shard) and (not batch or size + shard[i].nbytes <= batch_bytes):
            batch.append(shard[i])
            size += shard[i].nbytes
            i += 1
        buffers = [torch.empty(spec.shape, dtype=spec.dtype) for spec in batch]
        read_boxes(directory, tensors, [(piece, buffer[piece.hf_rows[0]:piece.hf_rows[1]])
                                        for spec, buffer in zip(batch, buffers) for piece in by_name[spec.name]])
        for spec in batch:
            progress.add(1, spec.nbytes)
            yield buffers.pop(0)


def _checkpoint_metadata(root: Path, iteration: int | None) -> tuple[int, dict]:
    from etp.megatron.checkpoint import find_latest, iteration_dir, list_checkpoints, verify_checkpoint

    if iteration is None:
        iteration = find_latest(root)
        if iteration is None:
            raise ConversionError(f"{root} holds no etp checkpoint (no 'latest' marker; published: "
                                  f"{list_checkpoints(root) or 'none'}): point --checkpoint at a save directory")
    return iteration, verify_checkpoint(iteration_dir(root, iteration), verify_hashes=False)["metadata"]


def export_hf(checkpoint: str | os.PathLike, recipe, out: str | os.PathLike, model_builder,
              overrides: dict | None = None,
              model_type: str | None = None, iteration: int | None = None, max_shard_bytes: int = 5 * 10**9,
              batch_bytes: int = 2**30, quiet: bool = False) -> Path:
    """Writes the etp checkpoint ``checkpoint`` (a save directory, its ``latest`` or
    ``iteration``; saved at any layout) as a Hugging Face checkpoint in ``out``: safetensors
    shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``, ``config.json``
    and ``generation_config.json`` that transformers' ``from_pretrained`` loads. ``recipe`` is
    the one the checkpoint was trained with (``model_builder`` as ``import_hf``'s); ``model_type``
    names the architecture when the
    checkpoint does not carry it (one etp-convert imported, and etp-train runs fine-tuned from
    it, do). Memory holds one batch of about ``batch_bytes`` (at least one tensor). Returns ``out``.

    Example::

        export_hf("ckpt", "recipes/qwen3_30b_a3b.yaml", "Qwen3-finetuned", etp_model, {"num_layers": 48})
    """
    from etp.hf.megatron_io import check_layout, checkpoint_tensors, model_tensors, single_process
    from etp.megatron.checkpoint import load_checkpoint

    root, out = Path(checkpoint), Path(out)
    recipe = _load_recipe(recipe, overrides)
    iteration, metadata = _checkpoint_metadata(root, iteration)
    base = metadata.get("hf_config")
    chosen = model_type or (base or {}).get("model_type")
    if chosen is None:
        raise ConversionError(f"{root} does not say which Hugging Face architecture it is: name it with --model-type "
                              "(qwen3_moe, olmoe or mixtral)")
    adapter = adapter_for(chosen, "--model-type" if model_type else f"{root}'s metadata")
    _fresh_output(out, "--out")
    staging = out.with_name(f".{out.name}.partial_{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        with single_process():
            tensors, _ = model_tensors(recipe, model_builder)

            def write(directory: Path) -> tuple[str, Progress]:
                stored = checkpoint_tensors(directory)
                check_layout(tensors, stored, str(root), str(recipe.source or "the recipe"))
                specs, by_name = _export_plan(adapter, recipe, tensors, stored)
                progress = Progress("export-hf", len(specs), sum(s.nbytes for s in specs), quiet)
                shards = _shards(specs, max_shard_bytes)
                files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
                for name, shard in zip(files, shards):
                    write_safetensors(staging / name, shard,
                                      _export_tensors(directory, tensors, shard, by_name, batch_bytes, progress))
                index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                         "weight_map": {s.name: f for f, shard in zip(files, shards) for s in shard}}
                (staging / INDEX_NAME).write_text(json.dumps(index, indent=2))
                dtype = _DTYPE_NAMES.get(specs[0].dtype, "float32")
                return dtype, progress

            dtype, progress = load_checkpoint(root, write, iteration).result
        config = adapter.config_json(recipe.model, base, dtype)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        generation = metadata.get("hf_generation_config") or {
            "_from_model_config": True, **{k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True))
        if out.exists():  # empty (checked above)
            _move_into(staging, out)
        else:
            os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress.finish()
    return out


def _move_into(staging: Path, out: Path) -> None:
    """``out`` exists, empty (checked before): the staged files go in, the staging directory goes."""
    for item in staging.iterdir():
        os.rename(item, out / item.name)
    staging.rmdir()


_TRAINING_DEFAULTS = """
# --- parallelism: data parallelism, ETP over the ranks (auto: chosen at start-up, each printed) ---
tensor_model_parallel_size: 1
expert_model_parallel_size: 1

# --- training: fine-tuning defaults; set them for your run ---------------------------------
micro_batch_size: auto          # the largest the memory audit says fits
global_batch_size: 16
train_iters: 100
lr: 1.0e-5
min_lr: 1.0e-6
lr_warmup_iters: 10
lr_decay_style: cosine
weight_decay: 0.1
adam_beta1: 0.9
adam_beta2: 0.95
clip_grad: 1.0
bf16: true
cuda_graph: auto

etp:
  etp_size: auto
  expert_etp_size: auto
  gather_dtype: auto
  gather_reuse: auto
"""


def recipe_from_hf(hf: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Writes ``out``, a recipe whose model keys are the Hugging Face checkpoint ``hf``'s
    architecture (from its ``config.json``) and whose parallel and training keys are ``auto``
    or fine-tuning defaults. Refuses to overwrite ``out``. Returns its path.

    Example::

        recipe_from_hf("Qwen3-30B-A3B", "qwen3.yaml")
    """
    import yaml

    from etp.recipe import Recipe

    cfg = read_config(hf)
    adapter = adapter_for(cfg.model_type, cfg.where)
    keys = adapter.recipe_model_keys(cfg)
    out = Path(out)
    if out.exists():
        raise ConversionError(f"--out {out} exists: etp-convert never overwrites; choose a new file")
    lines = [f"# {adapter.architecture} from {Path(hf).resolve() / 'config.json'}, written by etp-convert "
             "recipe-from-hf.", f"#   etp-convert import-hf --hf {hf} --recipe {out} --out CKPT", "",
             "# --- model: the checkpoint's architecture ------------------------------------------"]
    for key, value in keys.items():
        lines.append(yaml.safe_dump({key: value}, default_flow_style=True, width=10**6).strip()[1:-1])
    text = "\n".join(lines) + "\n" + _TRAINING_DEFAULTS
    out.write_text(text)
    try:
        Recipe.from_yaml(out)
    except ValueError:
        out.unlink()
        raise
    return out
