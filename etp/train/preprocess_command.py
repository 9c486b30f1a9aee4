"""etp-preprocess: a JSONL corpus to megatron-core indexed datasets (``.bin`` / ``.idx``), with the
flags of Megatron-LM's ``tools/preprocess_data.py`` (the library: ``etp.data.preprocess``).

Example::

    etp-preprocess --input corpus.jsonl --json-keys text --tokenizer-type HuggingFaceTokenizer \\
        --tokenizer-model tokenizer/ --output-prefix data/corpus --append-eod --workers 4
    # writes data/corpus_text_document.bin and .idx: recipe key data_path: data/corpus_text_document
"""
from __future__ import annotations

import argparse
import sys
import warnings

__all__ = ["main"]


def _parse(argv):
    parser = argparse.ArgumentParser(prog="etp-preprocess", description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file: one JSON object (a document) per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="the fields to tokenize, one dataset each (default: text)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       help="HuggingFaceTokenizer | SentencePieceTokenizer | GPTSentencePieceTokenizer | "
                            "Llama2Tokenizer | TikTokenizer | NullTokenizer")
    group.add_argument("--tokenizer-model", help="the tokenizer's local path (a Hugging Face tokenizer directory, "
                                                 "a SentencePiece or tiktoken model file)")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer / TikTokenizer: the vocabulary (the recipe's "
                                                      "vocab_size)")
    group.add_argument("--append-eod", action="store_true", help="end each document with the end-of-document token")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes PREFIX_{key}_document.bin / .idx (the recipe's data_path is PREFIX_text_document)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True, help="tokenizing processes")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """etp-preprocess's entry point; returns the exit status (2: an input error, one line)."""
    from etp.data.preprocess import PreprocessError, preprocess_jsonl
    from etp.recipe.data_keys import REFUSED_TOKENIZER_TYPES, TOKENIZER_TYPES

    args = _parse(argv)
    try:
        if args.tokenizer_type not in TOKENIZER_TYPES:
            why = REFUSED_TOKENIZER_TYPES.get(args.tokenizer_type, "is not a tokenizer type etp reads")
            raise PreprocessError(f"--tokenizer-type {args.tokenizer_type} {why}: use one of {list(TOKENIZER_TYPES)}")
        if args.log_interval < 1:
            raise PreprocessError(f"--log-interval {args.log_interval}: must be >= 1")
        with warnings.catch_warnings():  # megatron-core's import-time notes on TransformerEngine / apex
            warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
            preprocess_jsonl(args.input, args.json_keys, args.tokenizer_type, args.tokenizer_model,
                             args.output_prefix, append_eod=args.append_eod, workers=args.workers,
                             vocab_size=args.vocab_size, log_interval=args.log_interval)
    except PreprocessError as error:
        print(f"etp-preprocess: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
