"""Tokenizers through ``megatron.core.tokenizers``: Megatron-LM's ``--tokenizer-type`` /
``--tokenizer-model`` resolved by megatron-core's own ``build_tokenizer``, from local files only.

etp adds two things megatron-core leaves to its callers: nothing is ever downloaded (the model
path must exist, and the Hugging Face hub is switched offline while the tokenizer loads), and
what goes wrong is one line naming the key and the fix (a path that holds no tokenizer, a
missing package, a vocabulary larger than the recipe's).

``NullTokenizer`` reads ids already written as numbers. A recipe's ``vocab_size`` counts every id
the model embeds: ids below ``vocab_size - 1``, and ``vocab_size - 1`` the end-of-document id, on
every supported megatron-core. Megatron-LM's ``--vocab-size N`` means ``N + 1`` such ids up to
megatron-core 0.17 (etp passes ``vocab_size - 1``) and ``N`` from 0.18 on (etp passes
``vocab_size``).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import SimpleNamespace

__all__ = ["build_tokenizer", "check_tokenizer_fits"]

#: the Python package each tokenizer type loads through megatron-core
_PACKAGES = {"HuggingFaceTokenizer": "transformers", "SentencePieceTokenizer": "sentencepiece",
             "GPTSentencePieceTokenizer": "sentencepiece", "Llama2Tokenizer": "sentencepiece",
             "TikTokenizer": "tiktoken"}


@contextlib.contextmanager
def _hub_offline():
    """The Hugging Face hub off while a tokenizer loads: a local path never turns into a download."""
    saved = {key: os.environ.get(key) for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _megatron_build():
    """megatron-core's ``build_tokenizer``: in ``tokenizers.text.utils`` up to 0.16, in
    ``tokenizers.utils`` from 0.17 (the versions ``etp.megatron.patches`` supports)."""
    try:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    except ModuleNotFoundError:
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer
    return build_tokenizer


def _null_tokenizer_size(vocab_size: int) -> int:
    """Megatron-LM's ``--vocab-size`` of a NullTokenizer of ``vocab_size`` ids, the last ending each
    document: megatron-core 0.18 made the argument the count of every id (its NullTokenizer then
    takes an ``eod_id``, by default the last), where 0.16 and 0.17 add the end-of-document id to it."""
    import inspect

    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return vocab_size if "eod_id" in inspect.signature(NullTokenizer).parameters else vocab_size - 1


def _megatron_args(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int | None) -> SimpleNamespace:
    """The Megatron-LM arguments megatron-core's ``build_tokenizer`` reads, at Megatron-LM's defaults,
    under the names of every supported megatron-core (each reads its own and ignores the rest)."""
    return SimpleNamespace(
        tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model, tokenizer_sentencepiece_legacy=False,
        tiktoken_pattern=None, tiktoken_num_special_tokens=1000, vocab_file=None, merge_file=None,
        trust_remote_code=False, vocab_size=vocab_size,
        # megatron-core 0.16's names; tokenizers trained with the `tokenizers` library ship only the
        # fast tokenizer.json
        tokenizer_metadata=None, tokenizer_special_tokens=None, tokenizer_hf_use_fast=True,
        tokenizer_hf_include_special_tokens=False,
        # the same settings under 0.17's names, and what 0.17 added: no chat template, extra
        # whitespace ignored (0.16's SentencePiece default), no padded vocabulary (the recipe's
        # vocab_size is the model's)
        metadata_path=None, special_tokens=None, tokenizer_hf_no_use_fast=False,
        tokenizer_hf_no_include_special_tokens=True, chat_template=None,
        tokenizer_sentencepiece_ignore_extra_whitespaces=True, pad_vocab_size=False)


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | os.PathLike | None, vocab_size: int | None = None,
                    key: str = "tokenizer_model"):
    """megatron-core's tokenizer (a ``MegatronTokenizerBase``) of a Megatron-LM tokenizer type
    and a local model path; ``vocab_size`` is the recipe's (``NullTokenizer``: ids below it, see
    the module docstring; ``TikTokenizer``: its vocabulary). Raises ValueError (one line, naming
    ``key``) when the path is missing or holds no tokenizer of that type.

    Example::

        tokenizer = build_tokenizer("HuggingFaceTokenizer", "etp/data/tiny_tokenizer")
        tokenizer.tokenize("a small model"), tokenizer.eod, tokenizer.vocab_size
    """
    megatron_build = _megatron_build()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 2:
            raise ValueError(f"tokenizer_type=NullTokenizer needs vocab_size >= 2 (got {vocab_size!r})")
        return megatron_build(_megatron_args(tokenizer_type, None, _null_tokenizer_size(vocab_size)))
    if tokenizer_model is None:
        raise ValueError(f"tokenizer_type={tokenizer_type} needs {key}: the local path of the tokenizer")
    path = Path(tokenizer_model).expanduser()
    if not path.exists():
        raise ValueError(f"{key}={str(tokenizer_model)!r}: no such file or directory (etp reads tokenizers from "
                         "local paths only; nothing is downloaded)")
    package = _PACKAGES.get(tokenizer_type)
    if package is not None:
        import importlib.util

        if importlib.util.find_spec(package) is None:
            raise ValueError(f"tokenizer_type={tokenizer_type} needs the {package} package: pip install {package} "
                             "(or pip install etp[data])")
    args = _megatron_args(tokenizer_type, str(path), vocab_size if tokenizer_type == "TikTokenizer" else None)
    try:
        with _hub_offline():
            tokenizer = megatron_build(args)
            eod = tokenizer.eod  # some libraries read their special tokens lazily: fail here, not later
    except Exception as error:  # noqa: BLE001 (whatever the library raises, the user sees one line)
        reason = " ".join(str(error).split())[:300]
        raise ValueError(f"{key}={str(tokenizer_model)!r} is not a {tokenizer_type} tokenizer ({type(error).__name__}: "
                         f"{reason}): give the directory (or model file) the tokenizer was saved to") from None
    del eod
    return tokenizer


def check_tokenizer_fits(tokenizer, vocab_size: int, needs_eod: bool, key: str = "tokenizer_model") -> None:
    """The tokenizer's ids fit a model of ``vocab_size`` embeddings, and it has an end-of-document
    token when ``needs_eod``; ValueError (one line) otherwise.

    Example::

        check_tokenizer_fits(tokenizer, recipe.model.vocab_size, needs_eod=recipe.data.reset_attention_mask)
    """
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"vocab_size={vocab_size}: the tokenizer ({key}) has {tokenizer.vocab_size} ids, so token "
                         f"ids reach {tokenizer.vocab_size - 1}: set vocab_size={tokenizer.vocab_size} or more")
    if needs_eod and tokenizer.eod is None:
        raise ValueError(f"{key}: the tokenizer has no end-of-document token (eos), which --append-eod, "
                         "reset_attention_mask, reset_position_ids and eod_mask_loss need: give it one")
