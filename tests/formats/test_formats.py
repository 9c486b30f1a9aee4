"""The gather formats' registry and what each format object answers: names and import paths
resolve (or fail in one sentence naming the allowed values), the wire bytes of every shipped
format and of a packed one (which the memory audit then counts by bits, not by dtype size),
the rules ``ETPConfig``, recipes, ``auto`` and the Megatron flags ask, and the old names that
moved keep working with a warning."""
import argparse
import warnings
from pathlib import Path

import pytest
import torch

from etp import ETPConfig
from etp.formats import FORMATS, GatherFormat, gather_format

ROOT = Path(__file__).resolve().parents[2]


class Packed4(GatherFormat):
    """Two weight elements per byte (as NVFP4 would travel): only its bytes are used here."""

    name, dtype = "packed4", torch.uint8

    def wire_bits(self, param_bytes: int) -> int:
        return 4


@pytest.mark.parametrize("name,wire,bits", [("param", torch.float32, 32), ("bf16", torch.bfloat16, 16),
                                            ("fp16", torch.float16, 16), ("fp32", torch.float32, 32),
                                            ("fp8_tensorwise", torch.float8_e4m3fn, 8),
                                            ("fp8_blockwise", torch.float8_e4m3fn, 8)])
def test_shipped_formats_resolve_and_say_their_wire(name, wire, bits):
    fmt = gather_format(name)
    assert fmt.name == name and gather_format(name) is fmt and name in FORMATS
    assert fmt.wire_dtype(torch.float32) == wire
    assert fmt.gathered_bytes(48, 32, param_bytes=4) == 48 * 32 * bits // 8
    assert fmt.quantized == name.startswith("fp8")
    assert fmt.quantized_copy_bytes(100, 4) == (100 if fmt.quantized else 0)


def test_only_tensorwise_fp8_runs_fp8_gemms_and_only_blockwise_needs_whole_blocks():
    assert [n for n in FORMATS if gather_format(n).fp8_gemms] == ["fp8_tensorwise"]
    assert {n: gather_format(n).row_align for n in FORMATS if gather_format(n).row_align > 1} == {"fp8_blockwise": 128}
    x = torch.zeros(4, 32, dtype=torch.bfloat16)  # CPU: no scaled GEMM anywhere
    assert not any(gather_format(n).fp8_gemm_applies(x, (32, 32), grouped=False) for n in FORMATS)


def test_fp8_rules_ask_for_bf16_and_sm90():
    fp8 = gather_format("fp8_tensorwise")
    assert fp8.unsupported(torch.bfloat16) is None and "bf16" in fp8.unsupported(torch.float32)
    assert fp8.not_fast_on(sm90=True) is None and "sm90" in fp8.not_fast_on(sm90=False)
    assert gather_format("param").unsupported(torch.float32) is None and gather_format("bf16").not_fast_on(False) is None


def test_a_packed_format_is_counted_by_bits():
    from etp.audit.buffers import gather_buffer_bytes
    from etp.recipe import Recipe

    assert Packed4().gathered_bytes(3, 5, param_bytes=2) == 8  # 15 elements: 7.5 bytes, rounded up
    recipe = Recipe.from_yaml(ROOT / "recipes" / "moe_flagship.yaml", world_size=8)
    packed = recipe.etp.replace(gather_dtype="test_formats:Packed4", etp_size=8, expert_etp_size=8)
    fp8 = recipe.etp.replace(gather_dtype="fp8_tensorwise", etp_size=8, expert_etp_size=8)
    got, want = (gather_buffer_bytes(recipe, e, "nccl")["fwd"][0] for e in (packed, fp8))
    assert got > 0 and 2 * got == want


def test_a_format_named_by_its_import_path():
    config = ETPConfig(etp_size=2, gather_dtype="int8_rowwise:Int8Rowwise")
    fmt = config.gather_format
    assert type(fmt).__name__ == "Int8Rowwise" and fmt.quantized and fmt.wire_dtype(torch.float32) == torch.int8
    assert config.gather_format is fmt  # resolved once per process


@pytest.mark.parametrize("value,message", [
    ("int4", "allowed values are ['param', 'bf16'"),
    ("no_such_module:X", "cannot import 'no_such_module'"),
    ("int8_rowwise:INT8_MAX", "is not a GatherFormat subclass or instance"),
    (":X", "import path is 'module:Name'"),
    (None, "allowed values"),
])
def test_bad_names_are_one_line_errors(value, message):
    with pytest.raises(ValueError, match="ETPConfig.gather_dtype=") as info:
        ETPConfig(gather_dtype=value)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_megatron_flag_takes_names_and_import_paths():
    from etp.megatron.args import add_etp_args, etp_config_from_args

    parser = add_etp_args(argparse.ArgumentParser())
    args = parser.parse_args(["--etp-gather-dtype", "int8_rowwise:Int8Rowwise"])
    assert etp_config_from_args(args).gather_dtype == "int8_rowwise:Int8Rowwise"
    with pytest.raises(SystemExit):
        parser.parse_args(["--etp-gather-dtype", "int4"])


def test_recipe_refuses_what_the_format_refuses():
    from etp.recipe import Recipe, RecipeError

    tiny = ROOT / "recipes" / "tiny_moe_cpu.yaml"
    with pytest.raises(RecipeError, match="etp.gather_dtype='fp8_tensorwise': FP8 gathers need bf16"):
        Recipe.from_yaml(tiny, etp={"gather_dtype": "fp8_tensorwise"})
    assert Recipe.from_yaml(tiny, etp={"gather_dtype": "int8_rowwise:Int8Rowwise"}).etp.gather_format.quantized


def test_moved_names_keep_working_with_a_warning():
    import etp.config
    import etp.formats.fp8 as fp8
    import etp.formats.fp8_tensorwise as tensorwise
    import etp.quant

    for name, where in (("FP8Weight", fp8), ("scale_rows", fp8), ("FP8_DTYPE", fp8), ("BLOCK", fp8),
                        ("prepare_scale_rows", fp8), ("cast_tensorwise", tensorwise)):
        with pytest.warns(DeprecationWarning, match=f"etp.quant.{name} moved to {where.__name__}"):
            assert getattr(etp.quant, name) is getattr(where, name)
    with pytest.warns(DeprecationWarning, match="GATHER_DTYPES"):
        table = etp.config.GATHER_DTYPES
    assert table == {n: gather_format(n).dtype for n in FORMATS} and table["param"] is None
    with warnings.catch_warnings(), pytest.raises(AttributeError):
        warnings.simplefilter("error")
        etp.quant.no_such_name  # noqa: B018
