#!/usr/bin/env python
"""Reproduces BENCHMARKS.md on the GPUs of this machine: one step per table, each a few commands
(etp-train, the benchmark tools, the GPU test suites) with a time budget; with ``--check``, the
regression check of every headline figure against the one the report gives for this GPU kind.

Steps (``--list``): ``expert_stack_{2,N}gpu``, ``recipes_wide_{2,N}gpu``,
``recipes_flagship_{2,N}gpu``, ``kernels_1gpu``, ``ep_moves_{2,N}gpu``,
``ep_dispatcher_{2,N}gpu``, ``memory_audit_{2,N}gpu``, ``checkpoint_Ngpu``,
``graphs_flagship_{2,N}gpu`` and the GPU test suites ``tests_*``. A ``..._{k}gpu`` step runs on
the first k GPUs (``CUDA_VISIBLE_DEVICES``), so ``--gpus 4`` produces the 2- and 4-GPU rows;
``--gpus 1`` runs the steps that fit one GPU (kernels, optimizer step, language-model loss, the
one-GPU recipes, the kernel test suites).

``--check`` then prints one table (reported, today, today's speed) and exits non-zero when a
figure is more than 10 % slower than reported or a correctness figure changed ([Note: the
regression check] in ``tools/repro/check.py``).

Each run writes its JSON and its log into ``OUT/<step>/``; ``OUT/summary.json`` holds every
step's commands, return codes, seconds and headline figure, with this run's provenance. A
step starts only if its estimate fits what is left of ``--budget``; each command has its own
timeout (cut to what is left); a step that does not fit is skipped and reported. Progress lines
while it runs; a summary table at the end. Installs nothing: megatron-core must be importable.

Example::

    python3 tools/reproduce.py --list --gpus 4
    python3 tools/reproduce.py --dry-run --gpus 4 --only 'recipes'
    python3 tools/reproduce.py --out /tmp/r --gpus 4 --budget 530 --only '^recipes_.*_4gpu$' --tar $OUT/r.tgz
    python3 tools/reproduce.py --gpus 1 --check --out /tmp/r1
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: repro, bench_provenance

from repro.check import check_table, gpu_kind  # noqa: E402
from repro.runner import Outcome, command_env, run_step  # noqa: E402
from repro.steps import Step, build_steps, fill  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("reproduce_out"), help="folder for JSON, logs and summary.json")
    p.add_argument("--gpus", type=int, default=None, help="use the first N GPUs (default: every GPU present)")
    p.add_argument("--only", default=None, metavar="REGEX", help="run the steps whose name matches (re.search)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (default 540)")
    p.add_argument("--list", action="store_true", help="print the steps with their estimates and exit")
    p.add_argument("--dry-run", action="store_true", help="print every command (with its environment) and exit")
    p.add_argument("--tar", type=Path, default=None, help="also pack the --out folder into this .tgz at the end")
    p.add_argument("--check", action="store_true", help="compare every headline figure with the one BENCHMARKS.md "
                   "reports for this GPU kind; exit 1 when one is >10%% slower or a correctness figure changed")
    args = p.parse_args(argv)
    present = present_gpus()
    if args.gpus is None:
        args.gpus = present or (4 if args.dry_run or args.list else 0)
    if args.gpus < 1:
        p.error(f"--gpus {args.gpus}: this machine shows no GPU (nvidia-smi -L); the report's figures need one")
    if not (args.dry_run or args.list) and args.gpus > present:
        p.error(f"--gpus {args.gpus}: this machine shows {present} (nvidia-smi -L)")
    return args


def present_gpus() -> int:
    """GPUs this machine shows (``nvidia-smi -L``; 0 without a driver)."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def gpu_name() -> str:
    """The first GPU's name (``nvidia-smi``), or "" without one."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return ""
    return names[0].strip() if names else ""


def selected(steps: list[Step], only: str | None) -> list[Step]:
    if only is None:
        return steps
    pattern = re.compile(only)
    return [s for s in steps if pattern.search(s.name)]


def print_list(steps: list[Step]) -> None:
    print(f"{'step':26s} {'GPUs':>4s} {'est s':>6s}  table")
    for step in steps:
        gpus = max(r.gpus for r in step.runs)
        print(f"{step.name:26s} {gpus:4d} {step.est_s:6d}  {step.section}")
    print(f"{len(steps)} steps, ~{sum(s.est_s for s in steps)} s in all")


def print_commands(steps: list[Step], out: Path, gpus: int) -> None:
    scratch = Path(tempfile.gettempdir()) / "etp_reproduce_scratch"
    for step in steps:
        print(f"# {step.name}: {step.section} (~{step.est_s} s)")
        for run in step.runs:
            env = command_env(run, gpus)
            prefix = [f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}", *run.env]
            print(" ".join(prefix), fill(run.command, out / step.name, run, scratch))


def summary_table(outcomes: list[Outcome], out: Path) -> str:
    lines = ["| step | rc | seconds | headline | JSON |", "|---|---:|---:|---|---|"]
    for o in outcomes:
        files = sorted(str(p.relative_to(out)) for p in (out / o.step.name).glob("*.json")) if o.runs else []
        rc = "–" if o.rc is None else str(o.rc)
        lines.append(f"| {o.step.name} | {rc} | {o.seconds:.0f} | {o.headline or o.note} | {', '.join(files)} |")
    return "\n".join(lines)


def write_summary(outcomes: list[Outcome], args, budget_used: float) -> None:
    from bench_provenance import provenance

    steps = [{"name": o.step.name, "section": o.step.section, "rc": o.rc, "seconds": round(o.seconds, 1),
              "headline": o.headline, "note": o.note, "runs": o.runs} for o in outcomes]
    report = {"provenance": provenance(), "gpus": args.gpus, "budget_s": args.budget,
              "seconds": round(budget_used, 1), "steps": steps}
    (args.out / "summary.json").write_text(json.dumps(report, indent=1) + "\n")


def run_all(steps: list[Step], args) -> list[Outcome]:
    began = time.monotonic()
    deadline = began + args.budget
    scratch = Path(tempfile.mkdtemp(prefix="etp_reproduce_"))  # checkpoints: never shipped with --out
    try:
        outcomes = [run_step(step, f"[{i}/{len(steps)}]", args.out, scratch, args.gpus, deadline)
                    for i, step in enumerate(steps, 1)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_summary(outcomes, args, time.monotonic() - began)
    return outcomes


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    steps = selected(build_steps(args.gpus), args.only)
    if not steps:
        print(f"reproduce: no step matches --only {args.only!r} (see --list)", file=sys.stderr)
        return 2
    if args.list:
        print_list(steps)
        return 0
    if args.dry_run:
        print_commands(steps, args.out, args.gpus)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"[reproduce] {len(steps)} steps on {args.gpus} GPUs, budget {args.budget:.0f} s, into {args.out}",
          flush=True)
    outcomes = run_all(steps, args)
    print("\n" + summary_table(outcomes, args.out) + f"\n\nsummary: {args.out / 'summary.json'}", flush=True)
    if args.tar:
        with tarfile.open(args.tar, "w:gz") as tar:
            tar.add(args.out, arcname=args.out.name)
        print(f"packed: {args.tar}", flush=True)
    failed = any(o.rc not in (0, None) for o in outcomes)
    if args.check:
        kind = gpu_kind(gpu_name(), args.gpus)
        table, regressed = check_table([o.step for o in outcomes if o.runs], args.out, kind)
        (args.out / "check.md").write_text(table + "\n")
        print(f"\n[reproduce] --check against BENCHMARKS.md's {kind} figures:\n{table}\n"
              f"check: {'FAILED' if regressed else 'passed'} ({args.out / 'check.md'})", flush=True)
        failed |= regressed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
