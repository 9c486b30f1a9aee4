"""``train()``: one rank of an etp-train run, as a loop over iterations.

Each iteration runs the recipe's micro-batches (eagerly, or replaying the captured step of
``cuda_graph: step``), the optimizer step, a validation and a checkpoint when due, and the log
window; after the last, the validation and test losses (``etp.train.evaluation``).
Everything else lives in the components: set-up (``setup.py``), checkpoints
(``checkpointing.py``), reporting (``reporting.py``).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from etp.groups import new_process_group
from etp.train.checkpointing import Checkpointing
from etp.train.options import RunOptions
from etp.train.reporting import Reporter, StartupClock, fp8_eager_hint, param_bits_sum
from etp.train.schedule import OptimizerSchedule
from etp.train.setup import Run, quiesce, set_up

__all__ = ["train"]


@dataclass
class _Instruments:
    """What the options add around the loop: memory audit, timeline, profiler."""

    audit: object = None
    timeline: object = None
    profiler: object = None

    def phase(self, name: str):
        """``etp::<name>`` profiler range + the audit's phase + the timeline's mark."""
        stack = contextlib.ExitStack()
        stack.enter_context(record_function(f"etp::{name}"))
        if self.audit is not None:
            stack.enter_context(self.audit.phase(name))
        if self.timeline is not None:
            stack.enter_context(self.timeline.phase(name))
        return stack


def _instruments(run: Run, options: RunOptions, iterations: int) -> _Instruments:
    found = _Instruments()
    if options.audit_path:
        from etp.audit import MemoryAudit

        found.audit = MemoryAudit(run.stepper.model, run.stepper.optimizer, run.device)
    if options.timeline:
        from etp.train.timeline import HostLeadTimeline

        found.timeline = HostLeadTimeline(run.device)  # its first window (warm-up) is not reported
    if options.profile_dir:
        from etp.train.profile import TrainingProfiler

        found.profiler = TrainingProfiler(options.profile_dir, run.rank, iterations, run.device.type == "cuda",
                                          run.stepper.model)
    return found


def _announce(run: Run, recipe, flops: float, peak: float | None) -> None:
    if run.rank != 0:
        return
    fsdp = ("; torch FSDP2 over the data-parallel ranks" if recipe.parallel.use_torch_fsdp2 else
            "; Megatron-FSDP (optim_grads_params) over the data-parallel ranks" if recipe.parallel.use_megatron_fsdp
            else "")
    print(f"etp-train: {recipe.source or 'recipe'} on {run.world} ranks ({run.backend}); {run.summary}{fsdp}; attention "
          f"{recipe.model.attention_backend}; {flops / 1e12:.2f} TFLOP per iteration per rank, "
          f"peak {peak or 'unknown'} TFLOP/s" + ("; deterministic" if run.determinism else ""), flush=True)
    hint = fp8_eager_hint(recipe, run.device.type)
    if hint:
        print(hint, flush=True)
    if getattr(run.stepper, "bf16_grads", False) and not recipe.parallel.grad_reduce_in_bf16:
        print("etp-train: gradients kept in bf16 and read in place by etp's AdamW: one rank and one micro-batch "
              "reduce and accumulate nothing, so fp32 would hold the same values (2 bytes a parameter less)",
              flush=True)
    if recipe.data.reset_attention_mask:  # [Note: document attention]
        from etp.megatron.document_attention import ineligible_reason

        s = recipe.model.seq_length
        why = ineligible_reason(run.device.type, recipe.model.attention_dropout, s, s)
        print("etp-train: reset_attention_mask: per-document attention by " +
              ("FlexAttention under the documents' block mask" if why is None else
               f"SDPA under the dense block-diagonal mask: {why}"), flush=True)


def _micro_batches(run: Run, recipe, batches, iteration: int, micro: int, tools: _Instruments, graphed):
    """This iteration's forward and backward passes; the data-parallel-local mean loss."""
    total = torch.zeros((), device=run.device)
    contexts = run.stepper.microbatches(micro)  # zeroes the gradients
    for index, context in enumerate(contexts):
        if graphed is not None:
            # The replay adds this micro-batch's gradients into main_grad; DDP's reductions
            # start in finalize (overlap_grad_reduce is off with graphs), so no no_sync here.
            total += graphed(*batches.get(iteration, index).tensors()) / micro
            continue
        with context:
            with tools.phase("forward"):
                loss, objective = run.loss_fn(run.stepper.model, batches.get(iteration, index))
            with tools.phase("backward"):
                (objective / micro).backward()
        total += loss.detach() / micro
    return total


