"""etp-preprocess: its .bin / .idx are byte for byte what megatron-core's own ``IndexedDatasetBuilder``
writes for the same tokens (tokenized here by megatron-core's tokenizer, documents built as
Megatron-LM's ``tools/preprocess_data.py`` builds them), whatever the number of workers; the
bundled tiny dataset is that output; bad input is one line."""
import json

import pytest
from data_cases import ROOT, megatron_null_tokenizer

pytest.importorskip("megatron.core")
TOKENIZER = ROOT / "etp" / "data" / "tiny_tokenizer"


def _reference(prefix, documents, tokenizer, append_eod: bool) -> bytes:
    """megatron-core's builder fed Megatron-LM's documents: each field's sentences tokenized, empty
    ones skipped, the end-of-document token appended to a non-empty document."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
    for sentences in documents:
        ids, lengths = [], []
        for sentence in sentences:
            tokens = tokenizer.tokenize(sentence)
            if tokens:
                ids += tokens
                lengths.append(len(tokens))
        if ids and append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        builder.add_document(ids, lengths)
    builder.finalize(f"{prefix}.idx")
    return (prefix.parent / f"{prefix.name}.bin").read_bytes() + (prefix.parent / f"{prefix.name}.idx").read_bytes()


def _written(prefix) -> bytes:
    return (prefix.parent / f"{prefix.name}.bin").read_bytes() + (prefix.parent / f"{prefix.name}.idx").read_bytes()


@pytest.fixture(scope="module")
def hf_tokenizer():
    """The bundled tokenizer, loaded by megatron-core itself (not through etp)."""
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(tokenizer_path=str(TOKENIZER), metadata_path={"library": "huggingface"},
                                             use_fast=True)


def test_output_is_megatron_cores_builder_byte_for_byte(tmp_path, hf_tokenizer, capsys):
    """The bundled documents through etp-preprocess (2 workers), the shipped dataset, and
    megatron-core's builder: one byte string."""
    from etp.data.tiny import tiny_documents, write_tiny_jsonl
    from etp.train.preprocess_command import main

    jsonl = write_tiny_jsonl(tmp_path / "tiny.jsonl")
    code = main(["--input", str(jsonl), "--json-keys", "text", "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", str(TOKENIZER), "--output-prefix", str(tmp_path / "etp"), "--append-eod",
                 "--workers", "2", "--log-interval", "100"])
    err = capsys.readouterr().err
    assert code == 0, err
    want = _reference(tmp_path / "megatron", [[d] for d in tiny_documents()], hf_tokenizer, append_eod=True)
    assert _written(tmp_path / "etp_text_document") == want
    assert _written(ROOT / "etp" / "data" / "tiny_corpus_text_document") == want  # the shipped dataset is current
    progress = [line for line in err.splitlines() if line.startswith("etp-preprocess: ")]
    assert [line.split(" documents")[0] for line in progress[:3]] == [f"etp-preprocess: {n}" for n in (100, 200, 300)]
    assert " in " in progress[3] and "tokens/s" in progress[3]  # the throughput line


def test_keys_sentence_lists_and_empty_documents(tmp_path):
    """Two --json-keys (a dataset each), a field given as a list of sentences, an empty document,
    NullTokenizer ids; 1 and 3 workers write the same bytes as megatron-core's builder."""
    from etp.train.preprocess_command import main

    rows = [{"text": "1 2 3", "code": ["4 5", "6"]}, {"text": "7", "code": []}, {"text": "8 9", "code": ["10"]}] * 40
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    null = megatron_null_tokenizer(100)  # etp's --vocab-size 100
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        assert main(["--input", str(jsonl), "--json-keys", "text", "code", "--tokenizer-type", "NullTokenizer",
                     "--vocab-size", "100", "--output-prefix", str(out), "--append-eod", "--workers", str(workers)]) == 0
        for key in ("text", "code"):
            documents = [r[key] if isinstance(r[key], list) else [r[key]] for r in rows]
            want = _reference(tmp_path / f"ref_{key}", documents, null, append_eod=True)
            assert _written(tmp_path / f"w{workers}_{key}_document") == want, (workers, key)


@pytest.mark.parametrize("line, message", [
    ('{"text": "1 2"}\nnot json\n', "line 2 is not JSON"),
    ('{"body": "1 2"}\n', "line 1 has no 'text' field"),
    ('["1 2"]\n', "line 1 is a JSON list"),
    ('{"text": "1 x"}\n', "line 1 field 'text' could not be tokenized"),
])
def test_bad_input_is_one_line_and_leaves_no_dataset(tmp_path, capsys, line, message):
    from etp.train.preprocess_command import main

    (tmp_path / "in.jsonl").write_text(line)
    code = main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                 "--output-prefix", str(tmp_path / "out"), "--workers", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not list(tmp_path.glob("out*"))


def test_a_refused_tokenizer_and_a_missing_model_are_one_line(tmp_path, capsys):
    from etp.train.preprocess_command import main

    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    base = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"), "--workers", "1"]
    assert main([*base, "--tokenizer-type", "GPT2BPETokenizer"]) == 2
    assert "vocab-file" in capsys.readouterr().err
    assert main([*base, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing is downloaded" in err, err
