"""What etp-train trains on, against megatron-core's ``GPTDataset`` itself: the micro-batches each
data-parallel rank reads (a weighted blend of two prefixes, a train / valid / test split, document
masks, reset positions) equal the samples megatron-core's builder yields for the same
configuration, in Megatron-LM's sampler order; a run resumed from its consumed samples at another
data-parallel layout reads the global batches the uninterrupted run read."""
from pathlib import Path

import pytest
import torch
from data_cases import EOD, VOCAB, data_recipe, documents, megatron_null_tokenizer, write_dataset
from harness import run_distributed

pytest.importorskip("megatron.core")
MICRO, SEQ, GBS, ITERS = 2, 16, 8, 10


def _megatron_reference(tmp: Path, prefixes, reset: bool):
    """megatron-core's own datasets of the configuration (built here, not through etp), with the
    attention mask megatron-core builds itself."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    tokenizer = megatron_null_tokenizer(VOCAB)
    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, blend=(prefixes, [0.3, 0.7]), split="80,15,5",
                              path_to_cache=str(tmp / "reference_cache"), tokenizer=tokenizer,
                              reset_position_ids=reset, reset_attention_mask=reset, eod_mask_loss=reset,
                              create_attention_mask=True)
    evaluations = ITERS // 5 + 1  # Megatron-LM's train_valid_test_num_samples, eval_interval 5, eval_iters 2
    sizes = [ITERS * GBS, evaluations * 2 * GBS, 2 * GBS]
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def _read(tmp, prefixes, reset, workers, iterations, consumed, rank, dp, device, check=True):
    """Data-parallel rank ``rank`` of ``dp``: its micro-batches of ``iterations`` train iterations
    (from ``consumed``) and of one validation, each checked against megatron-core's samples of the
    same positions; returns the token rows of each train micro-batch."""
    from etp.train.batches import train_batches

    recipe = data_recipe(tmp, data_path=[0.3, prefixes[0], 0.7, prefixes[1]], num_workers=workers,
                         reset_position_ids=reset, reset_attention_mask=reset, eod_mask_loss=reset)
    micro = GBS // (MICRO * dp)
    train, valid, test = train_batches(recipe, rank, dp, device, micro, {"train": consumed, "valid": 0})
    reference = _megatron_reference(tmp, prefixes, reset) if check else None
    got = []
    for iteration in iterations:
        for m in range(micro):
            batch = train.get(iteration, m)
            assert train.get(iteration, m) is batch  # asked again (a capture's first batch): the same
            first = consumed + (iteration - iterations[0]) * GBS + m * MICRO * dp + rank * MICRO
            if check:
                _same(batch, [reference[0][first + j] for j in range(MICRO)], reset)
            got.append([tuple(row.tolist()) for row in batch.tokens])
    for m in range(micro):  # the valid split, from its first sample
        batch = valid.next()
        if check:
            _same(batch, [reference[1][m * MICRO * dp + rank * MICRO + j] for j in range(MICRO)], reset)
    assert test is not None and train.consumed_samples == consumed + len(iterations) * GBS
    return got


def _two_ranks(ctx, tmp, prefixes):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    _read(tmp, prefixes, True, 0, [0, 1, 2], 0, rank, dp, ctx.device)  # document masks
    _read(tmp, prefixes, False, 0, [0, 1, 2], 0, rank, dp, ctx.device)  # causal, positions 0 .. s-1
    ps.destroy_model_parallel()
    return True


def _same(batch, want, reset: bool) -> None:
    assert torch.equal(batch.tokens, torch.stack([w["tokens"] for w in want]))
    assert torch.equal(batch.labels, torch.stack([w["labels"] for w in want]))
    assert torch.equal(batch.loss_mask, torch.stack([w["loss_mask"] for w in want]))
    if reset:
        assert torch.equal(batch.position_ids, torch.stack([w["position_ids"] for w in want]))
        from etp.data.batch import mask_from_document_ids

        # The batch carries document ids; the mask they stand for is megatron-core's dataset mask.
        assert batch.attention_mask.dtype == torch.int32 and batch.attention_mask.shape == batch.tokens.shape
        assert torch.equal(mask_from_document_ids(batch.attention_mask), torch.stack([w["attention_mask"] for w in want]))
        assert (batch.tokens == EOD).any() and not batch.loss_mask.all()  # the masks were exercised
    else:
        assert batch.position_ids is None and batch.attention_mask is None  # 0 .. s-1, causal


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blend")
    # Documents shorter than a sample: every sample crosses a document boundary.
    return tmp, [write_dataset(tmp / "a", documents(150, seed=1, longest=12)),
                 write_dataset(tmp / "b", documents(200, seed=2, longest=12))]


def test_batches_equal_megatron_core_gpt_dataset(blend):
    """On 2 gloo ranks: with per-document masks and positions, and without."""
    tmp, prefixes = blend
    assert run_distributed(_two_ranks, 2, tmp, prefixes) == [True, True]


def test_resumed_at_another_layout_reads_the_uninterrupted_runs_samples(blend):
    """Data-parallel 2 reads iterations 0-5; data-parallel 4, resumed from the samples consumed by
    iteration 3, reads iterations 3-5: per iteration, the same samples (their tokens), spread over
    other ranks, read by two loader workers each and checked against megatron-core's samples.
    (In one process: each rank's reader alone; the harness's ranks may not fork workers.)"""
    import torch.distributed as dist

    tmp, prefixes = blend
    cpu = torch.device("cpu")
    # megatron-core's BlendedDataset asks for the rank when it writes its index cache: a group of one.
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)

    def per_iteration(dp, iterations, consumed, workers=0):
        ranks = [_read(tmp, prefixes, False, workers, iterations, consumed, r, dp, cpu, check=workers > 0)
                 for r in range(dp)]
        step = len(ranks[0]) // len(iterations)
        return [sorted(row for r in ranks for rows in r[k * step:(k + 1) * step] for row in rows)
                for k in range(len(iterations))]

    try:
        assert per_iteration(2, list(range(6)), 0)[3:] == per_iteration(4, [3, 4, 5], 3 * GBS, workers=2)
    finally:
        dist.destroy_process_group()


def test_pretraining_sampler_is_megatron_lms():
    from etp.data.datasets import pretraining_sampler

    # Megatron-LM's MegatronPretrainingSampler(total 20, consumed 4, micro 2, rank 1 of 3)
    assert list(pretraining_sampler(20, 4, 2, 1, 3)) == [[6, 7], [12, 13]]
    with pytest.raises(ValueError, match="consumed 20"):
        pretraining_sampler(20, 20, 2, 0, 1)


def test_loader_workers_outlive_a_sigterm(blend, tmp_path):
    """A preemption signals every process of the job: the rank's loader workers must outlive it
    (the rank's own handler saves and exits, [Note: early exits]), and the batches after it are
    the ones the run would have read."""
    import os
    import signal

    import torch.distributed as dist

    from etp.train.batches import train_batches

    tmp, prefixes = blend
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        def reader(workers):
            recipe = data_recipe(tmp, data_path=[0.3, prefixes[0], 0.7, prefixes[1]], num_workers=workers)
            return train_batches(recipe, 0, 1, torch.device("cpu"), GBS // MICRO, {"train": 0, "valid": 0})[0]

        signalled, plain = reader(1), reader(0)
        first = signalled.get(0, 0)
        for worker in signalled._samples._workers:
            os.kill(worker.pid, signal.SIGTERM)
            worker.join(timeout=1)  # a worker that dies of it is gone by now
            assert worker.is_alive()
        assert torch.equal(first.tokens, plain.get(0, 0).tokens)
        for m in range(1, GBS // MICRO):
            assert torch.equal(signalled.get(0, m).tokens, plain.get(0, m).tokens)
    finally:
        dist.destroy_process_group()
