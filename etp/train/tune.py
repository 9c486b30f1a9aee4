"""``etp-train --tune OUT.yaml``: time the candidates ``auto`` chooses between and keep the fastest.

For every key the recipe leaves ``auto`` (and for ``micro_batch_size``, over the sizes the
memory audit says fit under the recipe's global batch), each combination runs a few
iterations as its own etp-train run (gloo ranks on CPU, ``torchrun`` on GPUs), in the
launching process's order, with a progress line each. Candidates the audit says do not fit
are listed as skipped, never tried. A key that cannot change this run is not varied
(``inert_auto_keys``: the gather keys where nothing is ETP-sharded, e.g. on one GPU): it is
named with its reason and stays ``auto``, which says the same at start-up. The table of all
of them is printed, and the fastest is written as a YAML mapping of overrides that
``etp-train --overrides OUT.yaml`` applies as it is.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from etp.train.auto import QUANTIZED_GATHERS, Machine, inert_auto_keys, kept_reuse, quantized_gathers_refusal
from etp.train.options import RunOptions, TrainError

__all__ = ["Candidate", "candidates", "tune"]

#: Iterations a candidate runs: the first log window (warm-up, compilation, capture) is not timed.
TUNE_ITERS = 6


@dataclass
class Candidate:
    """One combination of settings, its overrides, and what running it gave."""

    overrides: dict
    skipped: str | None = None  # why it was not run (the audit says it does not fit)
    ms_per_iter: float | None = None
    tflops: float | None = None
    error: str | None = None
    notes: list = field(default_factory=list)

    def label(self) -> str:
        flat = {**{k: v for k, v in self.overrides.items() if k != "etp"},
                **{f"etp.{k}": v for k, v in self.overrides.get("etp", {}).items()}}
        return " ".join(f"{k}={v}" for k, v in sorted(flat.items())) or "(the recipe as it is)"


def _micro_batches(recipe, machine: Machine) -> list[int]:
    """Micro-batch sizes that divide the per-rank batch (largest first)."""
    per_rank = recipe.samples_per_rank(machine.world_size)
    return sorted((m for m in range(1, per_rank + 1) if per_rank % m == 0), reverse=True)


def candidates(recipe, machine: Machine, micro_batches: int = 3) -> list[Candidate]:
    """Every combination of the recipe's ``auto`` keys' choices on ``machine`` and of its
    ``micro_batches`` largest micro-batch sizes the audit says fit (all of them on CPU). Keys
    that cannot change the run (``inert_auto_keys``) are not varied: they stay ``auto``.

    Example::

        for c in candidates(Recipe.from_yaml("recipes/moe_wide.yaml", world_size=4), Machine.detect(4)):
            print(c.label(), c.skipped)
    """
    from etp.audit import fits, predict_peak

    choices: dict[str, list] = {}
    inert = inert_auto_keys(recipe, machine)
    if "cuda_graph" in recipe.auto:
        choices["cuda_graph"] = ["none", "step"] if machine.cuda else ["none"]
    if "etp.gather_dtype" in recipe.auto and "etp.gather_dtype" not in inert:
        choices["etp.gather_dtype"] = ["param"] + ([QUANTIZED_GATHERS] if quantized_gathers_refusal(recipe, machine) is None
                                                   else [])
    if "etp.gather_reuse" in recipe.auto and "etp.gather_reuse" not in inert:
        # "keep": the weights stay gathered as long as auto would keep them at that micro-batch
        # size ("step" over several micro-batches, "pass" for one), so auto's pick is a candidate.
        choices["etp.gather_reuse"] = ["chain", "keep"]
    sizes, found = _micro_batches(recipe, machine), []
    for values in itertools.product(*choices.values()):
        chosen = dict(zip(choices, values))
        kept = 0
        for size in sizes:
            overrides = {"micro_batch_size": size, **{k: v for k, v in chosen.items() if not k.startswith("etp.")}}
            etp = {k[4:]: v for k, v in chosen.items() if k.startswith("etp.")}
            if etp.get("gather_reuse") == "keep":
                etp["gather_reuse"] = kept_reuse(recipe.replace(micro_batch_size=size), machine.world_size)
            if etp:
                overrides["etp"] = etp
            candidate = Candidate(overrides)
            try:
                resolved = recipe.replace(**overrides)
            except ValueError as error:  # e.g. a capture this recipe cannot hold
                candidate.skipped = str(error)
                found.append(candidate)
                break
            if machine.gpu_memory is not None:
                peak = predict_peak(resolved, machine.world_size)
                if not fits(peak, machine.gpu_memory):
                    candidate.skipped = f"the audit predicts {peak['device_peak'] / 2**30:.1f} GiB: does not fit"
                    found.append(candidate)
                    continue
            found.append(candidate)
            kept += 1
            if kept == micro_batches:
                break
    return found


def _set_args(overrides: dict) -> list[str]:
    args = []
    for key, value in overrides.items():
        if key == "etp":
            args += [item for k, v in value.items() for item in ("--set", f"etp.{k}={v}")]
        else:
            args += ["--set", f"{key}={value}"]
    return args


def _run(recipe_path: str, base_args: list[str], candidate: Candidate, machine: Machine, iters: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "run.json"
        argv = ["--recipe", recipe_path, *base_args, *_set_args(candidate.overrides), "--train-iters", str(iters),
                "--log-interval", str(iters // 2), "--set", "save=null", "--json", str(report)]
        if machine.cuda:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={machine.world_size}", "-m", "etp.train"]
        else:
            launcher = [sys.executable, "-m", "etp.train"]
        done = subprocess.run([*launcher, *argv], capture_output=True, text=True, env=dict(os.environ))
        if done.returncode != 0 or not report.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            candidate.error = " | ".join(tail) or f"exit status {done.returncode}"
            return
        data = json.loads(report.read_text())
        candidate.ms_per_iter, candidate.tflops = data["ms_per_iter"], data["tflops_per_rank"]


def tune(recipe, recipe_path: str, base_args: list[str], out_path: str, machine: Machine,
         iters: int = TUNE_ITERS, json_path: str | None = None) -> list[Candidate]:
    """Runs every candidate, prints the table and writes the fastest's overrides to ``out_path``
    (and, with ``json_path``, every candidate's figures with the run's provenance).

    ``base_args``: the run's own ``--set`` arguments (each candidate's come after them)."""
    import yaml

    if not recipe.auto:
        raise TrainError("--tune: the recipe leaves nothing auto (cuda_graph, etp.gather_dtype, etp.gather_reuse, "
                         "micro_batch_size); "
                         "set the keys to tune to auto")
    inert = inert_auto_keys(recipe, machine)
    if set(recipe.auto) <= set(inert):
        raise TrainError(f"--tune: nothing to time: the recipe's only auto keys, {', '.join(inert)}, are "
                         f"{next(iter(inert.values()))}; set micro_batch_size or cuda_graph to auto, or run "
                         "without --tune")
    for key, why in inert.items():
        print(f"etp-train --tune: {key} not timed: {why}", flush=True)
    found = candidates(recipe, machine)
    runnable = [c for c in found if c.skipped is None]
    for index, candidate in enumerate(runnable, 1):
        print(f"etp-train --tune [{index}/{len(runnable)}] {candidate.label()} ...", flush=True)
        _run(recipe_path, base_args, candidate, machine, iters)
        result = f"{candidate.ms_per_iter:.1f} ms/iter" if candidate.ms_per_iter else f"failed: {candidate.error}"
        print(f"etp-train --tune [{index}/{len(runnable)}] {result}", flush=True)
    timed = [c for c in runnable if c.ms_per_iter is not None]
    if not timed:
        raise TrainError("--tune: no candidate ran: " + "; ".join(f"{c.label()}: {c.error}" for c in runnable))
    best = min(timed, key=lambda c: c.ms_per_iter)
    print(format_table(found, best), flush=True)
    Path(out_path).write_text(yaml.safe_dump(best.overrides, sort_keys=True))
    print(f"etp-train --tune: wrote {out_path}: etp-train --recipe {recipe_path} --overrides {out_path}", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(tune_report(found, best), indent=1))
        print(f"etp-train --tune: wrote {json_path}", flush=True)
    return found


def tune_report(found: list[Candidate], best: Candidate) -> dict:
    """``--tune --json``'s report: this process's provenance, every candidate (its time, or
    why it was skipped or failed) and the fastest's overrides."""
    from etp.provenance import run_provenance

    rows = [{"candidate": c.label(), "overrides": c.overrides, "ms_per_iter": c.ms_per_iter,
             "tflops_per_rank": c.tflops, "fastest": c is best, "skipped": c.skipped, "error": c.error} for c in found]
    return {"provenance": run_provenance(), "candidates": rows, "best_overrides": best.overrides}


def format_table(found: list[Candidate], best: Candidate) -> str:
    rows = ["| candidate | ms/iter | TFLOP/s per rank | |", "|---|---:|---:|---|"]
    for c in found:
        if c.skipped:
            rows.append(f"| {c.label()} | | | skipped: {c.skipped} |")
        elif c.error:
            rows.append(f"| {c.label()} | | | failed: {c.error} |")
        else:
            rows.append(f"| {c.label()} | {c.ms_per_iter:.1f} | {c.tflops:.1f} | {'fastest' if c is best else ''} |")
    return "\n".join(rows)


def run_options_for_tune(options: RunOptions) -> None:
    """--tune times fresh runs: it takes no checkpoint or output options of its own (``--json``
    is its own report: every candidate's figures)."""
    if options.resume or options.audit_path or options.profile_dir:
        raise TrainError("--tune runs its candidates from scratch: drop --resume, --audit and --profile")
