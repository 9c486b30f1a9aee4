"""etp-train: train a recipe with ETP (``etp-train --recipe FILE`` or ``python -m etp.train``).

Either way the model is megatron-core's ``GPTModel`` with etp's layer spec (grouped experts,
SDPA attention), ETP applied, every recipe key honoured:

* Without GPUs (recipe ``backend: gloo``, or no CUDA): spawns ``world_size`` gloo ranks on
  loopback and trains it on the recipe's data (an indexed dataset through megatron-core's GPTDataset, synthetic ids or a text
  file's bytes), with torch AdamW after etp's
  gradient finalize (``etp.train.optimizer_steps.TorchStep``); megatron-core's few CUDA-only
  places run on the CPU ([Note: megatron-core on CPU] in ``etp.megatron.patches``).
* Under ``torchrun`` with GPUs: trains it with megatron-core DDP and Adam.

Every input error (recipe, data, output paths, checkpoint directories) is found before the
ranks start work and reported as one line; see ``etp.train`` for the components.

Example::

    etp-train --recipe recipes/tiny_moe_cpu.yaml
    torchrun --nproc-per-node=4 -m etp.train --recipe recipes/moe_flagship.yaml --json run.json
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
from pathlib import Path

import torch

from etp.train import RunOptions, TrainError

__all__ = ["main"]


def _parse(argv):
    parser = argparse.ArgumentParser(prog="etp-train", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, help="YAML recipe (see recipes/)")
    parser.add_argument("--train-iters", type=int, help="override the recipe's train_iters")
    parser.add_argument("--log-interval", type=int, help="override the recipe's log_interval")
    parser.add_argument("--json", metavar="PATH", help="write losses, step times, TFLOP/s, peak memory and provenance")
    parser.add_argument("--audit", nargs="?", const="etp_audit.json", metavar="PATH",
                        help="record per-phase memory (etp.audit.MemoryAudit), print it against the "
                             "prediction and write every rank's to PATH (default etp_audit.json)")
    parser.add_argument("--resume", nargs="?", const=True, default=False, type=int, metavar="ITERATION",
                        help="continue from the latest checkpoint (or the given iteration's) of the "
                             "recipe's load (or save) directory, at any parallel layout")
    parser.add_argument("--overwrite", action="store_true",
                        help="let a fresh run replace the checkpoints already in its save directory "
                             "(deleted before it starts; without it such a run is refused)")
    parser.add_argument("--exit-after", type=int, metavar="N",
                        help="stop after iteration N (the learning-rate schedule still spans train_iters)")
    parser.add_argument("--profile", metavar="DIR",
                        help="torch-profile a few steady-state iterations: one Chrome trace per rank in DIR "
                             "and a time breakdown per iteration (printed by rank 0, JSON per rank)")
    parser.add_argument("--timeline", action="store_true",
                        help="unprofiled: per phase, host issue time, device time and how far the device runs "
                             "behind the host (printed by rank 0, 'timeline' in --json)")
    parser.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                        help="dense bf16 peak TFLOP/s per GPU for MFU (default: the recipe's peak_tflops, else "
                             "the GPU's datasheet figure)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any recipe key (etp.KEY for the etp section); repeatable")
    parser.add_argument("--overrides", metavar="YAML",
                        help="a YAML mapping of recipe overrides (what --tune writes); --set wins over it")
    parser.add_argument("--tune", metavar="OUT.yaml",
                        help="time a few iterations of every candidate the recipe's auto keys choose between "
                             "(and the micro-batch sizes the memory audit says fit), print the table and write "
                             "the fastest as overrides for --overrides; settings inert here (the gather keys with "
                             "nothing ETP-sharded) are not timed; run it outside torchrun")
    return parser.parse_args(argv)


def _load(args):
    from etp.recipe import Recipe, load_recipe_yaml, parse_overrides

    overrides = {}
    if args.overrides:
        loaded = load_recipe_yaml(Path(args.overrides))
        if not isinstance(loaded, dict):
            raise TrainError(f"--overrides {args.overrides}: expected a YAML mapping of recipe keys")
        overrides.update(loaded)
    for key, value in parse_overrides(args.set).items():
        if key == "etp":
            overrides["etp"] = {**overrides.get("etp", {}), **value}
        else:
            overrides[key] = value
    for key, value in (("train_iters", args.train_iters), ("log_interval", args.log_interval),
                       ("peak_tflops", args.peak_tflops)):
        if value is not None:
            overrides[key] = value
    return Recipe.from_yaml(args.recipe, **overrides)


def main(argv=None) -> int:
    """etp-train's entry point; returns the exit status (2: an input error, reported as one line)."""
    from etp.megatron.checkpoint.manifest import CheckpointError
    from etp.recipe import RecipeError
    from etp.train.auto import Machine, resolve_auto
    from etp.train.checkpointing import resume_from_load
    from etp.train.launch import run_rank, spawn_cpu_ranks
    from etp.train.preflight import preflight

    args = _parse(argv)
    if "RANK" in os.environ:
        _stack_dumps()
    options = RunOptions(json_path=args.json, audit_path=args.audit, resume=args.resume, exit_after=args.exit_after,
                         profile_dir=args.profile, timeline=args.timeline, overwrite=args.overwrite)
    rank = int(os.environ.get("RANK", 0))
    try:  # before any process group or GPU work; under torchrun every rank checks, rank 0 speaks
        recipe = _load(args)
        torchrun = "RANK" in os.environ
        if args.tune:
            return _tune(args, recipe, options, torchrun)
        if not torchrun and (recipe.parallel.backend == "nccl"
                             or (recipe.parallel.backend == "auto" and torch.cuda.is_available())):
            raise TrainError(f"run GPU recipes under torchrun, e.g. torchrun --nproc-per-node="
                             f"{recipe.parallel.world_size or 1} -m etp.train --recipe {args.recipe}")
        world = int(os.environ["WORLD_SIZE"]) if torchrun else (recipe.parallel.world_size or 1)
        machine = Machine.detect(world) if torchrun else Machine(world, world)
        recipe, notes = resolve_auto(recipe, machine)  # [Note: auto settings]
        recipe.check_world_size(world)
        recipe, options, restart = resume_from_load(recipe, options)  # [Note: restarts], [Note: fine-tuning]
        notes = [*notes, *recipe.notes, *([restart] if restart else []), *preflight(recipe, options)]
    except (RecipeError, TrainError, CheckpointError) as error:
        if rank == 0:
            print(f"etp-train: error: {error}", file=sys.stderr)
        return 2
    if rank == 0:
        for note in notes:
            print(f"etp-train: {note}", flush=True)
    if torchrun:
        return run_rank(rank, world, recipe, options)
    return spawn_cpu_ranks(world, recipe, options)


