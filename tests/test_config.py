"""ETPConfig: defaults, YAML loading, and one ValueError per kind of bad value."""
import dataclasses
from pathlib import Path

import pytest
import yaml

from etp import ETPConfig

ROOT = Path(__file__).resolve().parents[1]


def test_yaml_defaults_equal_dataclass_defaults():
    loaded = yaml.safe_load((ROOT / "configs" / "etp.yaml").read_text())
    assert loaded == dataclasses.asdict(ETPConfig())
    assert ETPConfig.from_yaml(ROOT / "configs" / "etp.yaml") == ETPConfig()


def test_yaml_etp_section_and_overrides(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("num_layers: 2\netp:\n  etp_size: 4\n  reduction: sum\n")
    cfg = ETPConfig.from_yaml(path, pad_for_alignment=8)
    assert (cfg.etp_size, cfg.reduction, cfg.pad_for_alignment) == (4, "sum", 8)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("etp_size", 0, "etp_size=0"),
        ("etp_size", -2, "etp_size=-2"),
        ("expert_etp_size", 0, "expert_etp_size=0"),
        ("etp_size", 2.0, "positive integer"),
        ("etp_size", True, "positive integer"),
        ("pad_for_alignment", 12, "power of two"),
        ("pad_for_alignment", 0, "pad_for_alignment=0"),
        ("reduction", "avg", "allowed values"),
        ("gather_dtype", "int8", "allowed values"),
        ("prefetch", "yes", "true or false"),
        ("debug_checks", 1, "true or false"),
        ("etp_sizes", 2, "unknown ETP setting"),
    ],
)
def test_bad_values_raise_value_error_naming_key(key, value, message):
    with pytest.raises(ValueError, match=message) as info:
        ETPConfig.from_dict({key: value})
    assert key in str(info.value)


def test_world_size_not_divisible():
    cfg = ETPConfig(etp_size=4, expert_etp_size=2)
    cfg.check_world_size(8)
    with pytest.raises(ValueError, match=r"etp_size=4 does not divide the world size 6"):
        cfg.check_world_size(6)
    with pytest.raises(ValueError, match=r"expert_etp_size=2 does not divide the world size 3"):
        ETPConfig(etp_size=4, expert_etp_size=2).replace(etp_size=1).check_world_size(3)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ETPConfig().etp_size = 2
