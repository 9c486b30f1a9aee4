"""etp's stream discipline on CPU, under the stream model (tests/stream_model.py): training
with prefetch and async reduce-scatters matches an unsharded model while every side-stream
access is checked against the events etp records; a side stream that skips its wait is
caught; and the model itself catches each kind of unordered access."""
import pytest
import torch
from harness import backend, run_distributed
from parity import train_parity
from stream_model import StreamModel, UnorderedAccess, installed
from test_async import _async_equals_sync

import etp.streams as streams
from etp import ETPConfig

CPU = torch.device("cpu")


# ---------------------------------------------------------------- the model itself
def _side_streams():
    return streams.StreamRegistry().get("eager", (0, 1), CPU)


def test_a_side_stream_reads_a_tensor_only_as_of_its_last_wait():
    with installed():
        comm = _side_streams()
        shard = torch.zeros(4)
        shard.add_(1)  # the optimizer's update, on the compute stream
        with pytest.raises(UnorderedAccess, match=r"a read without a wait: stream 'ag:eager\[0, 1\]' reads"):
            with comm.use(comm.ag):
                shard.clone()
        streams.CommStreams.wait(comm.ag, streams.current_stream_event(CPU))
        with comm.use(comm.ag):
            shard.clone()  # ordered now
            read = streams.current_stream_event(CPU)
        with pytest.raises(UnorderedAccess, match="a write without a wait: stream 'compute' writes"):
            shard.add_(1)  # the next update, while the AG stream may still be reading
        streams.current_stream(CPU).wait_event(read)
        shard.add_(1)  # a newer update: the AG stream's view is stale again
        with pytest.raises(UnorderedAccess, match="compute' wrote in op"):
            with comm.use(comm.ag):
                shard.clone()
        with comm.use(comm.ag):
            shard.detach().view(2, 2)  # views access nothing


def test_the_compute_stream_reads_side_stream_results_only_after_waiting():
    with installed() as model:
        comm = _side_streams()
        with comm.use(comm.rs):
            result = torch.ones(3) * 2  # a new storage, written on the RS stream
            done = streams.current_stream_event(CPU)
        with pytest.raises(UnorderedAccess, match="stream 'compute' reads"):
            result.sum()
        streams.current_stream(CPU).wait_event(done)
        assert result.sum().item() == 6
        assert model.compute.waits == 1


def test_a_side_stream_may_not_overwrite_what_the_compute_stream_still_reads():
    with installed():
        comm = _side_streams()
        buffer = torch.ones(2, 2)
        streams.CommStreams.wait(comm.ag, streams.current_stream_event(CPU))
        with comm.use(comm.ag):
            buffer.fill_(3.0)  # a gather into the buffer
            gathered = streams.current_stream_event(CPU)
        streams.current_stream(CPU).wait_event(gathered)
        buffer.mm(buffer)  # the GEMM reads it, after the wait
        with pytest.raises(UnorderedAccess, match=r"a write without a wait.*compute' read in op"):
            with comm.use(comm.ag):
                buffer.fill_(4.0)  # the next gather into it, before the GEMM is known done


def test_dropped_waits_are_ignored_only_on_the_named_streams():
    with installed(StreamModel(drop_waits_on=("ag",))):
        comm = _side_streams()
        shard = torch.zeros(4).add_(1)
        for stream in (comm.ag, comm.rs):
            streams.CommStreams.wait(stream, streams.current_stream_event(CPU))
        with comm.use(comm.rs):
            shard.clone()
        with pytest.raises(UnorderedAccess), comm.use(comm.ag):
            shard.clone()


def test_every_binding_of_the_seam_in_etp_is_patched_and_restored():
    import sys

    originals = (streams.current_stream_event, streams.current_stream)

    def unpatched():
        return sorted(f"{name}.{fn.__name__}" for name, module in list(sys.modules.items())
                      if name == "etp" or name.startswith("etp.")
                      for fn in originals if fn in vars(module).values())

    with installed():
        assert unpatched() == []
        import etp.gather_side as gather_side
        assert gather_side.current_stream_event(CPU) is not None
    assert "etp.gather_side.current_stream_event" in unpatched()
    assert streams.StreamRegistry().get("eager", (0, 1), CPU).ag is None  # CPU streams again


# ---------------------------------------------------------------- etp under the model
def _outcome(run):
    """``run()``'s result, or the message of the check that failed in it (so that each test
    below reports its own failure). Both exceptions come at the same point of every rank's
    program (an unordered access: same program; a parity check: after the last collective),
    so the ranks stay in step for the next check."""
    try:
        return run()
    except (UnorderedAccess, AssertionError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _etp_under_the_model(ctx):
    """Every check in one spawn (start-up costs more than the checks)."""
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)
    assert config.prefetch and config.async_reduce
    results = {}
    with installed() as model:
        results["train"] = _outcome(lambda: train_parity(ctx, config, steps=6))
    results["streams"] = {kind: tuple(sum(counts) for counts in zip(*[(s.ops, s.waits) for s in model.side_streams
                                                                      if s.name.startswith(kind)]))
                          for kind in ("ag", "rs")}
    results["compute waits"] = model.compute.waits
    with installed():  # gather_reuse "step": gathers kept across passes, re-issued after the step
        results["async"] = _outcome(lambda: _async_equals_sync(ctx, dict(gather_reuse="step"), after_step=True))
    # Negative controls: the same training with a side stream's waits ignored, as if the
    # CommStreams.wait line were deleted.
    for prefix in ("ag", "rs"):
        with installed(StreamModel(drop_waits_on=(prefix,))):
            results[f"without {prefix} waits"] = _outcome(lambda: train_parity(ctx, config, steps=3))
    return results


@pytest.fixture(scope="module")
def under_the_model():
    if backend() != "gloo":
        pytest.skip("the model stands in for CUDA streams on CPU; under NCCL the real ones run")
    return run_distributed(_etp_under_the_model, 2)


def test_training_with_prefetch_and_async_reduce_matches_the_unsharded_model(under_the_model):
    for rank in under_the_model:
        assert isinstance(rank["train"], dict), rank["train"]  # train_parity checks 1e-9 itself
        # The model saw the side streams work and wait: the parity above was checked, not vacuous.
        (ag_ops, ag_waits), (rs_ops, rs_waits) = rank["streams"]["ag"], rank["streams"]["rs"]
        assert ag_ops > 0 and ag_waits > 0 and rs_ops > 0 and rs_waits > 0, rank["streams"]
        assert rank["compute waits"] > 0


def test_async_with_step_reuse_equals_sync_under_the_model(under_the_model):
    for rank in under_the_model:
        assert not isinstance(rank["async"], str), rank["async"]
        assert rank["async"] > 0  # gathers were prefetched


@pytest.mark.parametrize("prefix", ["ag", "rs"])
def test_a_side_stream_that_skips_its_wait_is_caught(under_the_model, prefix):
    for rank in under_the_model:
        message = rank[f"without {prefix} waits"]
        assert isinstance(message, str), f"nothing caught with the {prefix} waits dropped"
        assert message.startswith("UnorderedAccess") and f"stream '{prefix}:eager" in message, message
