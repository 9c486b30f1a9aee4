"""Every data input error of a recipe, found before any rank starts (etp-train's preflight):
one line naming the recipe key, the file and the fix.

* a prefix whose ``.bin`` or ``.idx`` is missing, or whose index does not describe its data
  (header, sequence pointers, document boundaries, the ``.bin``'s size);
* token ids at or above ``vocab_size``: the tokenizer's vocabulary against the recipe's, and the
  ids themselves where the ``.bin`` is small enough to scan (``SCAN_TOKENS``);
* a split with a share but no tokens (``split`` cuts too few documents), which megatron-core
  would try to fill forever;
* a tokenizer path that holds no tokenizer, or a tokenizer without the end-of-document token
  the per-document masks need.
"""
from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["SCAN_TOKENS", "check_data", "check_indexed_dataset", "resolve_prefix", "resolve_recipe_path"]

#: ``.bin`` files of at most this many tokens are scanned for ids >= vocab_size (a few hundred
#: milliseconds); larger ones are checked through their tokenizer's vocabulary only
SCAN_TOKENS = 1 << 28
_HEADER = b"MMIDIDX\x00\x00"
_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron-core's DType codes


def _candidates(recipe, value: str) -> list[Path]:
    given = Path(value).expanduser()
    if given.is_absolute():
        return [given]
    found = [Path.cwd() / given]
    if recipe.source is not None:
        found.append(Path(recipe.source).resolve().parent / given)
    import etp  # the directory above the package: etp/data/... names the bundled files

    found.append(Path(etp.__file__).resolve().parent.parent / given)
    return found


def resolve_recipe_path(recipe, key: str, value: str) -> Path:
    """A file or directory a recipe names: as given, else relative to the working directory, the
    recipe's directory and the directory holding the ``etp`` package; ValueError when none exists."""
    candidates = _candidates(recipe, value)
    for candidate in candidates:
        if candidate.exists():
            return candidate.resolve()
    raise ValueError(f"recipe key {key}={value!r}: no such file or directory (looked at "
                     f"{[str(c) for c in candidates]})")


def resolve_prefix(recipe, key: str, prefix: str) -> str:
    """The absolute prefix of an indexed dataset a recipe names (found like ``resolve_recipe_path``,
    by its ``.bin`` or ``.idx``); ValueError naming what is missing.

    Example::

        resolve_prefix(recipe, "data_path", "etp/data/tiny_corpus_text_document")
    """
    candidates = _candidates(recipe, prefix)
    for candidate in candidates:
        bin_path, idx_path = Path(f"{candidate}.bin"), Path(f"{candidate}.idx")
        if bin_path.is_file() or idx_path.is_file():
            missing = [p.name for p in (bin_path, idx_path) if not p.is_file()]
            if missing:
                raise ValueError(f"recipe key {key}: dataset {candidate} has no {missing[0]}: an indexed dataset is "
                                 "a .bin and an .idx of one prefix (etp-preprocess writes both)")
            return str(candidate.resolve())
    raise ValueError(f"recipe key {key}: no such file: no indexed dataset {prefix!r} ({prefix}.bin / .idx not found "
                     f"at {[str(c) for c in candidates]}): give the prefix etp-preprocess wrote")


def check_indexed_dataset(key: str, prefix: str, vocab_size: int | None = None):
    """Checks that ``prefix.idx`` describes ``prefix.bin`` (and, when ``vocab_size`` is given and the
    data is small enough, that every id is below it); returns the sequence lengths (int32, memory-
    mapped) and the document boundaries. ValueError (one line) otherwise.

    Example::

        lengths, documents = check_indexed_dataset("data_path", "corpus/wiki_text_document", 32000)
    """
    import numpy

    idx, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    where = f"recipe key {key}: {idx}"
    with open(idx, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != _HEADER or struct.unpack("<Q", head[9:17])[0] != 1:
        raise ValueError(f"{where} is not a megatron-core index (version 1 header): rewrite it with etp-preprocess")
    code = head[17]
    if code not in _ITEMSIZE:
        raise ValueError(f"{where}: unknown token dtype code {code}: rewrite it with etp-preprocess")
    itemsize = _ITEMSIZE[code]
    sequences, documents = struct.unpack("<QQ", head[18:34])
    needed = 34 + sequences * 12 + documents * 8
    if idx.stat().st_size < needed or documents < 1:
        raise ValueError(f"{where} is truncated ({idx.stat().st_size} bytes; its header promises {needed}): "
                         "rewrite it with etp-preprocess")
    raw = numpy.memmap(idx, mode="r", dtype=numpy.uint8)
    lengths = numpy.frombuffer(raw, dtype=numpy.int32, count=sequences, offset=34)
    pointers = numpy.frombuffer(raw, dtype=numpy.int64, count=sequences, offset=34 + 4 * sequences)
    bounds = numpy.frombuffer(raw, dtype=numpy.int64, count=documents, offset=34 + 12 * sequences)
    total = int(lengths.sum(dtype=numpy.int64))
    expected = numpy.concatenate(([0], numpy.cumsum(lengths[:-1], dtype=numpy.int64) * itemsize)) if sequences else []
    if (lengths < 0).any() or not numpy.array_equal(pointers, expected):
        raise ValueError(f"{where}: its sequence pointers do not follow its sequence lengths: the index is damaged; "
                         "rewrite it with etp-preprocess")
    if bounds[0] != 0 or bounds[-1] != sequences or (numpy.diff(bounds) < 0).any():
        raise ValueError(f"{where}: its document boundaries do not cover its {sequences} sequences: the index is "
                         "damaged; rewrite it with etp-preprocess")
    if data.stat().st_size != total * itemsize:
        raise ValueError(f"recipe key {key}: {idx} describes {total} tokens of {itemsize} bytes ({total * itemsize} "
                         f"bytes) but {data} holds {data.stat().st_size}: the .bin and .idx are not one dataset; "
                         "rewrite both with etp-preprocess")
    if vocab_size is not None and total and total <= SCAN_TOKENS:
        dtype = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64, 8: numpy.uint16}.get(code)
        if dtype is not None and numpy.iinfo(dtype).max >= vocab_size:
            tokens = numpy.memmap(data, mode="r", dtype=dtype)
            top = max(int(tokens[i:i + (1 << 24)].max()) for i in range(0, total, 1 << 24))
            low = min(int(tokens[i:i + (1 << 24)].min()) for i in range(0, total, 1 << 24))
            if top >= vocab_size or low < 0:
                bad = top if top >= vocab_size else low
                raise ValueError(f"recipe key {key}: {data} holds token id {bad}, outside 0 .. vocab_size - 1 = "
                                 f"{vocab_size - 1}: set vocab_size above it (or retokenize with the recipe's tokenizer)")
    return lengths, bounds