def train(rank: int, world: int, recipe, options: RunOptions | None = None, port: int | None = None) -> list[float]:
    """One rank of a run; returns the data-parallel mean loss of every iteration it ran.

    Rank 0 prints a log line every ``log_interval`` iterations and writes the report
    (``options.json_path``); see ``RunOptions`` for the rest.

    Example::

        losses = train(0, 1, Recipe.from_yaml("recipes/tiny_moe_cpu.yaml", world_size=1), RunOptions())
    """
    from megatron.core import parallel_state as ps

    from etp.train.batches import train_batches
    from etp.train.flops import peak_tflops, training_flops

    options = options or RunOptions()
    clock = StartupClock()
    recipe = _resolved(recipe, rank, world)
    run = set_up(recipe, rank, world, port, clock)
    micro = recipe.num_microbatches(run.world)
    flops = training_flops(recipe, micro * recipe.train.micro_batch_size * recipe.model.seq_length)
    peak = recipe.train.peak_tflops or peak_tflops(torch.cuda.get_device_name() if run.device.type == "cuda" else None)
    _announce(run, recipe, flops, peak)
    checkpoints = Checkpointing(recipe, options, run.rank, run.world)
    schedule = OptimizerSchedule(recipe, run.stepper.optimizer, recipe.global_batch_size(run.world))
    start = checkpoints.start(run.stepper, schedule)  # --resume's iteration, or 0 (after finetune's weights)
    readers = train_batches(recipe, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), run.device, micro,
                            checkpoints.consumed_samples(start, recipe.global_batch_size(run.world)))
    batches = readers[0]
    if recipe.train.skip_train:  # [Note: fine-tuning]
        from etp.train.finetune import evaluate_loaded

        losses = [evaluate_loaded(run, recipe, batches, start)]
        quiesce(run)
        ps.destroy_model_parallel()
        return losses
    checkpoints.prepare(start if options.resume else None)
    stop = min(recipe.train.train_iters, options.exit_after or recipe.train.train_iters)
    if start >= stop and run.rank == 0:
        print(f"etp-train: nothing to do: the run is at iteration {start}, its last is {stop}", flush=True)
    tools = _instruments(run, options, max(0, stop - start))
    from etp.train.metrics import MetricsStream

    stream = None if options.json_path is None else str(Path(options.json_path).with_suffix(".jsonl"))
    metrics = MetricsStream.open(recipe, run.rank, jsonl=stream)  # [Note: the metrics stream]
    moe = None
    if recipe.model.is_moe:
        from etp.train.moe_metrics import MoEMetrics

        moe = MoEMetrics.of(run.stepper.model, micro, run.device)  # [Note: MoE metrics]
    reporter = Reporter(recipe, run.rank, run.device, flops, peak, stop=stop, clock=clock, schedule=schedule,
                        metrics=metrics, moe=moe)
    exits = _early_exits(recipe, run)  # [Note: early exits]
    clock.mark("resume" if options.resume else "loop set-up")
    if run.rank == 0:
        print(f"etp-train: {clock.line('set up in')}", flush=True)
    try:
        graphed = None
        for iteration in range(start, stop):
            if recipe.train.cuda_graph == "step" and graphed is None:
                from etp.train.captured_step import capture_step

                # The audit sees the capture's peak (activations into the graph's pool).
                with tools.phase("capture"), clock.timed("capture"):
                    graphed = capture_step(run.stepper.model, run.loss_fn, batches.get(iteration, 0), micro,
                                           run.device)
                if moe is not None:
                    moe.reset()  # the capture's eager warm-ups routed tokens no iteration counts
            total = _micro_batches(run, recipe, batches, iteration, micro, tools, graphed)
            # The optimizer step (finalize, clip, Adam, FP8 re-quantization): post-step hooks go after it.
            norm = run.stepper.step(schedule.lr, tools.phase)
            schedule.step()  # past the step that ran, as Megatron-LM (MegatronStep raises on a skipped one)
            if tools.audit is not None:
                tools.audit.step_done()
            dist.all_reduce(total, group=ps.get_data_parallel_group())
            profiled = tools.profiler is not None and tools.profiler.covers(iteration - start)
            if tools.profiler is not None:
                tools.profiler.step()
            if _validation_due(recipe, iteration + 1):
                _evaluate(run, recipe, readers[1], "valid", iteration + 1, micro, reporter)
            early = exits.reason(iteration + 1)
            reporter.exclude(checkpoints.poll())  # publishes an async save whose writes finished
            if checkpoints.due(iteration + 1, stop) or (early and checkpoints.save_root is not None):
                reporter.exclude(checkpoints.save(run.stepper, iteration + 1, schedule, _consumed(readers)))
            reporter.iteration_done(iteration, total / ps.get_data_parallel_world_size(), norm, profiled,
                                    iteration + 1 == stop or early is not None, tools.timeline)
            if early:
                if run.rank == 0:
                    print(f"etp-train: stopping after iteration {iteration + 1}: {early}"
                          + ("" if checkpoints.save_root is None else f" (saved to {checkpoints.save_root})"),
                          flush=True)
                stop = iteration + 1
                break
        checkpoints.finish_pending()  # an exit waits for the async save in flight, then exits 0
        exits.uninstall()
        if start < stop == recipe.train.train_iters:
            _evaluate(run, recipe, readers[2], "test", stop, micro, reporter)
        _finish(run, recipe, options, tools, reporter, flops, peak)
        metrics.close({"iterations": stop - start, "losses": len(reporter.losses)})
    finally:
        metrics.close()  # a failed run keeps every line it streamed
        reporter.pauses.close()  # a failed run (a --tune candidate) leaves no collector callback behind
        if moe is not None:
            moe.remove()
    ps.destroy_model_parallel()
    return reporter.losses


