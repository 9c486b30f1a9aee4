"""etp-audit: predicted per-rank memory of a recipe with and without ETP (no GPU needed).

    etp-audit --recipe recipes/moe_flagship.yaml [--world-size 8] [--etp-size 8]
              [--expert-etp-size 8] [--gather-dtype fp8_tensorwise]
              [--distributed-optimizer] [--json out.json | --json -] [--plot out.png]
              [--gpu-memory 141GiB | --gpu-memory local]   (a unit is required)

Besides the categories it prints the predicted peak (allocated bytes, the larger of the
forward/backward and optimizer-step phases), whether the recipe fits the GPU, and a what-if
table: micro-batch -> predicted peak with and without ETP, with the largest micro-batch
that fits each layout (see [Note: predicted peak]).

See [Note: ETP memory prediction] in etp/audit.py for what each category counts.
"""
from __future__ import annotations

import argparse
import json
import sys

from etp.audit.categories import CATEGORIES
from etp.audit.predict import FRAGMENTATION, RESERVED_OUTSIDE, fits, largest_micro_batch, predict_memory, predict_peak

__all__ = ["main", "audit"]

GIB = 1024**3
_PHASE = {"forward_backward": "fwd/bwd", "capture": "capture", "optimizer_step": "optimizer"}
_UNITS = {"b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}


def parse_memory(text: str) -> int:
    """Bytes of ``141GiB`` / ``150GB`` / ``1.5e11B``, or of the local CUDA device for ``local``. A
    bare number is refused: ``80`` would be 80 bytes, never what was meant."""
    import re

    if text.strip().lower() == "local":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--gpu-memory local: no CUDA device here; give a size such as 141GiB")
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if match and not match.group(2):
        raise ValueError(f"--gpu-memory={text!r} has no unit: write {match.group(1)}GiB (or GB, MiB, B, ...)")
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"--gpu-memory={text!r}: expected a size such as 141GiB, 150GB or local")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _local_gpu_memory() -> int | None:
    """The memory of this machine's CUDA device when there is one (the default ``--gpu-memory``)."""
    import torch

    return parse_memory("local") if torch.cuda.is_available() else None


def _load(recipe_path, world_size, etp_size, expert_etp_size, gather_dtype, overrides, gpu_memory):
    """The recipe with the command line's overrides and its ``auto`` settings chosen as etp-train
    would choose them on one host of sm90 GPUs of ``gpu_memory``; and the notes of those choices."""
    from etp.recipe import Recipe
    from etp.train.auto import Machine, resolve_auto

    if etp_size is not None and expert_etp_size is None:
        expert_etp_size = etp_size
    etp = {k: v for k, v in (("etp_size", etp_size), ("expert_etp_size", expert_etp_size),
                              ("gather_dtype", gather_dtype)) if v is not None}
    overrides = {**(overrides or {})}
    if etp:
        overrides["etp"] = {**overrides.get("etp", {}), **etp}
    if world_size is not None:
        overrides["world_size"] = world_size
    recipe = Recipe.from_yaml(recipe_path, **overrides)
    world = recipe.parallel.world_size
    if world is None:
        raise ValueError("the recipe sets no world_size: pass --world-size")
    recipe, notes = resolve_auto(recipe, Machine(world, world, cuda=gpu_memory is not None, gpu_memory=gpu_memory,
                                                 sm90=gpu_memory is not None))
    recipe.check_world_size(world)
    return recipe, notes


