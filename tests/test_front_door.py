"""The command lines' front door: a recipe that does not exist or does not parse is one line on
stderr naming the file and the problem (no traceback) and a non-zero exit; etp-audit takes
etp-train's ``--set`` overrides and ``--etp-size`` alone sets both ETP sizes."""
import json
from pathlib import Path

import pytest

from etp.train.audit_command import main as audit_main
from etp.train.main import main as train_main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "moe_flagship.yaml")


@pytest.fixture
def broken_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("num_layers: 2\n  hidden_size: [1, 2\n")
    return path


@pytest.mark.parametrize("main", [train_main, audit_main], ids=["etp-train", "etp-audit"])
@pytest.mark.parametrize("case", ["missing", "not_yaml", "bad_override"])
def test_recipe_problems_are_one_line(main, case, tmp_path, broken_yaml, capsys):
    if case == "missing":
        argv, expect = ["--recipe", str(tmp_path / "nope.yaml")], [str(tmp_path / "nope.yaml"), "no such file"]
    elif case == "not_yaml":
        argv, expect = ["--recipe", str(broken_yaml)], [str(broken_yaml), "not valid YAML", "line 2"]
    else:
        argv, expect = ["--recipe", RECIPE, "--set", "num_layerz=3"], ["num_layerz", "num_layers"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for word in expect:
        assert word in err, (word, err)


def _report(argv, capsys):
    assert audit_main(["--recipe", RECIPE, "--json", "-", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_audit_set_overrides_change_the_model(capsys):
    base = _report(["--world-size", "8"], capsys)
    deeper = _report(["--world-size", "8", "--set", "num_layers=16"], capsys)
    assert deeper["parameters"] > base["parameters"]
    fp8 = _report(["--world-size", "8", "--set", "etp.gather_dtype=fp8_tensorwise"], capsys)
    assert fp8["etp"]["gather_dtype"] == "fp8_tensorwise"
    assert fp8["layouts"]["with_etp"]["fp8_shards"] > 0 == base["layouts"]["with_etp"]["fp8_shards"]


def test_audit_etp_size_alone_sets_both_sizes(capsys):
    report = _report(["--world-size", "2", "--etp-size", "2"], capsys)
    assert report["etp"]["etp_size"] == 2 and report["etp"]["expert_etp_size"] == 2
    split = _report(["--world-size", "4", "--etp-size", "2", "--expert-etp-size", "4"], capsys)
    assert split["etp"]["etp_size"] == 2 and split["etp"]["expert_etp_size"] == 4