def _early_exits(recipe, run: Run):
    """The run's ``EarlyExit``, its SIGTERM handler installed; its vote goes over a gloo group
    (the default one on CPU ranks), so it never synchronizes the device."""
    from etp.train.exits import EarlyExit

    t = recipe.train
    votes = t.exit_signal_handler or t.exit_duration_in_mins is not None
    group = new_process_group(backend="gloo") if votes and run.backend != "gloo" else None  # the world's timeout
    exits = EarlyExit(recipe, time.monotonic(), group)
    exits.install()
    return exits


def _validation_due(recipe, done: int) -> bool:
    """Every ``eval_interval`` iterations and after the last (``train_iters``; not at an ``--exit-after``
    stop between intervals): before that iteration's checkpoint, which then holds the valid samples
    consumed, so a resumed run validates on the samples the uninterrupted run would have."""
    return done % recipe.data.eval_interval == 0 or done == recipe.train.train_iters


def _evaluate(run: Run, recipe, batches, split: str, iteration: int, micro: int, reporter: Reporter) -> None:
    """``eval_iters`` global batches of ``split`` (nothing without that split or with eval_iters 0)."""
    from megatron.core import parallel_state as ps

    from etp.train.evaluation import evaluate

    if batches is None or recipe.data.eval_iters == 0:
        return
    began = time.perf_counter()
    loss = evaluate(run.stepper.model, run.loss_fn, batches, recipe.data.eval_iters, micro, run.device,
                    ps.get_data_parallel_group())
    reporter.evaluation_done(split, iteration, loss, time.perf_counter() - began)


