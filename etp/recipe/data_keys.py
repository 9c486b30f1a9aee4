"""The data keys of a recipe (Megatron-LM's names and meanings): which corpus, how it is split
and blended, which tokenizer, the per-document masks and validation. Plain Python: what the
files on disk hold is checked by ``etp.data.checks`` before any rank starts.

[Note: blends]
``data_path`` is Megatron-LM's ``--data-path``: one prefix (``corpus/wiki_text_document``, the
``.bin`` / ``.idx`` pair without its suffix), several prefixes (blended by their sizes), or
weight / prefix pairs (``[0.3, corpus/wiki, 0.7, corpus/code]``, or the command line's string
``"0.3 corpus/wiki 0.7 corpus/code"``), blended by the weights. Either every other entry is a
number (weights) or none is (prefixes only): a mix is refused, as Megatron-LM refuses it.
``train_data_path`` / ``valid_data_path`` / ``test_data_path`` give each split its own blend
(no ``split`` then); ``split`` (``"969,30,1"``, Megatron-LM's default) cuts each prefix's
documents into train / valid / test shares.
"""
from __future__ import annotations

import re
from typing import Any

from etp.recipe.validation import RecipeError, _fail

#: Megatron-LM ``--tokenizer-type`` values etp-train builds through ``megatron.core.tokenizers``
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "TikTokenizer", "NullTokenizer")
#: Megatron-LM tokenizer types etp refuses, and why
REFUSED_TOKENIZER_TYPES = {
    "GPT2BPETokenizer": "reads --vocab-file / --merge-file (or downloads them), which etp-train does not take",
    "BertWordPieceLowerCase": "is a BERT tokenizer (etp-train trains GPT models)",
    "BertWordPieceCase": "is a BERT tokenizer (etp-train trains GPT models)",
    "MultimodalTokenizer": "is for multimodal models (etp-train trains text GPT models)",
    "NullMultimodalTokenizer": "is for multimodal models (etp-train trains text GPT models)",
    "SFTTokenizer": "is for supervised fine-tuning conversations, not pretraining",
}
#: tokenizer types that read ``tokenizer_model``
NEEDS_MODEL = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
               "TikTokenizer")
#: Megatron-LM's split when ``data_path`` is given without one
DEFAULT_SPLIT = "969,30,1"
_BLEND_KEYS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def _is_number(item: Any) -> bool:
    if isinstance(item, bool):
        return False
    if isinstance(item, (int, float)):
        return True
    try:
        float(item)
    except (TypeError, ValueError):
        return False
    return True


def parse_blend(key: str, value: Any) -> tuple[tuple[str, ...], tuple[float, ...] | None] | None:
    """``(prefixes, weights or None)`` of a ``data_path``-like value ([Note: blends]); None for None.

    Example::

        parse_blend("data_path", "0.3 wiki 0.7 code")   # (('wiki', 'code'), (0.3, 0.7))
        parse_blend("data_path", "corpus/wiki_text_document")   # (('corpus/wiki_text_document',), None)
    """
    if value is None:
        return None
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise RecipeError(key, value, f"recipe key {key}={value!r}: expected a prefix, a list of prefixes, or "
                          "weight / prefix pairs (e.g. [0.3, corpus/a_text_document, 0.7, corpus/b_text_document])")
    numeric = [_is_number(item) for item in items]
    if len(items) % 2 == 0 and all(numeric[0::2]):
        weights = tuple(float(w) for w in items[0::2])
        prefixes = items[1::2]
        bad = [w for w in weights if not w > 0 or w != w or w == float("inf")]
        if bad:
            raise RecipeError(key, value, f"recipe key {key}={value!r}: blend weight {bad[0]} must be a positive "
                              "finite number (remove a prefix rather than weigh it 0)")
    else:
        weights, prefixes = None, items
        if any(numeric):
            first = items[numeric.index(True)]
            raise RecipeError(key, value, f"recipe key {key}={value!r}: {first!r} looks like a blend weight, but the "
                              "list is not weight / prefix pairs with a number before every prefix: write "
                              "[w1, prefix1, w2, prefix2, ...] or prefixes only")
    for prefix in prefixes:
        if not isinstance(prefix, str) or not prefix.strip():
            raise RecipeError(key, value, f"recipe key {key}={value!r}: {prefix!r} is not a dataset prefix (a path "
                              "without .bin / .idx)")
        if prefix.endswith((".bin", ".idx")):
            raise RecipeError(key, value, f"recipe key {key}={value!r}: give the prefix {prefix[:-4]!r}, without "
                              f"{prefix[-4:]} (the .bin and the .idx are found from it)")
    return tuple(p.strip() for p in prefixes), weights


