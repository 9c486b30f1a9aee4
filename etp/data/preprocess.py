"""Tokenizing a JSONL corpus into megatron-core indexed datasets (``.bin`` / ``.idx``), as
Megatron-LM's ``tools/preprocess_data.py`` does: one document per line, the text of each
``--json-keys`` field (or a list of its sentences) tokenized, an end-of-document token appended
with ``--append-eod``, written through megatron-core's ``IndexedDatasetBuilder`` with its dtype
for the vocabulary (``DType.optimal_dtype``) to ``{output_prefix}_{key}_document``. Documents
are tokenized by ``workers`` processes and written in input order, so the output does not
depend on how many there are.

Example::

    prefixes = preprocess_jsonl("corpus.jsonl", ["text"], "HuggingFaceTokenizer", "tok/", "out/corpus",
                                append_eod=True, workers=2)
    prefixes["text"]   # 'out/corpus_text_document'
"""
from __future__ import annotations

import json
import multiprocessing
import sys
import time
from pathlib import Path

__all__ = ["PreprocessError", "preprocess_jsonl"]


class PreprocessError(ValueError):
    """An input error of etp-preprocess (a file, a line of it, a flag): one line naming the fix."""


class _Encoder:
    """Tokenizes one JSONL line: Megatron-LM's ``Encoder.encode`` without sentence splitting."""

    tokenizer = None  # per process, built once by ``initialize``

    def __init__(self, json_keys, tokenizer_type, tokenizer_model, vocab_size, append_eod) -> None:
        self.json_keys, self.append_eod = list(json_keys), append_eod
        self.tokenizer_args = (tokenizer_type, tokenizer_model, vocab_size)

    def initialize(self) -> None:
        from etp.data.tokenizer import build_tokenizer

        type(self).tokenizer = build_tokenizer(*self.tokenizer_args, key="--tokenizer-model")

    def encode(self, numbered_line):
        number, line = numbered_line
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            return number, f"is not JSON ({error.msg} at column {error.colno})", len(line.encode())
        if not isinstance(data, dict):
            return number, f"is a JSON {type(data).__name__}, not an object with a {self.json_keys[0]!r} field", len(line.encode())
        ids, lengths = {}, {}
        for key in self.json_keys:
            if key not in data:
                return number, (f"has no {key!r} field (its fields: {sorted(data)[:8]}): --json-keys names the "
                                "fields to read"), len(line.encode())
            text = data[key]
            sentences = text if isinstance(text, list) else [text]
            if not all(isinstance(s, str) for s in sentences):
                return number, f"field {key!r} is not text (a string, or a list of strings)", len(line.encode())
            document, sentence_lengths = [], []
            for sentence in sentences:
                try:
                    sentence_ids = self.tokenizer.tokenize(sentence)
                except Exception as error:  # noqa: BLE001 (the tokenizer's own complaint, as one line)
                    return number, (f"field {key!r} could not be tokenized ({type(error).__name__}: "
                                    f"{' '.join(str(error).split())[:200]})"), len(line.encode())
                if len(sentence_ids) > 0:
                    document.extend(sentence_ids)
                    sentence_lengths.append(len(sentence_ids))
            if len(document) > 0 and self.append_eod:
                document.append(self.tokenizer.eod)
                sentence_lengths[-1] += 1
            ids[key], lengths[key] = document, sentence_lengths
        return number, (ids, lengths), len(line.encode())


def _lines(path: Path):
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


def _progress(stream, documents: int, began: float, nbytes: int, tokens: int, final: bool) -> None:
    elapsed = max(time.perf_counter() - began, 1e-9)
    text = (f"etp-preprocess: {documents} documents, {tokens} tokens ({documents / elapsed:.0f} documents/s, "
            f"{nbytes / elapsed / 2**20:.2f} MiB/s of input, {tokens / elapsed:.0f} tokens/s)")
    if final:
        stream.write(f"{text} in {elapsed:.1f} s\n")
    elif getattr(stream, "isatty", lambda: False)():
        stream.write(f"\r{text}")
    else:
        stream.write(text + "\n")
    stream.flush()


def preprocess_jsonl(input_path, json_keys, tokenizer_type: str, tokenizer_model, output_prefix: str, *,
                     append_eod: bool = False, workers: int = 1, vocab_size: int | None = None,
                     log_interval: int = 1000, stream=None) -> dict[str, str]:
    """Writes ``{output_prefix}_{key}_document.bin`` / ``.idx`` for every key of ``json_keys``;
    returns ``key -> prefix``. Prints a progress line every ``log_interval`` documents and a
    throughput line at the end to ``stream`` (stderr). Raises ``PreprocessError`` (one line) for
    a missing input, a line that is not JSON or lacks a key, or a tokenizer that cannot load.

    Example::

        preprocess_jsonl("corpus.jsonl", ["text"], "NullTokenizer", None, "out/ids", vocab_size=1000)
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    stream = sys.stderr if stream is None else stream
    path = Path(input_path)
    if not path.is_file():
        raise PreprocessError(f"--input {input_path}: no such file (a JSONL file, one document per line)")
    if workers < 1:
        raise PreprocessError(f"--workers {workers}: must be >= 1")
    out_dir = Path(output_prefix).expanduser().resolve().parent
    if not out_dir.is_dir():
        raise PreprocessError(f"--output-prefix {output_prefix}: its directory {out_dir} does not exist: create it")
    encoder = _Encoder(json_keys, tokenizer_type, tokenizer_model, vocab_size, append_eod)
    try:
        encoder.initialize()  # here first: a bad tokenizer is one line before any worker starts
    except ValueError as error:
        raise PreprocessError(str(error)) from None
    if append_eod and encoder.tokenizer.eod is None:
        raise PreprocessError("--append-eod: the tokenizer has no end-of-document token (eos): give it one, or "
                              "leave out --append-eod")
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)
    prefixes = {key: f"{output_prefix}_{key}_document" for key in json_keys}
    builders = {key: IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype) for key, prefix in prefixes.items()}
    began, nbytes, tokens, documents = time.perf_counter(), 0, 0, 0
    pool = None
    try:
        if workers == 1:
            encoded = map(encoder.encode, _lines(path))
        else:
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=encoder.initialize)
            encoded = pool.imap(encoder.encode, _lines(path), chunksize=32)
        for number, result, size in encoded:
            if isinstance(result, str):
                raise PreprocessError(f"--input {input_path} line {number} {result}")
            ids, lengths = result
            for key in json_keys:
                builders[key].add_document(ids[key], lengths[key])
                tokens += len(ids[key])
            documents += 1
            nbytes += size
            if documents % log_interval == 0:
                _progress(stream, documents, began, nbytes, tokens, final=False)
        if documents == 0:
            raise PreprocessError(f"--input {input_path}: no documents (every line is empty)")
    except BaseException:
        for key, builder in builders.items():  # no half-written dataset left behind
            builder.data_file.close()
            Path(f"{prefixes[key]}.bin").unlink(missing_ok=True)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    for key, builder in builders.items():
        builder.finalize(f"{prefixes[key]}.idx")
    _progress(stream, documents, began, nbytes, tokens, final=True)
    for prefix in prefixes.values():
        stream.write(f"etp-preprocess: wrote {prefix}.bin and {prefix}.idx\n")
    return prefixes