def _consumed(readers) -> dict | None:
    """The samples each split's reader has consumed (checkpoint metadata); None for etp's ``data``."""
    from etp.train.batches import DatasetBatches

    if not isinstance(readers[0], DatasetBatches):
        return None
    return {name: reader.consumed_samples for name, reader in zip(("train", "valid"), readers) if reader is not None}


def _resolved(recipe, rank: int, world: int):
    """The recipe with its ``auto`` keys chosen for this machine (etp-train's command line has
    done it already; a caller of ``train`` may not have). [Note: auto settings]"""
    if not recipe.auto and recipe.parallel.world_size is not None:
        return recipe
    from etp.train.auto import Machine, resolve_auto

    gpus = torch.cuda.is_available() and recipe.parallel.backend != "gloo"
    recipe, notes = resolve_auto(recipe, Machine.detect(world) if gpus else Machine(world, world))
    if rank == 0:
        for note in notes:
            print(f"etp-train: {note}", flush=True)
    return recipe


def _finish(run: Run, recipe, options: RunOptions, tools: _Instruments, reporter: Reporter, flops, peak) -> None:
    """The profiler's breakdown, the timeline, the collector's pauses, the report and the memory audit."""
    from etp.train.audit_report import gather_transport_of, write_audit

    breakdown = None
    if tools.profiler is not None:
        from etp.train.profile import format_breakdown, kernel_time_plausible

        breakdown = tools.profiler.finish()
        if breakdown is not None and peak:
            breakdown["kernel_time_plausible"] = kernel_time_plausible(breakdown, flops, peak)
        if run.rank == 0 and breakdown is not None:
            print(format_breakdown(breakdown, f"rank 0, attention {recipe.model.attention_backend}"), flush=True)
    timeline = None
    if tools.timeline is not None:
        from etp.train.timeline import format_spread, format_timeline

        timeline = tools.timeline.summary()
        if timeline is not None:  # every rank's windows: the slowest rank sets each iteration's pace
            timeline["ranks"] = [None] * run.world
            dist.all_gather_object(timeline["ranks"], tools.timeline.windows())
        if run.rank == 0:
            print(format_timeline(timeline), flush=True)
            if timeline is not None:
                print(format_spread(timeline["ranks"]), flush=True)
    gc_ms = reporter.gather_collector_pauses()
    if run.rank == 0 and gc_ms is not None:
        print(f"etp-train: garbage collection {gc_ms:.2f} ms per iteration on the slowest rank", flush=True)
    quiesce(run)
    transport = gather_transport_of(run.stepper.model)
    if options.json_path and run.rank == 0:
        from etp.audit import predict_peak

        # Megatron-FSDP's module holds released parameters between steps: its fp32 shards instead.
        weights = run.stepper.master_weights() if hasattr(run.stepper, "master_weights") else run.stepper.model
        extra = {"flops_per_iter_per_rank": flops, "peak_tflops": peak, "determinism": run.determinism,
                 "attention_backend": recipe.model.attention_backend, "profile": breakdown,
                 # etp-audit's, to compare (with the gather transport this run chose)
                 "predicted_peak_gib": None if recipe.parallel.fsdp_peer  # the audit models DDP and ETP
                 else predict_peak(recipe, run.world, transport=transport)["peak"] / 2**30,
                 "param_bits_sum": param_bits_sum(weights),
                 "stepper": type(run.stepper).__name__,  # TorchStep | MegatronStep | FSDP2Step | MegatronFSDPStep
                 "timeline": timeline,
                 "gc_ms_per_iter_max_rank": gc_ms}
        reporter.write_json(options.json_path, run.world, run.backend, run.summary, extra)
    if tools.audit is not None:
        write_audit(options.audit_path, tools.audit, recipe, run.world, run.rank, transport)