def parse_split(value: Any) -> tuple[float, float, float]:
    """Megatron-LM's ``split`` (``"969,30,1"``, ``"99,1"``, ``100``) as three normalized shares.

    Example::

        parse_split("969,30,1")   # (0.969, 0.03, 0.001)
    """
    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    parts = [p.strip() for p in re.split(r"[,/]", text)] if isinstance(text, str) else None
    if not parts or len(parts) > 3 or not all(re.fullmatch(r"\d+(\.\d*)?|\.\d+", p) for p in parts):
        raise RecipeError("split", value, f"recipe key split={value!r}: expected up to three non-negative numbers "
                          "separated by commas, the train, valid and test shares (e.g. '969,30,1')")
    shares = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    total = sum(shares)
    if total <= 0:
        raise RecipeError("split", value, f"recipe key split={value!r}: the shares sum to 0: give the train split "
                          "a share (e.g. '969,30,1')")
    return tuple(s / total for s in shares)  # type: ignore[return-value]


def check_data_keys(spec) -> None:
    """The checks of a ``DataSpec`` that need no file: blends, split, tokenizer, what needs what."""
    blends = {key: parse_blend(key, getattr(spec, key)) for key in _BLEND_KEYS}
    per_split = [key for key in _BLEND_KEYS[1:] if blends[key] is not None]
    if blends["data_path"] is not None and per_split:
        _fail(per_split[0], getattr(spec, per_split[0]), "cannot be combined with data_path (Megatron-LM takes "
              "either data_path with split, or a data path per split): remove one")
    if per_split and "train_data_path" not in per_split:
        _fail(per_split[0], getattr(spec, per_split[0]), "needs train_data_path too (the data to train on)")
    if per_split and spec.split is not None:
        _fail("split", spec.split, "does nothing with train_data_path / valid_data_path / test_data_path (each "
              "split has its own data): remove split")
    if spec.split is not None:
        parse_split(spec.split)
    has_data = blends["data_path"] is not None or bool(per_split)
    if spec.mock_data and has_data:
        _fail("mock_data", True, "replaces the corpus with megatron-core's generated documents: remove mock_data "
              "or the data paths")
    if spec.tokenizer_type in REFUSED_TOKENIZER_TYPES:
        _fail("tokenizer_type", spec.tokenizer_type, f"{REFUSED_TOKENIZER_TYPES[spec.tokenizer_type]}: use one of "
              f"{list(TOKENIZER_TYPES)} (a Hugging Face tokenizer directory works for most models)")
    if spec.tokenizer_type is not None and spec.tokenizer_type not in TOKENIZER_TYPES:
        _fail("tokenizer_type", spec.tokenizer_type, f"allowed values are {list(TOKENIZER_TYPES)}")
    if (has_data or spec.mock_data) and spec.tokenizer_type is None:
        _fail("tokenizer_type", None, "is required with data_path / mock_data (the documents' end-of-document "
              "token and vocabulary come from it): e.g. tokenizer_type=HuggingFaceTokenizer with "
              "tokenizer_model=DIR, or NullTokenizer for ids already below vocab_size")
    if spec.tokenizer_type in NEEDS_MODEL and spec.tokenizer_model is None:
        _fail("tokenizer_model", None, f"is required with tokenizer_type={spec.tokenizer_type} (a local path; "
              "nothing is downloaded)")
    if spec.tokenizer_type == "NullTokenizer" and spec.tokenizer_model is not None:
        _fail("tokenizer_model", spec.tokenizer_model, "is not read by tokenizer_type=NullTokenizer: remove it")
    if spec.tokenizer_model is not None and spec.tokenizer_type is None:
        _fail("tokenizer_model", spec.tokenizer_model, "needs tokenizer_type (e.g. HuggingFaceTokenizer)")
    if not (has_data or spec.mock_data):
        for key in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(spec, key):
                _fail(key, True, "needs documents: an indexed dataset (data_path) or mock_data")
        if spec.data_cache_path is not None:
            _fail("data_cache_path", spec.data_cache_path, "caches the indices of data_path's datasets: set "
                  "data_path too, or remove data_cache_path")
