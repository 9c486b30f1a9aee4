"""tools/make_tiny_corpus.py: the bundled corpus unchanged, and the loss floor it prints for a
grammar corpus against a count over the sentences it writes (not its own formula)."""
import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("make_tiny_corpus", ROOT / "tools" / "make_tiny_corpus.py")
corpus = importlib.util.module_from_spec(spec)
spec.loader.exec_module(corpus)


def test_default_rewrites_the_bundled_corpus_byte_for_byte(tmp_path):
    out = tmp_path / "tiny.txt"
    corpus.main(["--out", str(out)])
    assert out.read_bytes() == (ROOT / "etp" / "data" / "tiny_corpus.txt").read_bytes()


def test_entropy_per_byte_against_the_written_sentences(tmp_path):
    out = tmp_path / "grammar.txt"
    corpus.main(["--lines", "60000", "--out", str(out)])
    lines = out.read_text().splitlines()
    assert len(lines) == 60000
    # every sentence is one uniform choice among all combinations of the four word lists
    combinations = math.prod(len(words) for words in corpus.WORDS)
    distinct = len(set(lines))
    assert distinct == pytest.approx(combinations, rel=0.03)  # 60000 draws cover ~98% of 15840
    mean_bytes = out.stat().st_size / len(lines)  # the newline included
    assert corpus.entropy_per_byte() == pytest.approx(math.log(combinations) / mean_bytes, rel=0.005)
    with pytest.raises(SystemExit):
        corpus.main(["--lines", "0", "--out", str(out)])
