"""etp-train's data: the micro-batches of each iteration, as ``etp.data.batch.Batch`` on the device.

* ``DatasetBatches``: a megatron-core dataset (``data_path``, a path per split, ``mock_data``)
  read in order through a ``torch.utils.data.DataLoader`` with Megatron-LM's pretraining sampler
  from the consumed samples on ([Note: consumed samples]); the per-document attention mask is
  built on the device ([Note: per-document masks]).
* ``Batches``: etp's own ``data`` key: random windows of a text file's bytes (memory-mapped) or
  synthetic ids. Every sample depends only on (seed, iteration, its index in the global batch),
  so a resumed run reads what the uninterrupted run would have read, at any layout.
"""
from __future__ import annotations

import multiprocessing
import signal

import torch

from etp.data.batch import Batch, document_ids
from etp.streams import to_device_async

__all__ = ["Batches", "DatasetBatches", "train_batches"]


class Batches:
    """Random windows of the corpus (bytes), or synthetic tokens (etp's ``data`` key)."""

    def __init__(self, recipe, rank: int, device, microbatches: int) -> None:
        import numpy

        path = recipe.resolve_data_path()
        self.data = None if path is None else numpy.memmap(path, dtype=numpy.uint8, mode="r")
        self.seed, self.rank, self.microbatches = recipe.train.seed, rank, microbatches
        self.rows, self.width = recipe.train.micro_batch_size, recipe.model.seq_length + 1
        self.vocab, self.device = recipe.model.vocab_size, device

    def _sample(self, iteration: int, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((self.seed, iteration, index)) % 2**63)
        if self.data is None:
            return torch.randint(0, self.vocab, (self.width,), generator=gen)
        start = int(torch.randint(0, self.data.shape[0] - self.width, (1,), generator=gen))
        return torch.from_numpy(self.data[start : start + self.width].astype("int64"))

    def get(self, iteration: int, micro: int) -> Batch:
        first = (self.rank * self.microbatches + micro) * self.rows
        batch = torch.stack([self._sample(iteration, first + j) for j in range(self.rows)])
        # Without waiting: a pageable copy would wait for the GPU to finish the previous
        # microbatch before this one's forward could be queued.
        ids = to_device_async(batch, self.device)
        return Batch(tokens=ids[:, :-1], labels=ids[:, 1:])


def _ignore_sigterm(_worker_id: int) -> None:
    """A data-loader worker outlives a SIGTERM: a preemption signals every process of the job, and
    a worker dying of it would fail its rank ("DataLoader worker ... killed by signal") before the
    rank's own handler saves and exits ([Note: early exits]). The rank ends its workers itself."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class DatasetBatches:
    """One split of a megatron-core dataset, read micro-batch after micro-batch.

    Args:
        dataset: a ``GPTDataset`` / ``BlendedDataset`` (``etp.data.datasets.build_datasets``).
        recipe: the run's (micro-batch size, workers, per-document switches).
        data_parallel_rank, data_parallel_size: this rank's place among the readers.
        consumed_samples: the samples earlier runs (a checkpoint) consumed.
        eod: the tokenizer's end-of-document id (for ``reset_attention_mask``).

    ``get`` is called in order (the same micro-batch twice returns it again).

    Example::

        batches = DatasetBatches(train, recipe, dp_rank, dp_size, device, consumed_samples=0, eod=tokenizer.eod)
        batch = batches.get(0, 0)
    """

    def __init__(self, dataset, recipe, data_parallel_rank: int, data_parallel_size: int, device,
                 consumed_samples: int = 0, eod: int | None = None) -> None:
        from etp.data.datasets import pretraining_sampler

        d = recipe.data
        self.device, self.eod = device, eod
        self.reset_attention_mask, self.reset_position_ids = d.reset_attention_mask, d.reset_position_ids
        self.per_micro_batch = recipe.train.micro_batch_size * data_parallel_size
        self.consumed_samples = consumed_samples
        sampler = pretraining_sampler(len(dataset), consumed_samples, recipe.train.micro_batch_size,
                                      data_parallel_rank, data_parallel_size)
        workers = d.num_workers
        # Forked workers share the rank's memory maps; etp-train's CPU ranks are spawned, which would
        # make spawning (re-importing, re-opening everything) the workers' default too.
        fork = "fork" if workers and "fork" in multiprocessing.get_all_start_methods() else None
        self._loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                                   pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                                                   multiprocessing_context=fork, worker_init_fn=_ignore_sigterm)
        self._samples = None  # the loader's iterator, started (its workers too) at the first read
        self._last = None  # ((iteration, micro), batch)
        self.total_samples = len(dataset)

    def next(self) -> Batch:
        """The next micro-batch (this rank's rows of it)."""
        if self._samples is None:
            self._samples = iter(self._loader)
        try:
            sample = next(self._samples)
        except StopIteration:
            raise ValueError(f"the dataset's {self.total_samples} samples are all consumed: the run reads more than "
                             "it was built for (train_iters x global_batch_size; a resumed run needs the recipe it "
                             "started with)") from None
        self.consumed_samples += self.per_micro_batch
        move = (lambda t: t.to(self.device, non_blocking=True)) if self.device.type == "cuda" else (lambda t: t)
        tokens = move(sample["tokens"])
        return Batch(tokens=tokens, labels=move(sample["labels"]), loss_mask=move(sample["loss_mask"]),
                     attention_mask=document_ids(tokens, self.eod) if self.reset_attention_mask else None,
                     position_ids=move(sample["position_ids"]) if self.reset_position_ids else None)

    def get(self, iteration: int, micro: int) -> Batch:
        if self._last is not None and self._last[0] == (iteration, micro):
            return self._last[1]
        batch = self.next()
        self._last = ((iteration, micro), batch)
        return batch


def train_batches(recipe, data_parallel_rank: int, data_parallel_size: int, device, microbatches: int,
                  consumed: dict | None = None):
    """The run's ``(train, valid, test)`` readers: ``Batches`` (etp's ``data`` key; no valid or test),
    or ``DatasetBatches`` of megatron-core datasets, from the ``consumed`` samples of a checkpoint
    (``{"train": n, "valid": m}``). A collective over the world for datasets.

    Example::

        train, valid, test = train_batches(recipe, dp_rank, dp_size, device, micro)
    """
    if not recipe.data.has_dataset:
        return Batches(recipe, data_parallel_rank, device, microbatches), None, None
    from etp.data.checks import resolve_recipe_path
    from etp.data.datasets import build_datasets
    from etp.data.tokenizer import build_tokenizer

    d, consumed = recipe.data, consumed or {}
    model = None if d.tokenizer_model is None else resolve_recipe_path(recipe, "tokenizer_model", d.tokenizer_model)
    tokenizer = build_tokenizer(d.tokenizer_type, model, recipe.model.vocab_size)
    gbs = recipe.train.micro_batch_size * data_parallel_size * microbatches
    splits = build_datasets(recipe, tokenizer, gbs)
    readers = []
    for name, dataset in zip(("train", "valid", "test"), splits):
        evaluated = name == "train" or d.eval_iters > 0
        readers.append(None if dataset is None or len(dataset) == 0 or not evaluated else
                       DatasetBatches(dataset, recipe, data_parallel_rank, data_parallel_size, device,
                                      consumed.get(name, 0), tokenizer.eod))
    return tuple(readers)
