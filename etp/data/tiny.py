"""The bundled tiny dataset of the CPU quick start: ``tiny_corpus.txt``'s sentences, eight to a
document, tokenized by a 512-id byte-level BPE tokenizer trained on them with the ``tokenizers``
library, as a megatron-core indexed dataset.

Shipped beside this file (about 90 KB): ``tiny_tokenizer/`` (a Hugging Face tokenizer directory,
``<|endoftext|>`` its end-of-document token) and ``tiny_corpus_text_document.bin`` / ``.idx``
(what ``etp-preprocess --append-eod`` writes for ``tiny_documents()`` with that tokenizer; a test
rebuilds them and compares the bytes). ``python -m etp.data.tiny`` writes all three again
(``--out DIR`` elsewhere; ``--jsonl PATH`` only the documents as JSONL).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["TINY_DIR", "tiny_documents", "train_tiny_tokenizer", "write_tiny_jsonl"]

TINY_DIR = Path(__file__).resolve().parent
#: sentences of ``tiny_corpus.txt`` per document
SENTENCES_PER_DOCUMENT = 8
TOKENIZER_VOCAB = 512
EOD_TOKEN = "<|endoftext|>"


def tiny_documents(corpus: Path = TINY_DIR / "tiny_corpus.txt",
                   sentences: int = SENTENCES_PER_DOCUMENT) -> list[str]:
    """``corpus``'s lines, ``sentences`` to a document (the newlines kept).

    Example::

        len(tiny_documents())   # 300
    """
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    return ["".join(lines[i:i + sentences]) for i in range(0, len(lines), sentences)]


def write_tiny_jsonl(path: Path) -> Path:
    """The tiny documents as JSONL, one ``{"text": ...}`` per line (etp-preprocess's input)."""
    with open(path, "w", encoding="utf-8") as f:
        for document in tiny_documents():
            f.write(json.dumps({"text": document}) + "\n")
    return path


def train_tiny_tokenizer(out_dir: Path, vocab_size: int = TOKENIZER_VOCAB) -> Path:
    """Trains a byte-level BPE tokenizer on ``tiny_corpus.txt`` (the ``tokenizers`` package, no
    hub) and saves it as a Hugging Face tokenizer directory that ``HuggingFaceTokenizer`` loads."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError("training the tiny tokenizer needs the tokenizers package: pip install tokenizers "
                         "(or pip install etp[data])") from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(TINY_DIR / "tiny_corpus.txt")], trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN, "model_max_length": 1 << 20}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out_dir


def main(argv=None) -> None:
    from etp.data.preprocess import preprocess_jsonl

    parser = argparse.ArgumentParser(prog="python -m etp.data.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=TINY_DIR, help="directory to write to (default: etp/data)")
    parser.add_argument("--jsonl", type=Path, help="only write the documents as JSONL to this path")
    args = parser.parse_args(argv)
    if args.jsonl is not None:
        print(f"wrote {write_tiny_jsonl(args.jsonl)} ({len(tiny_documents())} documents)")
        return
    tokenizer = train_tiny_tokenizer(args.out / "tiny_tokenizer")
    jsonl = write_tiny_jsonl(args.out / "tiny_corpus.jsonl")
    preprocess_jsonl(jsonl, ["text"], "HuggingFaceTokenizer", tokenizer, str(args.out / "tiny_corpus"),
                     append_eod=True)
    jsonl.unlink()


if __name__ == "__main__":
    main()