def _stack_dumps() -> None:
    """How a hung torchrun run shows where each rank waits: SIGUSR1 prints this rank's Python
    stacks (every thread) to stderr, e.g. ``pkill -USR1 -P $(pgrep -f bin/torchrun)``; with
    ``ETP_DUMP_STACKS_AFTER=SECONDS`` each rank prints them once by itself after that long."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    after = os.environ.get("ETP_DUMP_STACKS_AFTER")
    if after:
        faulthandler.dump_traceback_later(float(after), repeat=False)


def _tune(args, recipe, options, torchrun: bool) -> int:
    from etp.train.auto import Machine, resolve_auto
    from etp.train.tune import run_options_for_tune, tune

    if torchrun:
        raise TrainError("--tune launches its own runs: start it without torchrun (etp-train --recipe R --tune OUT)")
    run_options_for_tune(options)
    cuda = torch.cuda.is_available() and recipe.parallel.backend != "gloo"
    world = recipe.parallel.world_size or (torch.cuda.device_count() if cuda else 1)
    machine = Machine.detect(world) if cuda else Machine(world, world)
    recipe, notes = resolve_auto(recipe, machine, keep=("cuda_graph", "etp.gather_dtype", "etp.gather_reuse",
                                                          "micro_batch_size"))
    for note in notes:
        print(f"etp-train: {note}", flush=True)
    base = [*(["--overrides", args.overrides] if args.overrides else []),
            *(item for value in args.set for item in ("--set", value))]
    tune(recipe, args.recipe, base, args.tune, machine, json_path=options.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