def audit(recipe_path: str, world_size: int | None = None, etp_size: int | None = None,
          expert_etp_size: int | None = None, gather_dtype: str | None = None,
          distributed_optimizer: bool | None = None, overrides: dict | None = None,
          gpu_memory: int | None = None) -> dict:
    """The audit report (a JSON-ready dict): per-rank bytes of every category for the
    layouts ``without_etp`` and ``with_etp``.

    Args:
        etp_size: the dense ETP size; without ``expert_etp_size`` it sets the expert ETP size
            too (one ETP size for every weight).
        overrides: recipe overrides as ``parse_overrides`` returns them (``--set KEY=VALUE``);
            the explicit arguments win over them.
        gpu_memory: bytes of one GPU: adds ``fits`` and the micro-batch table (``micro_batches``).

    Example::

        report = audit("recipes/moe_flagship.yaml", overrides={"num_layers": 16})
        report["layouts"]["with_etp"]["total"] / 2**30
    """
    recipe, auto_notes = _load(recipe_path, world_size, etp_size, expert_etp_size, gather_dtype, overrides,
                               gpu_memory)
    world = recipe.parallel.world_size
    without = recipe.etp.replace(etp_size=1, expert_etp_size=1)
    layouts = {"without_etp": predict_memory(recipe, world, without, distributed_optimizer),
               "with_etp": predict_memory(recipe, world, recipe.etp, distributed_optimizer)}
    for values in layouts.values():
        values["total"] = sum(values[c] for c in CATEGORIES)
    etps = {"without_etp": without, "with_etp": recipe.etp}
    peaks = {}
    for name, config in etps.items():
        peak = predict_peak(recipe, world, config, distributed_optimizer)
        peaks[name] = {k: v for k, v in peak.items() if k != "categories"}
        if gpu_memory:
            peaks[name]["fits"] = fits(peak, gpu_memory)
    micro = None
    if gpu_memory:
        micro = {"candidates": [], "largest": {}}
        for name, config in etps.items():
            best, table = largest_micro_batch(recipe, world, gpu_memory, config, distributed_optimizer)
            micro["largest"][name] = best
            micro["candidates"] = [b for b, _peak, _ok in table]
            micro[name] = [peak for _, peak, _ok in table]
            micro.setdefault("fits", {})[name] = [ok for _, _peak, ok in table]
            micro.setdefault("outside_allocator", {})[name] = peaks[name]["outside_allocator"]
    return {
        "recipe": recipe_path,
        "world_size": world,
        "etp": {"etp_size": recipe.etp.etp_size, "expert_etp_size": recipe.etp.expert_etp_size,
                "gather_dtype": recipe.etp.gather_dtype, "gather_reuse": recipe.etp.gather_reuse,
                "pad_for_alignment": recipe.etp.pad_for_alignment},
        "cuda_graph": recipe.train.cuda_graph,
        "distributed_optimizer": bool(recipe.parallel.use_distributed_optimizer
                                      if distributed_optimizer is None else distributed_optimizer),
        "parameters": recipe.num_params(),
        "units": "bytes per rank",
        "attention_backend": recipe.model.attention_backend,
        "layouts": layouts,
        "peaks": peaks,
        "gpu_memory": gpu_memory,
        "fit_rule": f"peak (captured: or optimizer step + graph pool) x {FRAGMENTATION} + symmetric memory + "
                    f"{RESERVED_OUTSIDE / GIB:.0f} GiB outside the allocator <= gpu_memory",
        "micro_batches": micro,
        "auto": auto_notes,
    }