def _split_ranges(shares, sequences: int) -> list[tuple[int, int] | None]:
    """megatron-core's split of ``sequences`` sequences (``convert_split_vector_to_split_matrix``,
    then ``round(bookend * n)``): the range of each split, None for a share of 0."""
    ranges, start = [], 0.0
    for share in shares:
        end = start + share
        ranges.append(None if share <= 0 else (int(round(start * sequences)), int(round(end * sequences))))
        start = end
    return ranges


def _check_blend_splits(recipe, key: str, prefixes, lengths_of: dict, shares, wanted: tuple[bool, bool, bool]):
    """A split with a share (and wanted: train always, valid / test when evaluated) but no tokens."""
    names = ("train", "valid", "test")
    for prefix in prefixes:
        lengths = lengths_of[prefix]
        for name, needed, span in zip(names, wanted, _split_ranges(shares, len(lengths))):
            if span is None or not needed:
                continue
            if int(lengths[span[0]:span[1]].sum()) == 0:
                raise ValueError(f"recipe key split={recipe.data.split!r}: the {name} split of {prefix} is empty "
                                 f"({span[1] - span[0]} of its {len(lengths)} documents, no tokens): give the "
                                 f"{name} split a larger share (e.g. split=90,10,0)"
                                 + (", or set eval_iters=0" if name != "train" else ""))


def check_data(recipe) -> list[str]:
    """Checks a recipe's data (files, tokenizer, splits; see the module docstring); returns notes
    to print. Does nothing for ``data`` (synthetic ids, a text file: ``Recipe.resolve_data_path``).

    Example::

        for note in check_data(recipe):
            print(f"etp-train: {note}")
    """
    import warnings

    d = recipe.data
    if not d.has_dataset:
        return []
    with warnings.catch_warnings():  # megatron-core's import-time notes; etp-train prints its own once
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        return _check_dataset(recipe)


def _check_dataset(recipe) -> list[str]:
    from etp.data.tokenizer import build_tokenizer, check_tokenizer_fits

    d, vocab = recipe.data, recipe.model.vocab_size
    model = None if d.tokenizer_model is None else resolve_recipe_path(recipe, "tokenizer_model", d.tokenizer_model)
    notes = [] if d.mock_data else _check_files(recipe)  # the files first: loading a tokenizer takes seconds
    tokenizer = build_tokenizer(d.tokenizer_type, model, vocab)
    check_tokenizer_fits(tokenizer, vocab, needs_eod=d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss)
    return notes


def _check_files(recipe) -> list[str]:
    d, vocab, notes = recipe.data, recipe.model.vocab_size, []
    evaluated = d.eval_iters > 0
    if d.data_path is not None:
        prefixes = [resolve_prefix(recipe, "data_path", p) for p in d.blend[0]]
        lengths_of = {p: check_indexed_dataset("data_path", p, vocab)[0] for p in prefixes}
        _check_blend_splits(recipe, "data_path", prefixes, lengths_of, d.split_shares, (True, evaluated, evaluated))
        if evaluated and d.split_shares[1] == 0:
            notes.append(f"split={d.split!r} leaves no valid split: no validation")
        return notes
    for split in ("train", "valid", "test"):
        blend = d.split_blend(split)
        if blend is None:
            if split == "valid" and evaluated:
                notes.append("no valid_data_path: no validation")
            continue
        key = f"{split}_data_path"
        for prefix in (resolve_prefix(recipe, key, p) for p in blend[0]):
            lengths, _ = check_indexed_dataset(key, prefix, vocab)
            if int(lengths.sum()) == 0:
                raise ValueError(f"recipe key {key}: {prefix} holds no tokens: give the {split} split a dataset "
                                 "with documents")
    return notes
