"""ETP command-line flags for Megatron-LM's ``pretrain(..., extra_args_provider=...)``.

For Megatron-LM users (``pretrain_gpt.py``)::

    from etp.megatron.args import add_etp_args, etp_config_from_args

    pretrain(train_ds_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=add_etp_args)

and the two-line hook at the end of ``model_provider`` (DDP / optimizer integration is not
in this version yet)::

    model = GPTModel(...)
    etp.megatron.model.apply_etp(model, etp_config_from_args(get_args()))

The flags (defaults are :class:`etp.ETPConfig`'s, so without flags ETP is off)::

    --etp-size N               ranks sharding each dense weight            (etp_size)
    --expert-etp-size N        ranks sharding each routed-expert weight    (expert_etp_size)
    --etp-gather-dtype D       param | bf16 | fp16 | fp32 | fp8_tensorwise | fp8_blockwise
                               (or a format's import path module:Name, etp.formats)
    --etp-no-prefetch          do not gather the next weight during the current GEMM
    --etp-no-async-reduce      reduce-scatter weight gradients in line
    --etp-pad-for-alignment N  rows per shard are a multiple of N (power of two)
    --etp-reduction R          mean | sum of weight gradients over the ETP group
    --etp-debug-checks         check every gather / reduce-scatter transition

Nothing here imports megatron.
"""
from __future__ import annotations

import argparse
from typing import Any

from ..config import REDUCTIONS, ETPConfig
from ..formats import FORMATS, gather_format

__all__ = ["add_etp_args", "etp_config_from_args", "ETP_ARG_DESTS"]

#: ETPConfig field -> argparse dest of its flag.
ETP_ARG_DESTS: dict[str, str] = {
    "etp_size": "etp_size",
    "expert_etp_size": "expert_etp_size",
    "gather_dtype": "etp_gather_dtype",
    "prefetch": "etp_prefetch",
    "async_reduce": "etp_async_reduce",
    "pad_for_alignment": "etp_pad_for_alignment",
    "reduction": "etp_reduction",
    "debug_checks": "etp_debug_checks",
}

_GROUP_TITLE = "etp"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _gather_format_name(text: str) -> str:
    try:
        gather_format(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return text


def add_etp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the "etp" argument group to ``parser`` and returns it (Megatron-LM's
    ``extra_args_provider`` contract). Calling it again on the same parser changes nothing.

    Example::

        parser = add_etp_args(argparse.ArgumentParser())
        args = parser.parse_args(["--etp-size", "4", "--etp-gather-dtype", "fp8_tensorwise"])
        etp_config_from_args(args)   # ETPConfig(etp_size=4, gather_dtype='fp8_tensorwise', ...)
    """
    if "--etp-size" in parser._option_string_actions:  # already added: idempotent
        return parser
    d = ETPConfig()
    group = parser.add_argument_group(
        title=_GROUP_TITLE,
        description="Extended Tensor Parallelism: shard weights over ranks of the "
        "data-parallel group (defaults: ETP off)",
    )
    group.add_argument(
        "--etp-size", dest="etp_size", type=_positive_int, default=d.etp_size,
        help="Ranks of the data-parallel group that shard each dense weight (1 = off).",
    )
    group.add_argument(
        "--expert-etp-size", dest="expert_etp_size", type=_positive_int,
        default=d.expert_etp_size,
        help="Ranks of the expert-data-parallel group that shard each routed-expert weight "
        "(1 = off).",
    )
    group.add_argument(
        "--etp-gather-dtype", dest="etp_gather_dtype", type=_gather_format_name, metavar="FORMAT",
        default=d.gather_dtype,
        help=f"Format weights travel in for the all-gather: {' | '.join(FORMATS)} (fp8_* need --bf16), or a "
        "format's import path module:Name.",
    )
    group.add_argument(
        "--etp-no-prefetch", dest="etp_prefetch", action="store_false", default=d.prefetch,
        help="Do not gather the next weight while the current GEMM runs.",
    )
    group.add_argument(
        "--etp-no-async-reduce", dest="etp_async_reduce", action="store_false",
        default=d.async_reduce,
        help="Reduce-scatter weight gradients in line instead of on a side stream.",
    )
    group.add_argument(
        "--etp-pad-for-alignment", dest="etp_pad_for_alignment", type=_positive_int,
        default=d.pad_for_alignment,
        help="Rows per shard are a multiple of this (a power of two; 128 for fp8_blockwise).",
    )
    group.add_argument(
        "--etp-reduction", dest="etp_reduction", choices=list(REDUCTIONS), default=d.reduction,
        help="mean or sum of weight gradients over the ETP group.",
    )
    group.add_argument(
        "--etp-debug-checks", dest="etp_debug_checks", action="store_true",
        default=d.debug_checks,
        help="Check every gather / reduce-scatter state transition (slower).",
    )
    return parser


def etp_config_from_args(args: Any, *, check_layout: bool = True) -> ETPConfig:
    """The :class:`ETPConfig` of parsed arguments (a Megatron-LM ``args`` namespace).

    With ``check_layout`` and a namespace that carries Megatron-LM's ``world_size`` and
    parallel sizes (``get_args()`` after ``validate_args``), also checks that ETP fits the
    parallel layout (``etp.recipe.check_parallel_layout``). Raises ``ValueError``
    naming the flag when ``add_etp_args`` was not used or a value is invalid.

    Example::

        cfg = etp_config_from_args(get_args())
    """
    values = {}
    for field_name, dest in ETP_ARG_DESTS.items():
        if not hasattr(args, dest):
            raise ValueError(
                f"args has no {dest!r} (flag --{dest.replace('_', '-')}): pass "
                "extra_args_provider=etp.megatron.args.add_etp_args to Megatron-LM"
            )
        values[field_name] = getattr(args, dest)
    config = ETPConfig.from_dict(values)
    if check_layout and isinstance(getattr(args, "world_size", None), int):
        from etp.recipe import check_parallel_layout

        sizes = {
            key: getattr(args, key)
            for key in (
                "tensor_model_parallel_size",
                "pipeline_model_parallel_size",
                "context_parallel_size",
                "expert_model_parallel_size",
                "expert_tensor_parallel_size",
            )
            if isinstance(getattr(args, key, None), int)
        }
        check_parallel_layout(
            args.world_size,
            etp_size=config.etp_size,
            expert_etp_size=config.expert_etp_size,
            **sizes,
        )
    return config
