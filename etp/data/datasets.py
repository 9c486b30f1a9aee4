"""A recipe's megatron-core GPT datasets and how data-parallel ranks read them.

* ``gpt_dataset_config``: megatron-core's ``GPTDatasetConfig`` of a recipe, as Megatron-LM's
  ``core_gpt_dataset_config_from_args`` fills it (seed, sequence length, blend or a blend per
  split, split, index cache, tokenizer, the per-document switches).
* ``build_datasets``: megatron-core's ``BlendedMegatronDatasetBuilder`` over ``GPTDataset`` (or
  ``MockGPTDataset``), sized like Megatron-LM (train: ``train_iters x global batch`` samples,
  valid: ``(train_iters // eval_interval + 1) x eval_iters`` global batches, test: ``eval_iters``).
  The ``.bin`` files are memory-mapped: no rank holds the corpus. Every rank builds its datasets
  (rank 0 first, which writes the index cache; megatron-core's own order) and reads its own
  samples, so tensor-parallel peers read the same samples without a broadcast.
* ``pretraining_sampler``: Megatron-LM's ``MegatronPretrainingSampler``
  ([Note: consumed samples]).

[Note: consumed samples]
A dataset's samples are read in order, one global batch after another, starting at the samples
the run has consumed (saved in every checkpoint). Each micro-batch takes the next
``micro_batch_size x data_parallel_size`` samples, data-parallel rank ``r`` the ``r``-th
``micro_batch_size`` of them. So a global batch is the same samples at any data-parallel layout
of the same global batch size, and a run resumed from a checkpoint, at any layout, reads exactly
the samples the uninterrupted run would have read.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["build_datasets", "dataset_sizes", "gpt_dataset_config", "pretraining_sampler"]


def gpt_dataset_config(recipe, tokenizer):
    """megatron-core's ``GPTDatasetConfig`` of ``recipe`` (prefixes resolved like every recipe path,
    ``etp.data.checks.resolve_prefix``). The attention mask is not built by the dataset: etp builds
    it on the device ([Note: per-document masks]).

    Example::

        config = gpt_dataset_config(recipe, build_tokenizer("NullTokenizer", None, recipe.model.vocab_size))
    """
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from etp.data.checks import resolve_prefix

    d = recipe.data

    def resolved(key, blend):
        if blend is None:
            return None
        prefixes, weights = blend
        return [resolve_prefix(recipe, key, p) for p in prefixes], None if weights is None else list(weights)

    blend = resolved("data_path", d.blend)
    per_split = [resolved(f"{s}_data_path", d.split_blend(s)) for s in ("train", "valid", "test")]
    cache = None if d.data_cache_path is None else str(Path(d.data_cache_path).expanduser().resolve())
    return GPTDatasetConfig(
        random_seed=recipe.train.seed, sequence_length=recipe.model.seq_length, blend=blend,
        blend_per_split=per_split if any(per_split) else None, split=d.split if blend is not None else None,
        path_to_cache=cache, mmap_bin_files=True, tokenizer=tokenizer,
        reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss, create_attention_mask=False)


def dataset_sizes(recipe, global_batch_size: int) -> list[int]:
    """Samples of the train, valid and test datasets (Megatron-LM's ``train_valid_test_num_samples``)."""
    d, t = recipe.data, recipe.train
    evaluations = t.train_iters // d.eval_interval + 1
    return [t.train_iters * global_batch_size, evaluations * d.eval_iters * global_batch_size,
            d.eval_iters * global_batch_size]


def build_datasets(recipe, tokenizer, global_batch_size: int) -> list:
    """The recipe's ``[train, valid, test]`` datasets (None for a split without data); a collective
    over the world when ``torch.distributed`` is initialized (every rank calls it).

    Example::

        train, valid, test = build_datasets(recipe, tokenizer, recipe.global_batch_size(world))
        train[0]["tokens"], train[0]["labels"], train[0]["loss_mask"], train[0]["position_ids"]
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    cls = MockGPTDataset if recipe.data.mock_data else GPTDataset
    config = gpt_dataset_config(recipe, tokenizer)
    return BlendedMegatronDatasetBuilder(cls, dataset_sizes(recipe, global_batch_size), lambda: True,
                                         config).build()


def pretraining_sampler(total_samples: int, consumed_samples: int, micro_batch_size: int,
                        data_parallel_rank: int, data_parallel_size: int):
    """Megatron-LM's ``MegatronPretrainingSampler`` ([Note: consumed samples]): this rank's sample
    indices of each micro-batch, from ``consumed_samples`` on (incomplete last batches dropped).

    Example::

        next(iter(pretraining_sampler(100, 16, 2, 1, 4)))   # [18, 19]
    """
    if not 0 <= consumed_samples < total_samples:
        raise ValueError(f"the dataset holds {total_samples} samples and the run has consumed {consumed_samples}: "
                         "a resumed run needs the dataset it was started with (same train_iters and global batch)")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank {data_parallel_rank} is not below data_parallel_size {data_parallel_size}")
    per_step = micro_batch_size * data_parallel_size
    first = data_parallel_rank * micro_batch_size
    return (list(range(start + first, start + first + micro_batch_size))
            for start in range(consumed_samples, total_samples - per_step + 1, per_step))
