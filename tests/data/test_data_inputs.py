"""Every bad data input is one line before any rank starts (etp-train exits 2): a missing .bin /
.idx, an index that does not describe its data, token ids at or above vocab_size (in the data, and
the tokenizer's vocabulary against the recipe's), an empty split, blend weights that are not
numbers, a tokenizer path that is not a tokenizer; and the recipe keys' own checks."""
import re
from pathlib import Path

import pytest
from data_cases import TINY, VOCAB, documents, write_dataset

from etp.recipe import Recipe, RecipeError

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("inputs")
    write_dataset(tmp / "good", documents(40, seed=3))
    write_dataset(tmp / "ten", documents(10, seed=4))
    write_dataset(tmp / "big_ids", [[5, 200, 7, VOCAB - 1]] * 20)  # 200 >= vocab_size 128
    for name in ("no_bin", "short_bin", "bad_header"):
        write_dataset(tmp / name, documents(20, seed=5))
    (tmp / "no_bin.bin").unlink()
    (tmp / "short_bin.bin").write_bytes((tmp / "short_bin.bin").read_bytes()[:-6])
    (tmp / "bad_header.idx").write_bytes(b"NOTANIDX" + (tmp / "bad_header.idx").read_bytes()[8:])
    (tmp / "not_a_tokenizer").mkdir()
    (tmp / "not_a_tokenizer" / "notes.txt").write_text("no tokenizer here\n")
    return tmp


def _train(capsys, corpus, *sets):
    from etp.train.main import main

    base = [f"vocab_size={VOCAB}", "tokenizer_type=NullTokenizer", "tokenizer_model=null", f"data_path={corpus}/good",
            f"data_cache_path={corpus}/cache", "split=80,15,5"]
    argv = ["--recipe", str(TINY), "--train-iters", "2"]
    for item in (*base, *sets):
        argv += ["--set", item]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


