#!/usr/bin/env python
"""Writes etp/data/tiny_corpus.txt: a small, deterministic English-like corpus (templated
sentences) for the CPU training recipe. Byte-level, so no tokenizer is needed; regular
enough that a tiny model's loss falls visibly within a minute.

A large model memorizes the bundled corpus within a few hundred iterations (its loss falls
towards zero), which says nothing about precision. ``--lines N --out PATH`` writes N
sentences of the same grammar instead: a corpus too large to memorize, whose loss cannot fall
below the grammar's entropy per byte (printed; every word choice is uniform and independent).

    python tools/make_tiny_corpus.py
    python tools/make_tiny_corpus.py --lines 4000000 --out /tmp/grammar.txt   # then --set data=/tmp/grammar.txt
"""
import argparse
import math
import random
from pathlib import Path

SUBJECTS = ["the engineer", "a small model", "the cluster", "every rank", "the optimizer", "a curious student",
            "the old library", "our team", "the gradient", "a quiet machine", "the scheduler", "each expert"]
VERBS = ["gathers", "reduces", "shards", "reads", "writes", "measures", "trains", "computes", "waits for",
         "prefetches", "compares", "stores"]
OBJECTS = ["the weights", "a long sequence", "every shard", "the next layer", "a fresh batch", "the loss",
           "its own tokens", "the full tensor", "a stable buffer", "the reference model", "the checkpoint"]
ENDINGS = ["before the step.", "on a side stream.", "without losing a byte.", "while the gemm runs.",
           "and moves on.", "every iteration.", "in one launch.", "after the optimizer.", "twice per step.",
           "with great care."]


WORDS = (SUBJECTS, VERBS, OBJECTS, ENDINGS)


def entropy_per_byte() -> float:
    """The grammar's entropy rate in nats per byte: the choices' entropy per sentence over the
    mean bytes per sentence (three spaces and the newline included)."""
    nats = sum(math.log(len(words)) for words in WORDS)
    mean_bytes = sum(sum(len(w) for w in words) / len(words) for words in WORDS) + 4
    return nats / mean_bytes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=2400, help="sentences to write")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "etp" / "data" / "tiny_corpus.txt")
    args = parser.parse_args(argv)
    if args.lines < 1:
        parser.error(f"--lines {args.lines}: give a positive number of sentences")
    rng = random.Random(20261121)
    with open(args.out, "w", encoding="ascii") as f:
        for begun in range(0, args.lines, 100_000):
            f.write("".join(" ".join(rng.choice(words) for words in WORDS) + "\n"
                            for _ in range(min(100_000, args.lines - begun))))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes); the grammar's entropy: "
          f"{entropy_per_byte():.4f} nats per byte, the lowest loss a model can reach on it")


if __name__ == "__main__":
    main()
