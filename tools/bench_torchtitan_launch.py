#!/usr/bin/env python
"""The torchtitan half of ``tools/bench_torchtitan.py``: torchtitan's own ``main(Trainer)``
(torchtitan 0.2.2, unchanged) on a Qwen3 MoE flavor shaped like an etp recipe, trained on the
token ids etp-train trains on. bench_torchtitan.py writes its inputs and starts it, one process::

    ETP_TITAN_BENCH=run/titan_spec.json python -m torch.distributed.run --standalone \\
        --nproc-per-node 1 tools/bench_torchtitan_launch.py --job.config_file run/titan.toml

``ETP_TITAN_BENCH`` names a JSON file: ``model_args`` (``Qwen3ModelArgs`` fields; ``moe_args``
holds ``MoEArgs`` fields) and ``metrics`` (a JSON-lines file this process writes). The TOML is
torchtitan's job config; its ``training.dataset_path`` is an ``.npy`` of ``[steps, batch, seq + 1]``
token ids (bench_torchtitan.py writes etp-train's own batches there).

What this adds to torchtitan, through its extension points only:

* a ``TrainSpec`` named ``etp_qwen3`` (``register_train_spec``): torchtitan's qwen3 spec (model,
  ``parallelize_qwen3`` with its torch.compile and grouped-GEMM experts, optimizers, LR
  schedulers, loss) with one flavor, ``bench``, the recipe's shape; ``TokenFileLoader`` as its
  data loader; no tokenizer (none is needed: the ids are given) and no validator;
* torchtitan's own metrics processor, its metric logger wrapped (``CapturingLogger``) to append
  every logged step's figures to the metrics file, with ``torch.cuda.max_memory_allocated`` and
  ``max_memory_reserved`` read before torchtitan resets the peaks at the end of each log step;
* a stand-in for the ``datasets`` package only when the real one does not import: torchtitan's
  ``hf_datasets`` imports it at module level, and this spec never loads a Hugging Face dataset.
  The metrics file's first line says which was used.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from functools import partial
from pathlib import Path

__all__ = ["CapturingLogger", "TokenFileLoader", "build_capturing_metrics", "import_datasets_or_stub",
           "register_bench_spec"]

#: The train spec's name and its one flavor (``--model.name`` / ``--model.flavor``).
SPEC_NAME, FLAVOR = "etp_qwen3", "bench"


def import_datasets_or_stub() -> str:
    """``datasets``' version, or ``stub (...)`` after putting a stand-in in ``sys.modules``
    when it does not import (the names torchtitan's ``hf_datasets.text_datasets`` imports at
    module level; calling any of them raises)."""
    try:
        import datasets

        return str(getattr(datasets, "__version__", "unknown"))
    except Exception as error:  # any import failure (a missing or mismatched dependency): the stand-in
        reason = f"{type(error).__name__}: {error}"

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"the datasets package did not import ({reason}): this benchmark reads token files only")

    package, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    package.Dataset, package.IterableDataset, package.load_dataset = object, object, unavailable
    package.distributed, distributed.split_dataset_by_node = distributed, unavailable
    sys.modules["datasets"], sys.modules["datasets.distributed"] = package, distributed
    return f"stub ({reason})"


class TokenFileLoader:
    """torchtitan data loader over an ``.npy`` of ``[steps, global batch, seq + 1]`` token ids:
    step ``i`` yields ``({"input": ids[i, rows, :-1]}, ids[i, rows, 1:])`` as int64, ``rows``
    this data-parallel rank's contiguous share of the global batch (etp-train's order), then
    stops (torchtitan ends the run on an exhausted loader).

    Example::

        loader = TokenFileLoader("tokens.npy", dp_rank=0, dp_world_size=1)
        inputs, labels = next(iter(loader))   # inputs["input"]: [batch, seq]
    """

    def __init__(self, path: str | os.PathLike, dp_rank: int, dp_world_size: int) -> None:
        import numpy

        self.ids = numpy.load(path, mmap_mode="r")
        if self.ids.ndim != 3 or self.ids.shape[1] % dp_world_size:
            raise ValueError(f"{path}: expected [steps, batch, seq + 1] ids with batch divisible by "
                             f"{dp_world_size} data-parallel ranks, got shape {self.ids.shape}")
        rows = self.ids.shape[1] // dp_world_size
        self.rows = slice(dp_rank * rows, (dp_rank + 1) * rows)
        self.next_step = 0

    def __iter__(self):
        import torch

        while self.next_step < self.ids.shape[0]:
            window = torch.from_numpy(self.ids[self.next_step, self.rows].astype("int64"))
            self.next_step += 1
            yield {"input": window[:, :-1]}, window[:, 1:]

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.next_step = int(state_dict["next_step"])


def _token_loader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs) -> TokenFileLoader:
    """torchtitan's ``build_dataloader_fn``: the token file named by ``training.dataset_path``."""
    return TokenFileLoader(job_config.training.dataset_path, dp_rank, dp_world_size)


