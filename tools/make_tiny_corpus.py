#!/usr/bin/env python
"""Writes etp/data/tiny_corpus.txt: a small, deterministic English-like corpus (templated
sentences) for the CPU training recipe. Byte-level, so no tokenizer is needed; regular
enough that a tiny model's loss falls visibly within a minute.

    python tools/make_tiny_corpus.py
"""
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


def main() -> None:
    rng = random.Random(20261121)
    lines = []
    for _ in range(2400):
        lines.append(" ".join([rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(ENDINGS)]))
    path = Path(__file__).resolve().parents[1] / "etp" / "data" / "tiny_corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="ascii")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