def format_table(report: dict) -> str:
    rows = [f"auto: {note}" for note in report.get("auto", ())]
    rows.append(f"{'category':<14}{'without ETP':>14}{'with ETP':>14}   (GiB per rank)")
    for key in (*CATEGORIES, "total"):
        a, b = (report["layouts"][name][key] / GIB for name in ("without_etp", "with_etp"))
        rows.append(f"{key:<14}{a:>14.3f}{b:>14.3f}")
    peaks = report.get("peaks")
    if peaks:
        names = ("without_etp", "with_etp")
        rows.append(f"{'peak':<14}" + "".join(f"{peaks[n]['peak'] / GIB:>14.3f}" for n in names)
                    + "   (allocated; the larger of forward/backward (a captured step's: its capture) and the "
                    "optimizer step)")
        rows.append(f"{'peak phase':<14}" + "".join(f"{_PHASE[peaks[n]['peak_phase']]:>14}" for n in names))
        if any(peaks[n]["graph_pool"] for n in names):
            rows.append(f"{'graph pool':<14}" + "".join(f"{peaks[n]['graph_pool'] / GIB:>14.3f}" for n in names)
                        + "   (a captured step's activations: reserved in its private pool, not allocated, "
                        "beside the optimizer step; counted in the fit)")
        rows.append(f"{'symmetric':<14}" + "".join(f"{peaks[n]['outside_allocator'] / GIB:>14.3f}" for n in names)
                    + f"   (outside the allocator's peak; gathers over {peaks['with_etp']['gather_transport']}: "
                    "etp.transport auto is taken as copy_engine, NVLink GPUs of one host; "
                    "--set etp.transport=nccl otherwise)")
        if report.get("gpu_memory"):
            rows.append(f"{'fits':<14}" + "".join(f"{'yes' if peaks[n]['fits'] else 'NO':>14}" for n in names)
                        + f"   ({report['gpu_memory'] / GIB:.1f} GiB GPU; {report['fit_rule']})")
    micro = report.get("micro_batches")
    if micro:
        rows.append("")
        rows.append(f"{'micro-batch':<14}{'without ETP':>14}{'with ETP':>14}   (predicted peak GiB per rank, "
                    f"attention {report.get('attention_backend')})")
        for i, b in enumerate(micro["candidates"]):
            cells = ""
            for n in ("without_etp", "with_etp"):
                peak = micro[n][i]
                mark = "" if micro["fits"][n][i] else "*"
                cells += f"{peak / GIB:>13.2f}{mark or ' '}"
            rows.append(f"{b:<14}{cells}")
        rows.append(f"(* does not fit) largest micro-batch that fits: without ETP "
                    f"{micro['largest']['without_etp']}, with ETP {micro['largest']['with_etp']}")
    return "\n".join(rows)


def plot(report: dict, path: str) -> None:
    """Stacked bars of the two layouts, one segment per category (PNG)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or etp[audit])") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("without_etp", "with_etp")
    fig, ax = plt.subplots(figsize=(6, 4.5))
    bottom = [0.0, 0.0]
    for category in CATEGORIES:
        values = [report["layouts"][n][category] / GIB for n in names]
        ax.bar(["without ETP", "with ETP"], values, bottom=bottom, label=category)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{report['recipe']} on {report['world_size']} ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _prepare_output(flag: str, path: str | None) -> None:
    """Makes the directory of an output file (before any work), or raises naming the flag."""
    from pathlib import Path

    if path is None or path == "-":
        return
    parent = Path(path).expanduser().resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot create its directory {parent} ({error.strerror or error})") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="etp-audit", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--etp-size", type=int,
                        help="dense ETP size; also the expert ETP size unless --expert-etp-size is given")
    parser.add_argument("--expert-etp-size", type=int)
    parser.add_argument("--gather-dtype")
    parser.add_argument("--distributed-optimizer", action="store_true", default=None)
    parser.add_argument("--gpu-memory", metavar="SIZE",
                        help="memory of one GPU (141GiB, 150GB, or 'local' for this machine's device, the "
                             "default when it has one): say whether the recipe fits and recommend the "
                             "largest micro-batch")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON ('-': stdout)")
    parser.add_argument("--plot", metavar="PATH", help="write a stacked-bar PNG")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, as etp-train does (etp.KEY for the etp section)")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size <= 0:
        print(f"etp-audit: --world-size={args.world_size}: must be a positive integer", file=sys.stderr)
        return 2
    from etp.recipe import parse_overrides

    try:  # recipe errors (missing file, bad YAML, bad value) are one line, no traceback
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            _prepare_output(flag, path)
        gpu_memory = parse_memory(args.gpu_memory) if args.gpu_memory else _local_gpu_memory()
        report = audit(args.recipe, args.world_size, args.etp_size, args.expert_etp_size,
                       args.gather_dtype, args.distributed_optimizer, parse_overrides(args.set), gpu_memory)
    except (ValueError, OSError) as exc:
        print(f"etp-audit: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(report, indent=1))
    else:
        print(format_table(report))
        if args.json:
            try:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
            except OSError as exc:
                print(f"etp-audit: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
                return 2
    if args.plot:
        try:
            plot(report, args.plot)
        except (ValueError, OSError) as exc:
            print(f"etp-audit: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
