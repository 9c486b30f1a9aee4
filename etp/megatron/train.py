"""etp-train: train a recipe with ETP (``etp-train --recipe FILE`` or ``python -m etp.megatron.train``).

* Without GPUs (recipe ``backend: gloo``, or no CUDA): spawns ``world_size`` gloo ranks on
  loopback and trains ``TinyMoELM`` (megatron-core TP linears, etp grouped experts) on the
  recipe's corpus, read as bytes.
* Under ``torchrun`` with GPUs: builds megatron-core's ``GPTModel`` with etp's grouped experts
  (bf16 through ``Float16Module`` when the recipe says ``bf16: true``), on synthetic tokens
  or the corpus.

Both apply ETP (``etp.megatron.model.apply_etp``) and follow the recipe's warm-up + decay
schedule. On GPUs the model is wrapped in megatron-core DDP (``ETPDistributedDataParallel``
with ETP weights) and stepped by megatron-core's Adam (``get_etp_megatron_optimizer``:
mixed precision with fp32 main params and grads, distributed optimizer when the recipe asks,
grad-norm clipping counting every element once, FP8 shards re-quantized after each step).
On CPU (megatron-core's DDP and optimizer need CUDA) torch AdamW steps the model after
``etp.finalize_grads`` and ``etp.clip_grad_norm_``. Every ``log_interval`` iterations: loss,
step time, model TFLOP/s per rank (attention included, see [Note: FLOP count] in
``etp.megatron.flops``), MFU against the GPU's bf16 peak, and peak memory. ``--profile DIR``
traces a few steady-state iterations and prints where the time goes (``etp.megatron.profile``);
``deterministic: true`` makes reruns bitwise equal (``etp.megatron.reproducible``).

Example::

    etp-train --recipe recipes/tiny_moe_cpu.yaml
    torchrun --nproc-per-node=8 -m etp.megatron.train --recipe recipes/moe_h200x8.yaml
    torchrun --nproc-per-node=2 -m etp.megatron.train --recipe recipes/moe_h200x2_wide.yaml --profile prof
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import queue
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .audit_report import gather_transport_of, write_audit
from .batches import Batches as _Batches  # tests reach it as train._Batches

__all__ = ["main", "train"]


def _parse(argv):
    parser = argparse.ArgumentParser(prog="etp-train", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, help="YAML recipe (see recipes/)")
    parser.add_argument("--train-iters", type=int, help="override the recipe's train_iters")
    parser.add_argument("--log-interval", type=int, help="override the recipe's log_interval")
    parser.add_argument("--json", metavar="PATH", help="write losses, step times, TFLOP/s and peak memory")
    parser.add_argument("--audit", nargs="?", const="etp_audit.json", metavar="PATH",
                        help="record per-phase memory (etp.audit.MemoryAudit), print it against the "
                             "prediction and write every rank's to PATH (default etp_audit.json)")
    parser.add_argument("--resume", nargs="?", const=True, default=False, type=int, metavar="ITERATION",
                        help="continue from the latest checkpoint (or the given iteration's) of the "
                             "recipe's load (or save) directory, at any parallel layout")
    parser.add_argument("--exit-after", type=int, metavar="N",
                        help="stop after iteration N (the learning-rate schedule still spans train_iters)")
    parser.add_argument("--profile", metavar="DIR",
                        help="torch-profile a few steady-state iterations: one Chrome trace per rank in DIR "
                             "and a time breakdown per iteration (printed by rank 0, JSON per rank)")
    parser.add_argument("--timeline", action="store_true",
                        help="unprofiled: per phase, host issue time, device time and how far the device runs "
                             "behind the host (printed by rank 0, 'timeline' in --json)")
    parser.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                        help="bf16 peak TFLOP/s per GPU for MFU (default: the recipe's peak_tflops, else by GPU name)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any recipe key (etp.KEY for the etp section); repeatable")
    return parser.parse_args(argv)


def _silence_fallback_warnings(rank: int) -> None:
    """megatron-core warns once per module and process that neither TransformerEngine nor
    apex is installed; etp needs neither. One line from rank 0 instead."""
    import importlib.util
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated")  # megatron's DCP call
    if rank == 0 and importlib.util.find_spec("apex") is None:
        print("etp-train: NVIDIA apex not found: megatron-core's fallbacks run on torch's foreach "
              "ops and fused Adam (etp.megatron.fast_fallbacks); TransformerEngine is not used", flush=True)


def _lr(recipe, iteration: int) -> float:
    t = recipe.train
    if t.lr_warmup_iters and iteration < t.lr_warmup_iters:
        return t.lr * (iteration + 1) / t.lr_warmup_iters
    span = max(1, (t.lr_decay_iters or t.train_iters) - t.lr_warmup_iters)
    progress = min(1.0, (iteration - t.lr_warmup_iters) / span)
    if t.lr_decay_style == "constant":
        return t.lr
    if t.lr_decay_style == "cosine":
        return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))
    return t.lr - (t.lr - t.min_lr) * progress  # linear (and the rest, approximately)


def _build(recipe, device):
    """(model, ``loss_fn(module, batch)`` of a [b, s+1] token batch, megatron config or None)."""
    from .model import etp_gpt_layer_spec

    m = recipe.model
    if device.type == "cpu":
        from .tiny_lm import TinyMoELM

        torch.manual_seed(recipe.train.seed)
        model = TinyMoELM(recipe)

        def loss_fn(module, batch):
            logits = module(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            return loss, loss + m.moe_aux_loss_coeff * module.aux_loss()

        return model, loss_fn, None
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if recipe.train.bf16 else torch.float32
    model_parallel_cuda_manual_seed(recipe.train.seed)
    torch.manual_seed(recipe.train.seed)
    p = recipe.parallel
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
        num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        # "local" and "etp" are etp's own: megatron builds its alltoall dispatcher, replaced below.
        moe_token_dispatcher_type=("alltoall" if m.moe_token_dispatcher_type in ("local", "etp")
                                   else m.moe_token_dispatcher_type),
        gated_linear_unit=m.swiglu, activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear, normalization=m.normalization,
        init_method_std=m.init_method_std, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, bf16=recipe.train.bf16, params_dtype=dtype,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        sequence_parallel=p.sequence_parallel, use_cpu_initialization=device.type == "cpu",
        deterministic_mode=recipe.train.deterministic, **recipe.recompute_kwargs(),
    )
    spec = etp_gpt_layer_spec(num_experts=m.num_experts, normalization=m.normalization,
                              attention_backend=m.attention_backend)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=recipe.padded_vocab_size,
                     max_sequence_length=m.max_position_embeddings or m.seq_length,
                     position_embedding_type=m.position_embedding_type,
                     share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights).to(device)
    if m.moe_token_dispatcher_type == "local":
        from .local_dispatcher import install_local_dispatchers

        install_local_dispatchers(model)
    elif m.moe_token_dispatcher_type == "etp":
        from .ep_dispatcher import install_etp_dispatchers

        install_etp_dispatchers(model, max_tokens_per_rank=m.seq_length * recipe.train.micro_batch_size)
    if recipe.train.bf16:
        model = Float16Module(config, model)

    def loss_fn(module, batch):
        tokens = batch[:, :-1]
        position_ids = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        loss = module(tokens, position_ids, None, labels=batch[:, 1:]).float().mean()
        return loss, loss  # megatron adds the router's aux loss to the gradient itself

    return model, loss_fn, config


def fp8_eager_hint(recipe, device_type: str) -> str | None:
    """The line etp-train prints when FP8 gathers run in an eager step on CUDA and the recipe
    could be captured as it stands (``cuda_graph: step`` validates), else None.

    An FP8 GEMM issues 2-3 more launches than a bf16 one (the activation quantization, the
    input gradient's weight transpose, the per-expert weight-gradient operands), and an eager
    step of the flagship recipe is bound by its host's launches: eager FP8 trails eager bf16
    there, while captured FP8 leads captured bf16 (BENCHMARKS.md, sessions 14-17).

    Example::

        fp8_eager_hint(Recipe.from_yaml("recipes/moe_h200x8.yaml", etp={"gather_dtype": "fp8_tensorwise"}), "cuda")
    """
    e = recipe.etp
    if (device_type != "cuda" or not e.gather_dtype.startswith("fp8") or recipe.train.cuda_graph == "step"
            or (e.etp_size == 1 and e.expert_etp_size == 1)):
        return None
    try:
        recipe.replace(cuda_graph="step", overlap_grad_reduce=False)
    except ValueError:
        return None  # not capturable as it stands: no advice that would fail
    return (f"etp-train: {e.gather_dtype} gathers in an eager step: each FP8 GEMM issues 2-3 more launches "
            "than a bf16 one, and an eager step is bound by its host; the fast FP8 setting is the captured "
            "step: --set cuda_graph=step --set overlap_grad_reduce=false (BENCHMARKS.md)")


def _host_norm(norm) -> float | None:
    """The step's grad norm (a device tensor from the sync-free step, a float or None from
    megatron's own) as a float; raises on inf / nan, which megatron's bf16 step lets through."""
    if norm is None:
        return None
    value = float(norm.reshape(()).item()) if isinstance(norm, torch.Tensor) else float(norm)
    if not math.isfinite(value):
        raise FloatingPointError(f"the gradient norm is {value}: the step diverged (lower lr or clip_grad)")
    return value


def train(rank: int, world: int, recipe, port: int | None = None, json_path: str | None = None,
          audit_path: str | None = None, resume: bool | int = False, exit_after: int | None = None,
          profile_dir: str | None = None, timeline_on: bool = False) -> list[float]:
    """One rank of a run; returns the data-parallel mean loss of every iteration it ran.
    Rank 0 writes the run's figures to ``json_path`` and, with ``audit_path``, the memory
    audit of every rank (``etp.audit.MemoryAudit``: per-phase peaks, measured vs predicted
    bytes). With ``recipe.train.save`` and ``save_interval`` it checkpoints every
    ``save_interval`` iterations; ``resume`` (True, or an iteration) continues from the latest
    (or that) checkpoint of ``load`` (or ``save``); ``exit_after`` stops after that iteration (the schedule still
    spans ``train_iters``); ``profile_dir`` traces a few steady-state iterations into that
    directory (see ``etp.megatron.profile.TrainingProfiler``); ``timeline_on`` measures, unprofiled,
    how far the device runs behind the host at every phase's end
    (``etp.megatron.timeline.HostLeadTimeline``, [Note: host lead])."""
    _silence_fallback_warnings(rank)
    determinism = None
    if recipe.train.deterministic:  # before any CUDA work: cuBLAS reads its workspace config once
        from .reproducible import enable_determinism

        determinism = enable_determinism()
    from megatron.core import parallel_state as ps

    from .groups import build_megatron_etp_groups
    from .model import apply_etp

    backend = recipe.parallel.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        init = dict(backend=backend, timeout=datetime.timedelta(minutes=10))
        if port is not None:
            init.update(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dist.init_process_group(**init)
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe.check_world_size(world)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    p = recipe.parallel
    ps.initialize_model_parallel(tensor_model_parallel_size=p.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                                 expert_model_parallel_size=p.expert_model_parallel_size,
                                 context_parallel_size=p.context_parallel_size)
    groups = build_megatron_etp_groups(recipe.etp)
    model, loss_fn, config = _build(recipe, device)
    summary = apply_etp(model, recipe.etp, groups)
    tp_group = ps.get_tensor_model_parallel_group()
    from .steppers import MegatronStep, TorchStep

    trainer = TorchStep(recipe, model, groups, tp_group) if config is None else MegatronStep(recipe, model, config)
    if (recipe.train.deterministic and config is not None and recipe.train.cuda_graph != "step"
            and recipe.parallel.tensor_model_parallel_size == 1):
        # The embedding backward a captured step takes (ordered sums, no atomics): eager and
        # captured deterministic runs then run the same kernels ([Note: etp-train graph step]).
        from .graph_step import make_embeddings_capture_safe

        make_embeddings_capture_safe(trainer.model)
    audit = None
    if audit_path:
        from ..audit import MemoryAudit

        audit = MemoryAudit(trainer.model, trainer.optimizer, device)
    timeline = None
    if timeline_on:
        from .timeline import HostLeadTimeline

        timeline = HostLeadTimeline(device)  # its first window (warm-up) is not reported
    phase = _labelled(audit.phase if audit is not None else _no_phase, timeline)
    micro = recipe.num_microbatches(world)
    batches = _Batches(recipe, ps.get_data_parallel_rank(), device, micro)
    tokens_per_iter = micro * recipe.train.micro_batch_size * recipe.model.seq_length
    from .flops import peak_tflops, training_flops

    flops_per_iter = training_flops(recipe, tokens_per_iter)  # attention included: [Note: FLOP count]
    peak = recipe.train.peak_tflops or peak_tflops(torch.cuda.get_device_name() if device.type == "cuda" else None)
    if rank == 0:
        print(f"etp-train: {recipe.source or 'recipe'} on {world} ranks ({backend}); {summary}; attention "
              f"{recipe.model.attention_backend}; {flops_per_iter / 1e12:.2f} TFLOP per iteration per rank, "
              f"peak {peak or 'unknown'} TFLOP/s" + ("; deterministic" if determinism else ""), flush=True)
        hint = fp8_eager_hint(recipe, device.type)
        if hint:
            print(hint, flush=True)
    start = _resume(recipe, trainer, rank, None if resume is True else resume) if resume else 0
    stop = min(recipe.train.train_iters, exit_after or recipe.train.train_iters)
    losses, pending, records, window = [], [], [], time.perf_counter()
    profiler, window_profiled = None, False
    if profile_dir:
        from .profile import TrainingProfiler

        profiler = TrainingProfiler(profile_dir, rank, stop - start, device.type == "cuda", trainer.model)
    graphed = None
    for iteration in range(start, stop):
        total = torch.zeros((), device=device)
        contexts = trainer.microbatches(micro)  # zeroes the gradients
        if recipe.train.cuda_graph == "step" and graphed is None:
            from .graph_step import capture_step

            graphed = capture_step(trainer.model, loss_fn, batches.get(iteration, 0), micro, device)
        for index, context in enumerate(contexts):
            if graphed is not None:
                # The replay adds this micro-batch's gradients into main_grad; DDP's reductions
                # start in finalize (overlap_grad_reduce is off with graphs), so no no_sync here.
                total += graphed(batches.get(iteration, index)) / micro
                continue
            with context:
                with phase("forward"):
                    loss, objective = loss_fn(trainer.model, batches.get(iteration, index))
                with phase("backward"):
                    (objective / micro).backward()
            total += loss.detach() / micro
        # The optimizer step (finalize, clip, Adam, FP8 re-quantization): post-step hooks go after it.
        norm = trainer.step(_lr(recipe, iteration), phase)
        if audit is not None:
            audit.step_done()
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        # Read on the host at log intervals only: a read per iteration would empty the device's
        # queue before every forward ([Note: sync-free step]).
        pending.append(total / ps.get_data_parallel_world_size())
        if profiler is not None:
            window_profiled |= profiler.covers(iteration - start)
            profiler.step()
        last = iteration + 1 == stop
        t = recipe.train
        if t.save and t.save_interval and ((iteration + 1) % t.save_interval == 0 or iteration + 1 == t.train_iters):
            began = time.perf_counter()
            _save(recipe, trainer, iteration + 1, world, rank)
            window += time.perf_counter() - began  # keep the save out of the step time
        if (iteration + 1) % recipe.train.log_interval == 0 or last:
            losses += torch.stack(pending).flatten().tolist()
            pending.clear()
            norm = _host_norm(norm)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if timeline is not None:
                timeline.window_done((iteration % recipe.train.log_interval) + 1)
            elapsed = (time.perf_counter() - window) / ((iteration % recipe.train.log_interval) + 1)
            window = time.perf_counter()
            memory = (f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if device.type == "cuda" else "n/a (CPU)")
            tflops = flops_per_iter / elapsed / 1e12
            mfu = tflops / peak if peak else None
            records.append({"iteration": iteration + 1, "loss": losses[-1], "grad_norm": norm,
                            "ms_per_iter": elapsed * 1e3, "tflops_per_rank": tflops, "mfu": mfu,
                            "profiled": window_profiled})
            window_profiled = False
            if rank == 0:
                print(f"iter {iteration + 1:5d}/{recipe.train.train_iters} | loss {losses[-1]:.4f} | "
                      f"grad norm {'n/a' if norm is None else f'{norm:.3f}'} | {elapsed * 1e3:8.1f} ms/iter | {tflops:7.3f} TFLOP/s/rank | "
                      f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | peak {memory}", flush=True)
    breakdown = None
    if profiler is not None:
        breakdown = profiler.finish()
        if breakdown is not None and peak:
            from .profile import kernel_time_plausible

            breakdown["kernel_time_plausible"] = kernel_time_plausible(breakdown, flops_per_iter, peak)
        if rank == 0 and breakdown is not None:
            from .profile import format_breakdown

            print(format_breakdown(breakdown, f"rank 0, attention {recipe.model.attention_backend}"), flush=True)
    if rank == 0 and timeline is not None:
        from .timeline import format_timeline

        print(format_timeline(timeline.summary()), flush=True)
    _quiesce(trainer, device)
    if json_path and rank == 0:
        from ..audit import predict_peak

        extra = {"flops_per_iter_per_rank": flops_per_iter, "peak_tflops": peak, "determinism": determinism,
                 "attention_backend": recipe.model.attention_backend, "profile": breakdown,
                 # etp-audit's, to compare (with the gather transport this run chose)
                 "predicted_peak_gib": predict_peak(recipe, world, transport=gather_transport_of(trainer.model))["peak"]
                 / 2**30, "param_bits_sum": param_bits_sum(trainer.model),
                 "timeline": timeline.summary() if timeline is not None else None}
        _write_report(json_path, recipe, world, backend, summary, losses, records, device, extra)
    if audit is not None:
        write_audit(audit_path, audit, recipe, world, rank, gather_transport_of(trainer.model))
    ps.destroy_model_parallel()
    return losses


def _quiesce(trainer, device) -> None:
    """Ends the run with nothing in flight: ETP's prefetched gathers discarded, side streams
    idle, every rank past its last collective (NCCL's destroy_process_group hung at exit on
    the GPU machine after checkpoint saves without this)."""
    from ..wrap import _runtime_of

    runtime = _runtime_of(trainer.model)
    if runtime is not None:
        runtime.drain()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _save(recipe, trainer, iteration: int, world: int, rank: int) -> None:
    from .checkpoint import save_training_checkpoint

    p = recipe.parallel
    layout = {"world_size": world, "tensor_model_parallel_size": p.tensor_model_parallel_size,
              "expert_model_parallel_size": p.expert_model_parallel_size,
              "etp_size": recipe.etp.etp_size, "expert_etp_size": recipe.etp.expert_etp_size}
    began = time.perf_counter()
    path = save_training_checkpoint(recipe.train.save, iteration, trainer.model, trainer.optimizer,
                                    {"recipe": str(recipe.source), "layout": layout})
    if rank == 0:
        print(f"etp-train: saved iteration {iteration} to {path} ({time.perf_counter() - began:.1f} s)", flush=True)


def _resume(recipe, trainer, rank: int, iteration: int | None) -> int:
    from .checkpoint import load_training_checkpoint

    root = recipe.train.load or recipe.train.save
    if root is None:
        raise ValueError("--resume needs a checkpoint directory: set the recipe's load (or save) key, "
                         "e.g. --set load=checkpoints")
    iteration, metadata, _ = load_training_checkpoint(root, trainer.model, trainer.optimizer, iteration)
    if rank == 0:
        print(f"etp-train: resumed at iteration {iteration} from {root} (saved with layout "
              f"{metadata.get('layout')})", flush=True)
    return iteration


@contextlib.contextmanager
def _no_phase(name: str):
    yield


def _labelled(phase, timeline=None):
    """``phase`` (the audit's, or none) inside an ``etp::<name>`` profiler range, so a trace
    reads by itself and the breakdown can tell the optimizer's kernels; and inside the
    timeline's mark (``--timeline``, [Note: host lead])."""
    from torch.autograd.profiler import record_function

    @contextlib.contextmanager
    def labelled(name: str):
        with record_function(f"etp::{name}"), phase(name), (
                timeline.phase(name) if timeline is not None else contextlib.nullcontext()):
            yield

    return labelled


def param_bits_sum(model) -> int:
    """Rank 0's parameters as one integer: the sum of every element's bit pattern (int64,
    exact and order-free), so two runs whose parameters are equal bit for bit report the same
    number and nearly any difference changes it (tests compare captured with eager runs)."""
    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    # Summed where the parameters live, in int64 without an int64 copy; one host read.
    sums = [p.detach().contiguous().view(views[p.element_size()]).sum(dtype=torch.int64) for p in model.parameters()]
    return int(torch.stack(sums).sum()) if sums else 0


def _write_report(path, recipe, world, backend, summary, losses, records, device, extra) -> None:
    import json

    # The first window holds warm-up and compilation; profiled windows carry the profiler's overhead.
    steady = [r for r in records[1:] if not r.get("profiled")] or records[1:] or records
    report = {
        "recipe": str(recipe.source), "world_size": world, "backend": backend, "etp": vars(recipe.etp),
        "params": recipe.num_params(), "active_params": recipe.num_params(active=True),
        "param_bytes_per_rank": {"before_etp": summary.bytes_before, "after_etp": summary.bytes_after},
        "losses": losses, "log": records,
        "ms_per_iter": sum(r["ms_per_iter"] for r in steady) / len(steady),
        "tflops_per_rank": sum(r["tflops_per_rank"] for r in steady) / len(steady),
        "mfu": (sum(r["mfu"] for r in steady) / len(steady)) if steady[0]["mfu"] is not None else None,
        "flops_convention": "6 x GEMM weights per token + 12 x layers x heads x kv_channels x seq (full square)",
        **extra,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None,
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"etp-train: wrote {path}", flush=True)


def _spawned(rank, world, recipe, port, results, json_path, audit_path, resume, exit_after, profile_dir, timeline):
    try:
        losses = train(rank, world, recipe, port, json_path, audit_path, resume, exit_after, profile_dir, timeline)
        results.put((rank, losses, None))
    except BaseException as exc:  # noqa: BLE001 - report, then fail the run
        import traceback

        results.put((rank, None, traceback.format_exc()))
        raise SystemExit(1) from exc
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _collect(procs, results, grace_s: float = 60.0, poll_s: float = 1.0) -> list[str]:
    """Every spawned rank's report (``(rank, losses, error)`` on ``results``); the failures, one
    text each. A rank that dies without reporting (a signal, a hard crash in native code) is a
    failure named with how it ended, not a wait that never ends; the ranks still running are
    then given ``grace_s`` to notice (their collectives fail on the lost peer) before they are
    terminated, so a crash always ends the run."""
    failures, reported = [], set()
    deadline = None

    def take(report) -> None:
        rank, _, error = report
        reported.add(rank)
        if error:
            failures.append(f"rank {rank}:\n{error}")

    while len(reported) < len(procs):
        try:
            take(results.get(timeout=poll_s))
            continue
        except queue.Empty:
            pass
        dead = [r for r, proc in enumerate(procs) if r not in reported and proc.exitcode is not None]
        if dead:
            with contextlib.suppress(queue.Empty):  # reports put just before exiting are in the pipe
                while True:
                    take(results.get(timeout=poll_s))
            for r in dead:
                if r not in reported:
                    reported.add(r)
                    failures.append(f"rank {r}: died ({_exit_reason(procs[r].exitcode)}) without a report")
                    deadline = deadline or time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for r, proc in enumerate(procs):
                if r not in reported:
                    proc.terminate()
                    reported.add(r)
                    failures.append(f"rank {r}: terminated {grace_s:.0f} s after a peer died")
    return failures


def main(argv=None) -> int:
    args = _parse(argv)
    from .recipe import Recipe, RecipeError, parse_overrides

    try:  # every recipe error (missing file, bad YAML, bad value) is one line, before any work
        overrides = parse_overrides(args.set)
        if args.train_iters is not None:
            overrides["train_iters"] = args.train_iters
        if args.log_interval is not None:
            overrides["log_interval"] = args.log_interval
        if args.peak_tflops is not None:
            overrides["peak_tflops"] = args.peak_tflops
        recipe = Recipe.from_yaml(args.recipe, **overrides)
    except RecipeError as error:
        print(f"etp-train: {error}", file=sys.stderr)
        return 2
    if "RANK" in os.environ:  # launched by torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), recipe, json_path=args.json, audit_path=args.audit,
              resume=args.resume, exit_after=args.exit_after, profile_dir=args.profile, timeline_on=args.timeline)
        dist.destroy_process_group()
        return 0
    world = recipe.parallel.world_size or 1
    if recipe.parallel.backend == "nccl" or (recipe.parallel.backend == "auto" and torch.cuda.is_available()):
        raise SystemExit(f"etp-train: run GPU recipes under torchrun, e.g. torchrun --nproc-per-node={world} "
                         f"-m etp.megatron.train --recipe {args.recipe}")
    recipe.check_world_size(world)
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_spawned, args=(r, world, recipe, port, results, args.json, args.audit,
                                                           args.resume, args.exit_after, args.profile, args.timeline))
             for r in range(world)]
    for proc in procs:
        proc.start()
    failures = _collect(procs, results)
    for proc in procs:
        proc.join()
    if failures:
        print("etp-train failed:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
