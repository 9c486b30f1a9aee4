"""Where etp-train's figures go besides its log line: a JSON-lines stream, TensorBoard and
Weights & Biases, each written at every log interval, so a run that is killed keeps what it
measured up to its last log line.

[Note: the metrics stream]
Every log interval closes one *record*: a flat dict of the window's figures (``iteration``,
``loss``, ``lr``, ``grad_norm``, ``ms_per_iter``, ``tokens_per_s``, ``tflops_per_rank``, ``mfu``,
``profiled``, ``elapsed_s``, ``eta_s``, ``gc_ms_per_iter``, ``memory_allocated_gib``,
``peak_allocated_gib``); a validation or test adds a record of its own (``iteration``,
``validation_loss`` / ``test_loss``, ``validation_ppl`` / ``test_ppl``). An MoE recipe's records
carry the router's losses and the expert load too ([Note: MoE metrics] in
``etp/train/moe_metrics.py``):

* ``load_balancing_loss`` (``seq_load_balancing_loss`` / ``global_load_balancing_loss`` for those
  balancing types) and ``z_loss`` (with ``moe_z_loss_coeff``), Megatron-LM's names and figures:
  without their coefficients, the mean over the window's micro-batches and the MoE layers;
  ``moe/load_balancing_loss_layer_{i}``, ``moe/z_loss_layer_{i}`` per layer (``i`` 0-based);
* ``moe/expert_load_max_layer_{i}``, ``moe/expert_load_mean_layer_{i}``: the most loaded
  expert's tokens and the mean over the experts, summed over the window and all ranks;
  ``moe/expert_load_max_over_mean_layer_{i}`` their ratio (1: balanced) and
  ``expert_load_max_over_mean`` the largest ratio over the layers.

``MetricsStream.log`` hands each record to every sink that was asked for:

* ``JsonlSink``: one JSON object per line, flushed as it is written (``--json run.json`` streams
  to ``run.jsonl`` beside the report; the report itself is written at the end, as before), then
  a last line ``{"summary": ...}`` at a clean exit. A reader takes the lines it finds: a crash
  loses at most the window in flight.
* ``TensorBoardSink`` (recipe key ``tensorboard_dir``): torch's ``SummaryWriter``, one scalar per
  numeric field under its name, at step ``iteration``; needs the ``tensorboard`` package.
* ``WandbSink`` (``wandb_project``, ``wandb_exp_name``, ``wandb_save_dir``): ``wandb.log`` of the
  same fields at step ``iteration``, the recipe as the run's config. It runs offline (files
  under ``wandb_save_dir``, nothing sent) unless ``WANDB_MODE`` says otherwise.

Only rank 0 writes (the records are the run's, already reduced where they need to be). Both
third-party sinks are optional extras (``pip install -e ".[metrics]"``); asking for one without
its package is refused before any rank starts (``missing_packages``).

Example::

    stream = MetricsStream.open(recipe, rank=0, jsonl="run.jsonl")
    stream.log({"iteration": 10, "loss": 2.31, "lr": 3e-4})
    stream.close({"ms_per_iter": 151.0})
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

__all__ = ["JsonlSink", "MetricsStream", "TensorBoardSink", "WandbSink", "missing_packages", "read_stream"]


def _scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers (booleans and None left out), for the dashboards."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "iteration"}


class JsonlSink:
    """One JSON object per line, each flushed to the file as it is written."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self, summary: dict | None) -> None:
        if summary is not None:
            self.log({"summary": summary})
        self._file.close()


class TensorBoardSink:
    """torch's ``SummaryWriter`` into ``log_dir``: each numeric field a scalar at its iteration."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict) -> None:
        for name, value in _scalars(record).items():
            self._writer.add_scalar(name, value, global_step=record["iteration"])
        self._writer.flush()

    def close(self, summary: dict | None) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run (offline unless ``WANDB_MODE`` says otherwise)."""

    def __init__(self, project: str, name: str | None, save_dir: str | os.PathLike | None, config: dict) -> None:
        import wandb

        if save_dir is not None:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, name=name, dir=None if save_dir is None else str(save_dir),
                               config=config, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, record: dict) -> None:
        self._run.log(_scalars(record), step=record["iteration"])

    def close(self, summary: dict | None) -> None:
        if summary:
            self._run.summary.update(_scalars(summary))
        self._run.finish()


def missing_packages(recipe) -> list[str]:
    """The packages the recipe's metrics keys need that are not installed, as pip names.

    Example::

        missing_packages(recipe)   # ['tensorboard'] for tensorboard_dir without the package
    """
    t = recipe.train
    wanted = [("tensorboard", t.tensorboard_dir), ("wandb", t.wandb_project)]
    return [name for name, asked in wanted if asked and importlib.util.find_spec(name) is None]


class MetricsStream:
    """The sinks of one run (rank 0 only; every other rank's stream is empty)."""

    def __init__(self, sinks: list) -> None:
        self.sinks = sinks

    @classmethod
    def open(cls, recipe, rank: int, jsonl: str | os.PathLike | None = None) -> MetricsStream:
        """The sinks ``recipe`` and ``jsonl`` ask for, opened on rank 0."""
        if rank != 0:
            return cls([])
        t, sinks = recipe.train, []
        if jsonl is not None:
            sinks.append(JsonlSink(jsonl))
        if t.tensorboard_dir:
            sinks.append(TensorBoardSink(t.tensorboard_dir))
        if t.wandb_project:
            config = {"recipe": str(recipe.source), **{f"model.{k}": v for k, v in vars(recipe.model).items()},
                      **{f"etp.{k}": v for k, v in vars(recipe.etp).items()}}
            sinks.append(WandbSink(t.wandb_project, t.wandb_exp_name, t.wandb_save_dir, config))
        return cls(sinks)

    def log(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self, summary: dict | None = None) -> None:
        for sink in self.sinks:
            sink.close(summary)
        self.sinks = []


def read_stream(path: str | os.PathLike) -> tuple[list[dict], dict | None]:
    """A JSON-lines stream's records and its summary (None: the run did not end cleanly). A last
    line cut short by a crash is left out.

    Example::

        records, summary = read_stream("run.jsonl")
    """
    records, summary = [], None
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if "summary" in item and len(item) == 1:
            summary = item["summary"]
        else:
            records.append(item)
    return records, summary