CASES = {
    "missing .bin": (["data_path={corpus}/no_bin"], "has no no_bin.bin"),
    "missing prefix": (["data_path={corpus}/nothing"], "no such file: no indexed dataset"),
    "index does not match data": (["data_path={corpus}/short_bin"], "are not one dataset"),
    "not an index": (["data_path={corpus}/bad_header"], "is not a megatron-core index"),
    "ids above vocab_size": (["data_path={corpus}/big_ids"], "holds token id 200, outside 0 .. vocab_size - 1 = 127"),
    "empty split": (["data_path={corpus}/ten", "split=969,30,1"], "the valid split of .*ten is empty"),
    "blend weight not a number": (["data_path=[0.3,{corpus}/good,x,{corpus}/ten]"], "looks like a blend weight"),
    "tokenizer not a tokenizer": (["tokenizer_type=HuggingFaceTokenizer", "tokenizer_model={corpus}/not_a_tokenizer"],
                                  "is not a HuggingFaceTokenizer tokenizer"),
    "tokenizer missing": (["tokenizer_type=HuggingFaceTokenizer", "tokenizer_model={corpus}/nowhere"],
                          "no such file or directory"),
    "tokenizer larger than vocab_size": (["tokenizer_type=HuggingFaceTokenizer",
                                          "tokenizer_model=etp/data/tiny_tokenizer"], "has 512 ids"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_is_one_line_before_any_rank(capsys, corpus, case):
    sets, message = CASES[case]
    sets = [s.replace("{corpus}", str(corpus)) for s in sets]
    code, err = _train(capsys, corpus, *sets)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("etp-train: error: "), err
    assert re.search(message, err), err


def test_good_data_passes_the_checks(capsys, corpus):
    """The same checks pass the good dataset (and the bundled one with its tokenizer)."""
    from etp.data.checks import check_data

    assert check_data(_recipe(corpus)) == []
    assert check_data(Recipe.from_yaml(TINY)) == []


def _recipe(corpus, **keys):
    base = dict(vocab_size=VOCAB, tokenizer_type="NullTokenizer", tokenizer_model=None, data_path=f"{corpus}/good",
                data_cache_path=f"{corpus}/cache", split="80,15,5")
    return Recipe.from_yaml(TINY, **{**base, **keys})


RECIPE_CASES = {
    "weights and prefixes mixed": ({"data_path": [0.5, "a", "b"]}, "data_path", "looks like a blend weight"),
    "a zero weight": ({"data_path": "0 a 1 b"}, "data_path", "must be a positive finite number"),
    "a .bin for a prefix": ({"data_path": "corpus/a.bin"}, "data_path", "without .bin"),
    "split not numbers": ({"split": "train,valid"}, "split", "expected up to three non-negative numbers"),
    "split of zeros": ({"split": "0,0,0"}, "split", "sum to 0"),
    "no tokenizer": ({"tokenizer_type": None}, "tokenizer_type", "is required with data_path"),
    "tokenizer without its model": ({"tokenizer_type": "HuggingFaceTokenizer"}, "tokenizer_model", "is required"),
    "a refused tokenizer": ({"tokenizer_type": "GPT2BPETokenizer"}, "tokenizer_type", "vocab-file"),
    "data_path and a per-split path": ({"train_data_path": "x"}, "train_data_path", "cannot be combined"),
    "mock data and a corpus": ({"mock_data": True}, "mock_data", "replaces the corpus"),
    "etp's data key beside data_path": ({"data": "etp/data/tiny_corpus.txt"}, "data", "etp's own corpus key"),
    "masks without documents": ({"data_path": None, "reset_attention_mask": True, "data_cache_path": None},
                                "reset_attention_mask", "needs documents"),
    "negative eval_iters": ({"eval_iters": -1}, "eval_iters", "must be >= 0"),
    "document masks under local attention": ({"reset_attention_mask": True, "attention_backend": "local"},
                                             "attention_backend", "must be sdpa with reset_attention_mask"),
}


@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_bad_data_keys_name_the_key(corpus, case):
    keys, key, message = RECIPE_CASES[case]
    with pytest.raises(RecipeError, match=message) as info:
        _recipe(corpus, **keys)
    assert info.value.key == key


def test_data_path_forms():
    """Megatron-LM's --data-path forms: one prefix, prefixes (blended by size), weight / prefix pairs
    as a list or as the command line's string; split defaults to Megatron-LM's."""
    r = Recipe.from_yaml(TINY, data_path="0.3 a 0.7 b", split=None)
    assert r.data.blend == (("a", "b"), (0.3, 0.7)) and r.data.split == "969,30,1"
    assert Recipe.from_yaml(TINY, data_path=["a", "b"]).data.blend == (("a", "b"), None)
    assert Recipe.from_yaml(TINY, data_path=[1, "a", 3, "b"]).data.blend == (("a", "b"), (1.0, 3.0))
    assert Recipe.from_yaml(TINY, split=100).data.split_shares == (1.0, 0.0, 0.0)


def test_tokenizers_keep_the_recipes_ids():
    """Whichever supported megatron-core builds them: etp's NullTokenizer of a recipe's vocab_size
    V holds V ids, V - 1 ending each document (megatron-core 0.18 changed what Megatron-LM's
    --vocab-size counts), and the bundled Hugging Face tokenizer gives the ids of the ``tokenizers``
    library's own encoding, no special tokens added, its end of document the eos token's id."""
    from tokenizers import Tokenizer

    from etp.data.tokenizer import build_tokenizer

    null = build_tokenizer("NullTokenizer", None, VOCAB)
    assert (null.vocab_size, null.eod) == (VOCAB, VOCAB - 1)
    assert null.tokenize("3 0 126") == [3, 0, 126]
    folder = Path(__file__).resolve().parents[2] / "etp" / "data" / "tiny_tokenizer"
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf = build_tokenizer("HuggingFaceTokenizer", folder)
    text = "a small model reads a small corpus"
    assert list(hf.tokenize(text)) == reference.encode(text, add_special_tokens=False).ids
    assert (hf.vocab_size, hf.eod) == (reference.get_vocab_size(), reference.token_to_id("<|endoftext|>"))
