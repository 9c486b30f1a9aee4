"""etp-convert: Hugging Face checkpoints in and out of etp (the library: ``etp.hf``).

    etp-convert import-hf --hf DIR --recipe R.yaml --out CKPT [--set KEY=VALUE ...]
    etp-convert export-hf --checkpoint CKPT --recipe R.yaml --out DIR [--model-type T] [--iteration N]
                          [--max-shard-size 5GB] [--set KEY=VALUE ...]
    etp-convert recipe-from-hf --hf DIR --out R.yaml

``import-hf`` writes a weights-only etp checkpoint that ``etp-train --set load=CKPT --set
finetune=true`` starts from at any layout; ``export-hf`` writes safetensors shards, their index,
``config.json`` and ``generation_config.json`` that transformers' ``from_pretrained`` loads;
``recipe-from-hf`` writes a recipe of a checkpoint's architecture. Every input error is one
line (exit status 2) before anything is written. docs/hf.md walks through a fine-tune.
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["etp_model", "main"]


def etp_model(recipe):
    """etp-train's model of ``recipe`` (``etp.train.model_build.gpt_model``: megatron-core's
    ``GPTModel`` with etp's layer spec) on the current default device: what etp.hf reads the
    checkpoint layout of (built on the meta device there).

    Example::

        import_hf("Qwen3-30B-A3B", recipe, "ckpt", etp_model)
    """
    import torch

    from etp.train.model_build import gpt_model, transformer_config

    return gpt_model(recipe, transformer_config(recipe, torch.device("cpu")))


def _parser() -> argparse.ArgumentParser:
    from etp.train.audit_command import parse_memory

    parser = argparse.ArgumentParser(prog="etp-convert", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sets = dict(action="append", default=[], metavar="KEY=VALUE",
                help="override a recipe key, as etp-train does (etp.KEY for the etp section)")
    imp = commands.add_parser("import-hf", help="a Hugging Face checkpoint into an etp checkpoint")
    imp.add_argument("--hf", required=True, metavar="DIR", help="config.json and (sharded) *.safetensors")
    imp.add_argument("--recipe", required=True, help="the checkpoint's architecture, as a recipe")
    imp.add_argument("--out", required=True, metavar="CKPT", help="a new directory for the etp checkpoint")
    imp.add_argument("--set", **sets)
    exp = commands.add_parser("export-hf", help="an etp checkpoint into a Hugging Face checkpoint")
    exp.add_argument("--checkpoint", required=True, metavar="CKPT", help="an etp save directory (any layout)")
    exp.add_argument("--recipe", required=True, help="the recipe the checkpoint was trained with")
    exp.add_argument("--out", required=True, metavar="DIR", help="a new directory for the Hugging Face checkpoint")
    exp.add_argument("--model-type", help="qwen3_moe, olmoe or mixtral, when the checkpoint does not say (one "
                                          "trained from scratch)")
    exp.add_argument("--iteration", type=int, help="the checkpoint's iteration (default: latest)")
    exp.add_argument("--max-shard-size", type=parse_memory, default=5 * 10**9, metavar="SIZE",
                     help="bytes per safetensors file (5GB, 2GiB, ...; default 5GB)")
    exp.add_argument("--set", **sets)
    rec = commands.add_parser("recipe-from-hf", help="a recipe of a Hugging Face checkpoint's architecture")
    rec.add_argument("--hf", required=True, metavar="DIR")
    rec.add_argument("--out", required=True, metavar="R.yaml", help="a new recipe file")
    return parser


def main(argv=None) -> int:
    """etp-convert's entry point; returns the exit status (2: an input error, one line)."""
    args = _parser().parse_args(argv)
    from etp.hf import ConversionError, export_hf, import_hf, recipe_from_hf
    from etp.megatron.checkpoint import CheckpointError
    from etp.recipe import parse_overrides

    try:
        if args.command == "import-hf":
            path = import_hf(args.hf, args.recipe, args.out, etp_model, parse_overrides(args.set))
            print(f"etp-convert: wrote {path}: start from it with etp-train --recipe {args.recipe} --set "
                  f"load={args.out} --set finetune=true")
        elif args.command == "export-hf":
            path = export_hf(args.checkpoint, args.recipe, args.out, etp_model, parse_overrides(args.set), args.model_type,
                             args.iteration, args.max_shard_size)
            print(f"etp-convert: wrote {path}: transformers' from_pretrained({str(path)!r}) loads it")
        else:
            path = recipe_from_hf(args.hf, args.out)
            print(f"etp-convert: wrote {path}")
    except (ConversionError, CheckpointError, ValueError, OSError) as error:
        lines = str(error).strip().splitlines() or [type(error).__name__]
        print(f"etp-convert: {lines[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
