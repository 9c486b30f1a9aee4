"""Small indexed datasets for the data tests, written with megatron-core's own builder."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_moe_cpu.yaml"
#: the model's vocabulary in these tests; NullTokenizer's end-of-document id is VOCAB - 1
VOCAB = 128
EOD = VOCAB - 1


def documents(count: int, seed: int, longest: int = 40) -> list[list[int]]:
    """``count`` documents of random ids below ``EOD``, each ending in ``EOD``."""
    rng = numpy.random.default_rng(seed)
    return [list(rng.integers(0, EOD, int(rng.integers(1, longest)))) + [EOD] for _ in range(count)]


def megatron_null_tokenizer(ids: int):
    """megatron-core's own NullTokenizer of ``ids`` ids, ``ids - 1`` ending each document, built
    here, not through etp. Its builder moved to ``tokenizers.utils`` in 0.17, which also reads
    ``pad_vocab_size``; Megatron-LM's ``--vocab-size`` counts the end-of-document id from 0.18 on
    (the NullTokenizer that takes an ``eod_id``) and not before."""
    import inspect

    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    try:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    except ModuleNotFoundError:
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer
    vocab_size = ids if "eod_id" in inspect.signature(NullTokenizer).parameters else ids - 1
    tokenizer = build_tokenizer(SimpleNamespace(tokenizer_type="NullTokenizer", vocab_size=vocab_size,
                                                pad_vocab_size=False))
    assert (tokenizer.vocab_size, tokenizer.eod) == (ids, ids - 1)
    return tokenizer


def write_dataset(prefix: Path, docs: list[list[int]]) -> str:
    """``prefix.bin`` / ``.idx`` of ``docs`` (one sequence per document) through megatron-core's
    ``IndexedDatasetBuilder``; returns the prefix."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(VOCAB))
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def data_recipe(tmp: Path, **overrides):
    """The tiny CPU recipe over NullTokenizer datasets in ``tmp`` (ETP 1: the data tests are about
    the data), with ``overrides``."""
    from etp.recipe import Recipe

    keys = dict(vocab_size=VOCAB, tokenizer_type="NullTokenizer", tokenizer_model=None,
                data_cache_path=str(tmp / "cache"), split="80,15,5", eval_interval=5, eval_iters=2,
                seq_length=16, max_position_embeddings=16, micro_batch_size=2, global_batch_size=8,
                train_iters=10, etp={"etp_size": 1, "expert_etp_size": 1})
    keys.update(overrides)
    return Recipe.from_yaml(TINY, **keys)