class CapturingLogger:
    """torchtitan's metric logger (``BaseLogger`` and kin) wrapped: every ``log(metrics, step)``
    also appends one JSON line to ``path`` with the step, torchtitan's figures under its own
    names, the allocator's peaks since the previous log step (read here, before
    ``MetricsProcessor.log`` resets them), the FLOP count and peak torchtitan's MFU uses, and the
    GPU's name."""

    def __init__(self, inner, path: str | os.PathLike, processor) -> None:
        self.inner, self.path, self.processor = inner, Path(path), processor

    def log(self, metrics: dict, step: int) -> None:
        import torch

        cuda = torch.cuda.is_available()
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()},
                  "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                  "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
                  "num_flops_per_token": self.processor.num_flops_per_token,
                  "gpu_peak_flops": self.processor.gpu_peak_flops,
                  "device_name": self.processor.device_memory_monitor.device_name}
        _append(self.path, record)
        self.inner.log(metrics, step)

    def close(self) -> None:
        self.inner.close()


def _plain(value):
    """A metric as JSON can hold it (torchtitan logs floats, ints and the odd 0-d tensor)."""
    if hasattr(value, "item"):
        return value.item()
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def _append(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def build_capturing_metrics(metrics_path: str | os.PathLike, job_config, parallel_dims, model_args=None, tag=None):
    """torchtitan's ``build_metrics_processor`` with its logger wrapped in ``CapturingLogger``
    (a ``TrainSpec.build_metrics_processor_fn``, ``metrics_path`` bound first)."""
    from torchtitan.components.metrics import build_metrics_processor

    processor = build_metrics_processor(job_config, parallel_dims, model_args, tag)
    processor.logger = CapturingLogger(processor.logger, metrics_path, processor)
    return processor


def register_bench_spec(model_args: dict, metrics_path: str | os.PathLike) -> None:
    """Registers ``etp_qwen3`` (flavor ``bench``): torchtitan's qwen3 ``TrainSpec`` with
    ``model_args`` (``Qwen3ModelArgs`` fields, ``moe_args`` a dict of ``MoEArgs`` fields), the
    token-file loader, no tokenizer or validator, and the capturing metrics processor."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs
    from torchtitan.models.qwen3 import get_train_spec as qwen3_train_spec
    from torchtitan.protocols.train_spec import register_train_spec

    fields = dict(model_args)
    moe = MoEArgs(**fields.pop("moe_args", {}))
    args = Qwen3ModelArgs(**fields, moe_args=moe)
    spec = dataclasses.replace(qwen3_train_spec(), model_args={FLAVOR: args}, build_dataloader_fn=_token_loader,
                               build_tokenizer_fn=None, build_validator_fn=None,
                               build_metrics_processor_fn=partial(build_capturing_metrics, metrics_path))
    register_train_spec(SPEC_NAME, spec)


def main() -> None:
    datasets_status = import_datasets_or_stub()
    bench = json.loads(Path(os.environ["ETP_TITAN_BENCH"]).read_text())
    import torchtitan

    register_bench_spec(bench["model_args"], bench["metrics"])
    _append(Path(bench["metrics"]), {"header": {"torchtitan": getattr(torchtitan, "__version__", None),
                                                "datasets": datasets_status, "model_args": bench["model_args"]}})
    from torchtitan.train import Trainer
    from torchtitan.train import main as titan_main

    titan_main(Trainer)


if __name__ == "__main__":
    main()
