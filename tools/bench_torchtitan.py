#!/usr/bin/env python
"""etp-train against torchtitan's own trainer on one GPU, on the same Qwen3 MoE model, the same
token ids and the same optimizer: one invocation runs, each in its own process with a timeout,

* ``etp``: ``etp-train --recipe R --set num_layers=N ...`` at etp's defaults (``cuda_graph``,
  grouped experts, local dispatcher, fused kernels: whatever the recipe's ``auto`` keys choose);
* ``torchtitan``: torchtitan 0.2.2's ``main(Trainer)`` (``tools/bench_torchtitan_launch.py``) on
  its Qwen3 model in the recipe's shape at the same N layers, ``torch.compile`` on (its
  per-block compile of the model and the loss) and its grouped-GEMM experts
  (``MoEArgs.use_grouped_mm``: ``torch._grouped_mm`` behind its token permutation, the compiled
  expert function), no activation checkpointing (etp's recipe recomputes nothing);
* ``megatron_stock``: etp-train with megatron-core's own layers and paths instead of etp's
  (``STOCK_SETS``: ``megatron_fallbacks=stock`` (megatron-core's unfused RoPE, foreach Adam,
  its l2-norm and host-synchronizing step), ``moe_grouped_gemm=false`` (megatron-core's
  ``SequentialMLP``, one linear pair per expert), ``moe_token_dispatcher_type=alltoall``
  (megatron-core's dispatcher), ``attention_backend=local`` (megatron-core's
  ``DotProductAttention``), ``cuda_graph=none``). No switch turns off etp's vocabulary cross
  entropy (``etp.megatron.cross_entropy``), etp-train's loop or its data reader: those stay.

Shared by the three (``etp_overrides``, ``titan_job_config``): the recipe's shape at
``--layers`` layers and its sequence length; micro-batch = global batch = ``--micro-batch`` (one
GPU, no gradient accumulation); ``--steps`` steps, the first ``--warmup`` excluded from the
timing; AdamW with the recipe's lr, betas, eps and weight decay at a constant learning rate (no
warm-up, no decay), global-norm clip at the recipe's ``clip_grad``; bf16 GEMMs with fp32
optimizer state; and the data: ``write_tokens`` writes the ids etp-train's reader
(``etp.train.batches.Batches``: windows of the recipe's corpus, a function of seed, iteration and
sample) hands each step into ``tokens.npy``, and torchtitan reads that file, step for step.
Nothing is downloaded.

Reported per run (JSON ``runs.NAME``, the markdown table): ms per step (median over the timed
steps); TFLOP/s by one formula, etp's ([Note: FLOP count] in ``etp/train/flops.py``:
``training_flops(recipe, micro-batch x seq)`` per step over the median step time) and MFU against
etp's datasheet peak; each trainer's own TFLOP/s and MFU (etp-train's per-iteration figure;
torchtitan's ``tflops`` / ``mfu`` log fields); the peak of ``torch.cuda.max_memory_allocated``
(bytes in live tensors) and of ``max_memory_reserved`` (bytes the caching allocator holds from the
driver: live tensors, cached free blocks, fragmentation and CUDA-graph pools; neither counts the
CUDA context, NCCL or cuBLAS workspaces outside the allocator), torchtitan's own
``max_active`` / ``max_reserved`` beside them; the loss of every step.

torchtitan's FLOP count (``get_moe_model_nparams_and_flops``: 6 x (parameters less the embedding
table, experts scaled by top_k / num_experts) + 6 x layers x heads x (2 x head_dim) x seq per
token) is etp's convention (6 x the GEMM weights a token meets, the full attention square) and
gives the same count for this model (``test_bench_torchtitan.py`` checks it); its TFLOP/s differs
from the etp-formula figure only in the time it divides by: each log window's tokens over that
window's wall time (here one step, data loading and the log's host reads included), not the
median step.

What still differs between the runs (``DIFFERENCES``, also in the JSON): initialization (each
framework's own), MoE load balancing (etp's recipe adds megatron-core's auxiliary loss to the
gradient; torchtitan 0.2.2's qwen3 spec builds its optimizers without the expert-bias update, so
it balances nothing), weight decay (megatron-core skips biases and 1-D weights, torchtitan's
AdamW decays every parameter), and the precision layout (etp: bf16 weights, fp32 main gradients
and fp32 master weights; torchtitan at one GPU: fp32 weights and gradients under bf16 autocast).

Defaults: 4 layers, micro-batch 2, 20 steps (5 warm-up): the largest micro-batch at which the
memory audit leaves the megatron_stock run (its local attention keeps every score matrix) well
inside one 139 GiB H200; the etp run's prediction is far below it::

    etp-audit --recipe recipes/qwen3_30b_a3b.yaml --world-size 1 --gpu-memory 139GiB \
        --set num_layers=4 --set micro_batch_size=2 --set global_batch_size=2
    etp-audit ... (the same) --set attention_backend=local --set moe_grouped_gemm=false \
        --set moe_token_dispatcher_type=alltoall --set megatron_fallbacks=stock --set cuda_graph=none

``--budget-s`` (345 s) bounds the whole invocation: each run's timeout is the smaller of its cap
(``--timeout NAME=SECONDS``; etp 120, torchtitan 240, megatron_stock 120) and what the budget
leaves after 60 s for each later run; a run that fails or times out records its error tail and
what it logged (``status``, ``error_tail``, the steps it logged), and the next run starts. Each
run's log, the token file, torchtitan's TOML and the runs' own JSON stay in ``--work-dir``
(default: a new temporary directory, named in the report); every run's ``log_tail`` is in the
report.

On the GPU machine (Python 3.12, torch there), with megatron-core's wheels in ``.whl/`` and
torchtitan 0.2.2's (with torchdata, datasets, dill, multiprocess, tyro, docstring-parser,
typeguard, typing-extensions, tomli; the rest of what they import is on that machine) in
``.whltt/``::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whltt/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    python3 tools/bench_torchtitan.py --layers 4 --steps 20 --out $OUT/titan.json

``--profile`` also traces steady steps of each run (etp-train's ``--profile``, torchtitan's
``[profiling]``) and classifies both traces with ``etp.train.profile.breakdown``, one FLOP-free
table of where each spends its step (GEMMs, attention, routing, elementwise, optimizer, host
gaps); profiled runs are slower, so the timing table of that invocation is not the headline.

Without a GPU, ``--dry-run`` writes the token file, the torchtitan config and the commands (and
the JSON, every run "not run") and runs nothing::

    python3 tools/bench_torchtitan.py --dry-run --out /tmp/titan.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path.insert(0, str(TOOLS))  # bench_provenance, bench_torchtitan_launch

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path
from bench_torchtitan_launch import FLAVOR, SPEC_NAME  # noqa: E402

__all__ = ["DIFFERENCES", "STOCK_SETS", "etp_overrides", "etp_steps", "markdown", "parse_titan_log", "summarize",
           "titan_job_config", "titan_model_args", "titan_steps", "to_toml", "write_tokens"]

RUNS = ("etp", "torchtitan", "megatron_stock")
#: What turns etp-train's own paths off for the ``megatron_stock`` row (see the module docstring).
STOCK_SETS = ("megatron_fallbacks=stock", "moe_grouped_gemm=false", "moe_token_dispatcher_type=alltoall",
              "attention_backend=local", "cuda_graph=none")
#: Each run's timeout cap in seconds (``--timeout NAME=SECONDS``), and what each later run keeps.
TIMEOUT_CAPS = {"etp": 120.0, "torchtitan": 240.0, "megatron_stock": 120.0}
RESERVE_S = 60.0
DIFFERENCES = (
    "initialization: each framework's own (etp: megatron-core's normal(0, init_method_std); torchtitan: its "
    "embedding normal(0, 1), depth-scaled truncated normals, output std dim^-0.5), so the losses differ from step 1",
    "MoE load balancing: etp's recipe adds megatron-core's auxiliary loss (moe_aux_loss_coeff) to the gradient; "
    "torchtitan 0.2.2's qwen3 spec builds its optimizers without the expert-bias update, so nothing balances "
    "its experts (the reported losses are the language-model loss alone in both)",
    "weight decay: megatron-core skips biases and 1-D weights (norms); torchtitan's AdamW decays every parameter",
    "precision: etp keeps bf16 weights with fp32 main gradients and fp32 master weights (megatron-core's mixed "
    "precision); torchtitan on one GPU keeps fp32 weights and gradients and runs under bf16 autocast; both "
    "multiply in bf16 and step AdamW in fp32",
    "attention: etp and torchtitan both call torch's scaled_dot_product_attention, etp allowing flash, efficient "
    "and math kernels, torchtitan cuDNN first, then flash and math; megatron_stock uses megatron-core's "
    "DotProductAttention (the full score matrix)",
)
#: torchtitan's ``profiling.profile_freq`` under ``--profile``: it traces steps 9 and 10.
PROFILE_STEP = 10

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: torchtitan's per-step log line (``MetricsProcessor.log``), colors stripped.
_TITAN_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eEnaif]+)\s+grad_norm:\s*(?P<grad_norm>[-+0-9.eEnaif]+)\s+"
    r"memory:\s*(?P<reserved>[0-9.]+)GiB\((?P<reserved_pct>[0-9.]+)%\)\s+tps:\s*(?P<tps>[0-9,]+)\s+"
    r"tflops:\s*(?P<tflops>[-0-9,.]+)\s+mfu:\s*(?P<mfu>[-0-9.]+)%")
#: The lines a run echoes while it runs: every fifth step's (and the first), and these.
_STEP_LINE = re.compile(r"(?:step:\s*|^iter\s+)(\d+)")
_PROGRESS = re.compile(r"Compiling|Trainer is initialized|Training starts|Training completed|^etp-train:|Error|"
                       r"Traceback|out of memory", re.IGNORECASE)


# ------------------------------------------------------------------------------ the runs' inputs
def etp_overrides(layers: int, micro_batch: int, steps: int, seq_length: int | None = None,
                  extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The ``--set`` values both etp runs (and this tool's recipe) take: N layers, micro-batch =
    global batch, the steps, a constant learning rate, a log line (and a record) per step.

    Example::

        etp_overrides(4, 2, 20)   # ['num_layers=4', 'micro_batch_size=2', 'global_batch_size=2', ...]
    """
    sets = [f"num_layers={layers}", f"micro_batch_size={micro_batch}", f"global_batch_size={micro_batch}",
            f"train_iters={steps}", "lr_warmup_iters=0", "lr_decay_style=constant", "log_interval=1"]
    if seq_length is not None:
        sets.append(f"seq_length={seq_length}")
    return [*sets, *extra]


def load_recipe(path: str | os.PathLike, sets: list[str]):
    """``etp.recipe.Recipe`` of ``path`` with ``sets`` applied as etp-train applies ``--set``."""
    from etp.recipe import Recipe, parse_overrides

    overrides = parse_overrides(sets)
    return Recipe.from_yaml(path, **overrides)


def write_tokens(recipe, steps: int, path: str | os.PathLike) -> dict:
    """Writes the ids etp-train reads at iterations ``0 .. steps-1`` on one rank
    (``etp.train.batches.Batches``, one micro-batch per step) to ``path`` as an int32 ``.npy`` of
    ``[steps, micro-batch, seq + 1]`` (inputs ``[:, :, :-1]``, labels ``[:, :, 1:]``); returns its
    shape, sha256 and the data source.

    Example::

        write_tokens(load_recipe("recipes/qwen3_30b_a3b.yaml", etp_overrides(4, 2, 20)), 20, "tokens.npy")
    """
    import numpy
    import torch

    from etp.train.batches import Batches

    if recipe.data.has_dataset:
        raise ValueError(f"{recipe.source}: the recipe reads a megatron-core dataset; this tool replays etp's own "
                         "'data' key (a text corpus or synthetic ids)")
    reader = Batches(recipe, 0, torch.device("cpu"), 1)
    steps_ids = []
    for iteration in range(steps):
        batch = reader.get(iteration, 0)
        steps_ids.append(torch.cat([batch.tokens, batch.labels[:, -1:]], dim=1))
    ids = torch.stack(steps_ids).numpy().astype(numpy.int32)
    numpy.save(path, ids)
    return {"path": str(path), "shape": list(ids.shape), "sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
            "source": recipe.train.data, "max_id": int(ids.max())}


def titan_model_args(recipe) -> dict:
    """torchtitan's ``Qwen3ModelArgs`` (``moe_args``: ``MoEArgs``) fields of a recipe's model;
    refuses, naming the key, what that model cannot express.

    Example::

        titan_model_args(recipe)["moe_args"]["top_k"]   # 8 for recipes/qwen3_30b_a3b.yaml
    """
    m = recipe.model
    unsupported = {
        "normalization": m.normalization != "RMSNorm", "swiglu": not m.swiglu, "add_bias_linear": m.add_bias_linear,
        "position_embedding_type": m.position_embedding_type != "rope", "num_experts": not m.is_moe,
        "moe_layer_freq": m.moe_layer_freq != 1,
        "moe_shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size is not None,
        "moe_router_score_function": m.moe_router_score_function != "softmax",
        "moe_router_pre_softmax": m.moe_router_pre_softmax,
        "moe_router_num_groups": m.moe_router_num_groups is not None,
        "qk_layernorm_width": m.qk_layernorm and m.qk_layernorm_width != "head",
    }
    for key, refused in unsupported.items():
        if refused:
            raise ValueError(f"{recipe.source}: {key}={getattr(m, key)!r} has no torchtitan Qwen3 equivalent "
                             "(every layer MoE, RMSNorm, SwiGLU, RoPE, no biases, softmax top-k routing)")
    return {
        "dim": m.hidden_size, "n_layers": m.num_layers, "n_heads": m.num_attention_heads,
        "n_kv_heads": m.num_query_groups, "vocab_size": recipe.padded_vocab_size, "head_dim": m.kv_channels,
        "hidden_dim": m.ffn_hidden_size, "norm_eps": m.norm_epsilon, "rope_theta": m.rotary_base,
        "qk_norm": m.qk_layernorm, "max_seq_len": m.seq_length,
        "enable_weight_tying": not m.untie_embeddings_and_output_weights,
        "moe_enabled": True, "moe_inter_dim": m.moe_ffn_hidden_size,
        "moe_args": {
            "num_experts": m.num_experts, "num_shared_experts": 0, "top_k": m.moe_router_topk,
            "score_func": "softmax",
            # megatron-core's softmax over the chosen experts' logits (pre-softmax off) is a
            # softmax over all of them renormalized over the chosen: route_norm.
            "route_norm": True, "route_scale": m.moe_router_topk_scaling_factor or 1.0,
            "score_before_experts": False, "use_grouped_mm": True,
            "load_balance_coeff": 1e-3,  # torchtitan's 30B-A3B flavor's; its qwen3 spec never applies it
        },
    }


def titan_job_config(recipe, *, steps: int, tokens: str | os.PathLike, dump_folder: str | os.PathLike,
                     assets: str | os.PathLike, compile_model: bool = True) -> dict:
    """torchtitan's job config (TOML sections as dicts) for the recipe's training settings:
    the ``etp_qwen3`` spec, local = global batch, AdamW at a constant lr, the recipe's clip,
    compile on, no activation checkpointing, no checkpoints, a log record every step.

    Example::

        (run / "titan.toml").write_text(to_toml(titan_job_config(recipe, steps=20, tokens=..., ...)))
    """
    t = recipe.train
    return {
        "job": {"dump_folder": str(dump_folder), "description": "etp tools/bench_torchtitan.py"},
        "metrics": {"log_freq": 1, "disable_color_printing": True, "enable_tensorboard": False},
        "model": {"name": SPEC_NAME, "flavor": FLAVOR, "hf_assets_path": str(assets)},
        "optimizer": {"name": "AdamW", "lr": t.lr, "beta1": t.adam_beta1, "beta2": t.adam_beta2, "eps": t.adam_eps,
                      "weight_decay": t.weight_decay, "implementation": "fused"},
        "lr_scheduler": {"warmup_steps": 0, "decay_ratio": 0.0},  # constant: no warm-up, no decay steps
        "training": {"dataset_path": str(tokens), "local_batch_size": t.micro_batch_size,
                     "global_batch_size": t.micro_batch_size, "seq_len": recipe.model.seq_length,
                     "max_norm": t.clip_grad, "steps": steps, "dtype": "float32",
                     "mixed_precision_param": "bfloat16" if t.bf16 else "float32"},
        "parallelism": {"data_parallel_shard_degree": 1, "data_parallel_replicate_degree": 1},
        "activation_checkpoint": {"mode": "none"},
        "compile": {"enable": compile_model, "components": ["model", "loss"]},
        "checkpoint": {"enable": False},
        "debug": {"seed": t.seed},
    }


def to_toml(config: dict) -> str:
    """One ``[section]`` per key of ``config`` (values: str, bool, int, float, lists of them).

    Example::

        to_toml({"compile": {"enable": True, "components": ["model", "loss"]}})
        # '[compile]\\nenable = true\\ncomponents = ["model", "loss"]\\n'
    """
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        if isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError(f"TOML value {v!r}: not a finite number")
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(item) for item in v) + "]"
        raise TypeError(f"TOML value {v!r}: expected str, bool, int, float or a list of them")

    sections = []
    for section, values in config.items():
        sections.append("\n".join([f"[{section}]", *(f"{key} = {value(v)}" for key, v in values.items())]) + "\n")
    return "\n".join(sections)


# ------------------------------------------------------------------------------ running them
def _python_run(*args: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node 1 ARGS`` through this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *args]


def _kill_group(proc: subprocess.Popen) -> None:
    """Stops the process group this tool started for ``proc`` (torchrun and its worker)."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(name: str, command: list[str], env: dict, timeout: float, log_path: Path) -> dict:
    """Runs ``command`` in its own process group, output to ``log_path`` (progress lines echoed),
    stopped after ``timeout`` seconds; returns its status, wall time and, on failure, its tail."""
    began = time.monotonic()
    print(f"[bench] {name}: starting (timeout {timeout:.0f} s): {shlex.join(command)}", flush=True)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True, bufsize=1)

        def pump():
            for line in proc.stdout:
                log.write(line)
                plain = _ANSI.sub("", line).rstrip()
                step = _STEP_LINE.search(plain)
                if (int(step.group(1)) == 1 or int(step.group(1)) % 5 == 0) if step else _PROGRESS.search(plain):
                    short = re.sub(r"^\[titan\] \S+ \S+ - \S+ - \w+ - ", "", plain)
                    print(f"[{name} {time.monotonic() - began:5.0f} s] {short[:200]}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        reader.join(timeout=10)
    result = {"command": shlex.join(command), "returncode": proc.returncode, "timed_out": timed_out,
              "timeout_s": timeout, "wall_s": round(time.monotonic() - began, 1), "log": str(log_path)}
    lines = _ANSI.sub("", log_path.read_text(encoding="utf-8", errors="replace")).splitlines()
    result["log_tail"] = "\n".join(lines[-25:])
    if timed_out or proc.returncode != 0:
        result["error_tail"] = "\n".join(lines[-40:])
    print(f"[bench] {name}: {'timed out' if timed_out else f'exit {proc.returncode}'} after {result['wall_s']} s",
          flush=True)
    return result


# ------------------------------------------------------------------------------ their figures
def parse_titan_log(text: str) -> list[dict]:
    """torchtitan's per-step log lines (``step: 1  loss: ...  mfu: ...%``, colored or not) as
    dicts: step, loss, grad_norm, reserved_gib (its ``memory``: the window's peak reserved),
    tps (tokens per second per device), tflops, mfu_pct.

    Example::

        parse_titan_log("[titan] ... - INFO - step:  1  loss: 12.0000  grad_norm:  1.0000  memory: 1.00GiB(1.00%)  "
                        "tps: 1,000  tflops: 4.04  mfu: 0.41%")[0]["tps"]   # 1000.0
    """
    steps = []
    for line in _ANSI.sub("", text).splitlines():
        match = _TITAN_STEP.search(line)
        if match:
            g = match.groupdict()
            steps.append({"step": int(g["step"]), "loss": float(g["loss"]), "grad_norm": float(g["grad_norm"]),
                          "reserved_gib": float(g["reserved"]), "tps": float(g["tps"].replace(",", "")),
                          "tflops": float(g["tflops"].replace(",", "")), "mfu_pct": float(g["mfu"])})
    return steps


def _jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file that exist (a run killed mid-line loses that line)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def titan_steps(metrics_path: Path, log_text: str, tokens_per_step: int) -> tuple[list[dict], dict]:
    """(one dict per logged step, the launcher's header) from the launcher's metrics file, else
    (a run that wrote none) from torchtitan's log lines, its step time then tokens / tps."""
    records = _jsonl(metrics_path)
    header = next((r["header"] for r in records if "header" in r), {})
    steps = [{"step": r["step"], "loss": r.get("loss_metrics/global_avg_loss"),
              "grad_norm": r.get("grad_norm"), "ms": 1e3 * r["time_metrics/end_to_end(s)"],
              "own_tflops": r.get("tflops"), "own_mfu": _fraction(r.get("mfu(%)")),
              "tokens_per_s": r.get("throughput(tps)"),
              "peak_allocated_gib": r.get("max_memory_allocated_gib"),
              "peak_reserved_gib": r.get("max_memory_reserved_gib"),
              "titan_max_active_gib": r.get("memory/max_active(GiB)"),
              "titan_max_reserved_gib": r.get("memory/max_reserved(GiB)"),
              "num_flops_per_token": r.get("num_flops_per_token"), "device_name": r.get("device_name")}
             for r in records if "step" in r and "time_metrics/end_to_end(s)" in r]
    if steps:
        return steps, header
    return [{"step": s["step"], "loss": s["loss"], "grad_norm": s["grad_norm"],
             "ms": 1e3 * tokens_per_step / s["tps"] if s["tps"] else None, "own_tflops": s["tflops"],
             "own_mfu": s["mfu_pct"] / 100, "tokens_per_s": s["tps"], "titan_max_reserved_gib": s["reserved_gib"]}
            for s in parse_titan_log(log_text)], header


def _fraction(percent):
    return None if percent is None else percent / 100


def etp_steps(report_path: Path) -> tuple[list[dict], dict]:
    """(one dict per logged iteration, etp-train's ``--json`` report or ``{}``) from the report,
    else (a run that did not finish) from its ``.jsonl`` stream beside it."""
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    stream = [r for r in _jsonl(report_path.with_suffix(".jsonl")) if "ms_per_iter" in r]
    peaks = {r["iteration"]: r.get("peak_allocated_gib") for r in stream}
    records = report.get("log") or stream
    return [{"step": r["iteration"], "loss": r.get("loss"), "grad_norm": r.get("grad_norm"), "ms": r["ms_per_iter"],
             "own_tflops": r.get("tflops_per_rank"), "own_mfu": r.get("mfu"),
             "peak_allocated_gib": peaks.get(r["iteration"])} for r in records], report


def summarize(steps: list[dict], recipe, warmup: int, device_name: str | None) -> dict:
    """The run's figures over the steps after ``warmup``: median ms per step, TFLOP/s and MFU by
    etp's formula (``training_flops`` of one step's tokens over the median step), the medians of
    the trainer's own TFLOP/s and MFU, and the losses of every step.

    Example::

        summarize([{"step": i, "ms": 100.0, "loss": 2.0} for i in range(1, 11)], recipe, 5, "NVIDIA H200")
    """
    from etp.train.flops import peak_tflops, training_flops

    tokens = recipe.train.micro_batch_size * recipe.model.seq_length
    flops = training_flops(recipe, tokens)
    timed = [s for s in steps if s["step"] > warmup and s.get("ms")]

    def median(key):
        values = [s[key] for s in timed if s.get(key) is not None]
        return statistics.median(values) if values else None

    ms = median("ms")
    tflops = flops / (ms / 1e3) / 1e12 if ms else None
    peak = peak_tflops(device_name)
    return {"timed_steps": [s["step"] for s in timed], "ms_per_step_median": ms,
            "ms_per_step_min": min((s["ms"] for s in timed), default=None),
            "ms_per_step_max": max((s["ms"] for s in timed), default=None),
            "tokens_per_step": tokens, "flops_per_step": flops, "tflops_etp_formula": tflops,
            "mfu_etp_formula": tflops / peak if tflops and peak else None, "peak_tflops": peak,
            "own_tflops_median": median("own_tflops"), "own_mfu_median": median("own_mfu"),
            "losses": [s.get("loss") for s in steps], "steps_logged": len(steps)}


def _peak(steps: list[dict], key: str):
    values = [s[key] for s in steps if s.get(key) is not None]
    return max(values) if values else None


# ------------------------------------------------------------------------------ the report
def _cell(value, digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}{unit}"


def markdown(report: dict) -> str:
    """The report's two tables: one row per run, then the loss of every step per run."""
    runs = report["runs"]
    lines = ["| run | status | ms/step (median) | TFLOP/s (etp formula) | MFU (etp formula) | own TFLOP/s | "
             "own MFU | peak allocated GiB | peak reserved GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, run in runs.items():
        lines.append(f"| {name} | {run.get('status', 'n/a')} | {_cell(run.get('ms_per_step_median'))} | "
                     f"{_cell(run.get('tflops_etp_formula'))} | {_cell(run.get('mfu_etp_formula'), 1, 100, '%')} | "
                     f"{_cell(run.get('own_tflops_median'))} | {_cell(run.get('own_mfu_median'), 1, 100, '%')} | "
                     f"{_cell(run.get('peak_allocated_gib'), 2)} | {_cell(run.get('peak_reserved_gib'), 2)} |")
    losses = {name: run.get("losses") or [] for name, run in runs.items()}
    longest = max((len(v) for v in losses.values()), default=0)
    if longest:
        lines += ["", "| step | " + " | ".join(losses) + " |", "|---:|" + "---:|" * len(losses)]
        for i in range(longest):
            cells = [_cell(v[i], 4) if i < len(v) else "" for v in losses.values()]
            lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _status(child: dict | None, steps: list[dict], wanted: int) -> str:
    if child is None:
        return "not run"
    if child["timed_out"]:
        return f"timed out ({len(steps)}/{wanted} steps)"
    if child["returncode"] != 0:
        return f"failed, exit {child['returncode']} ({len(steps)}/{wanted} steps)"
    return "ok" if len(steps) >= wanted else f"ok, {len(steps)}/{wanted} steps logged"


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/qwen3_30b_a3b.yaml")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (the recipe's shape otherwise)")
    parser.add_argument("--micro-batch", type=int, default=2, help="micro-batch = global batch (one GPU)")
    parser.add_argument("--seq-length", type=int, help="tokens per sample (default: the recipe's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further etp-train override for both etp runs (and this tool's recipe)")
    parser.add_argument("--stock-set", action="append", metavar="KEY=VALUE",
                        help=f"the megatron_stock row's overrides instead of {' '.join(STOCK_SETS)}")
    parser.add_argument("--no-compile", action="store_true", help="torchtitan without torch.compile")
    parser.add_argument("--profile", action="store_true",
                        help="also torch-profile steady steps of every run and classify each trace with "
                             "etp.train.profile.breakdown (where each run spends its step); profiled steps "
                             "are slower, so the timing table of such a run is not the headline")
    parser.add_argument("--budget-s", type=float, default=345.0, help="wall seconds for all runs together")
    parser.add_argument("--timeout", action="append", default=[], metavar="NAME=SECONDS",
                        help="a run's timeout cap (defaults: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                                          TIMEOUT_CAPS.items()) + ")")
    parser.add_argument("--work-dir", help="where the token file, configs, logs and run JSONs go (default: a new "
                                           "temporary directory)")
    parser.add_argument("--dry-run", action="store_true", help="write the inputs and the JSON, run nothing")
    parser.add_argument("--out", required=True, help="the JSON report")
    args = parser.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        parser.error(f"--runs {','.join(unknown)}: expected names among {','.join(RUNS)}")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup}: must be >= 0 and below --steps {args.steps} (some steps are timed)")
    caps = dict(TIMEOUT_CAPS)
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        if name not in RUNS or not seconds:
            parser.error(f"--timeout {item}: expected NAME=SECONDS with NAME among {','.join(RUNS)}")
        caps[name] = float(seconds)
    args.caps = caps
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    began = time.monotonic()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench_torchtitan_"))
    work.mkdir(parents=True, exist_ok=True)
    sets = etp_overrides(args.layers, args.micro_batch, args.steps, args.seq_length, args.set)
    stock_sets = [*sets, *(args.stock_set or STOCK_SETS)]
    recipe = load_recipe(args.recipe, sets)
    tokens = write_tokens(recipe, args.steps, work / "tokens.npy")
    print(f"[bench] {recipe.model.num_layers} layers, micro-batch {recipe.train.micro_batch_size} x "
          f"{recipe.model.seq_length} tokens, {args.steps} steps ({args.warmup} warm-up); token ids {tokens['shape']} "
          f"from {tokens['source']} in {work}", flush=True)
    metrics_path = work / "titan_metrics.jsonl"
    spec_path = work / "titan_spec.json"
    spec_path.write_text(json.dumps({"model_args": titan_model_args(recipe), "metrics": str(metrics_path)}, indent=1))
    job = titan_job_config(recipe, steps=args.steps, tokens=work / "tokens.npy", dump_folder=work / "titan",
                           assets=work, compile_model=not args.no_compile)
    if args.profile:  # two active steps after three warm-up ones, ending at profile_freq
        job["profiling"] = {"enable_profiling": True, "save_traces_folder": "profile_traces",
                            "profile_freq": PROFILE_STEP, "profiler_warmup": 3, "profiler_active": 2}
    (work / "titan.toml").write_text(to_toml(job))
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    recipe_arg = str(Path(args.recipe).resolve())
    plans = {
        "etp": (_python_run("-m", "etp.train", "--recipe", recipe_arg, *(a for s in sets for a in ("--set", s)),
                            "--json", str(work / "etp.json")), env),
        "torchtitan": (_python_run(str(TOOLS / "bench_torchtitan_launch.py"), "--job.config_file",
                                   str(work / "titan.toml")), dict(env, ETP_TITAN_BENCH=str(spec_path))),
        "megatron_stock": (_python_run("-m", "etp.train", "--recipe", recipe_arg,
                                       *(a for s in stock_sets for a in ("--set", s)),
                                       "--json", str(work / "megatron_stock.json")), env),
    }
    if args.profile:
        for name in ("etp", "megatron_stock"):
            plans[name][0].extend(["--profile", str(work / f"{name}_profile")])
    runs = {}
    for index, name in enumerate(args.runs):
        command, run_env = plans[name]
        child = None
        if args.dry_run:
            print(f"[bench] {name} (not run, --dry-run): {shlex.join(command)}", flush=True)
        else:
            later = len(args.runs) - index - 1
            left = args.budget_s - (time.monotonic() - began) - RESERVE_S * later
            if left < 30:
                print(f"[bench] {name}: not run: {left:.0f} s of --budget-s left", flush=True)
            else:
                if name == "torchtitan" and metrics_path.exists():
                    metrics_path.unlink()  # the launcher appends
                child = run_child(name, command, run_env, min(args.caps[name], left), work / f"{name}.log")
        runs[name] = _collect(name, child, command, work, recipe, args, metrics_path)
        if args.profile and child is not None:
            runs[name]["profile"] = profile_breakdown(name, work)
    report = {
        "recipe": args.recipe, "layers": recipe.model.num_layers, "seq_length": recipe.model.seq_length,
        "micro_batch_size": recipe.train.micro_batch_size, "global_batch_size": recipe.train.micro_batch_size,
        "steps": args.steps, "warmup_steps": args.warmup, "etp_sets": sets, "megatron_stock_sets": stock_sets,
        "optimizer": {"name": "AdamW", "lr": recipe.train.lr, "lr_schedule": "constant",
                      "betas": [recipe.train.adam_beta1, recipe.train.adam_beta2], "eps": recipe.train.adam_eps,
                      "weight_decay": recipe.train.weight_decay, "clip_grad": recipe.train.clip_grad},
        "data": tokens, "torchtitan_job": job, "torchtitan_model_args": titan_model_args(recipe),
        "flops_convention": "etp.train.flops.training_flops: 6 x GEMM weights per token + 12 x layers x heads x "
                            "kv_channels x seq (full square), the same for every run",
        "memory": {"peak_allocated_gib": "max of torch.cuda.max_memory_allocated: bytes in live tensors",
                   "peak_reserved_gib": "max of torch.cuda.max_memory_reserved: bytes the caching allocator "
                                        "held (cached free blocks, fragmentation and CUDA-graph pools included)",
                   "titan_max_active_gib": "torchtitan's memory/max_active: active_bytes.all.peak per log window",
                   "titan_max_reserved_gib": "torchtitan's memory/max_reserved (its log line's 'memory')"},
        "differences": list(DIFFERENCES), "runs": runs, "work_dir": str(work),
        "wall_s": round(time.monotonic() - began, 1), "provenance": provenance(sys.argv),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(markdown(report), flush=True)
    if args.profile:
        print(profile_markdown(runs), flush=True)
    print(f"[bench] wrote {args.out} ({report['wall_s']} s)", flush=True)
    ran = [r for r in runs.values() if r.get("returncode") is not None]
    return 1 if ran and all(r["returncode"] != 0 or r["timed_out"] for r in ran) else 0


def profile_breakdown(name: str, work: Path) -> dict:
    """The run's trace classified by ``etp.train.profile.breakdown`` (per-iteration ms of each
    kernel class, wall, busy, host gaps, top kernels), or why there is none. etp-train writes
    ``<name>_profile/trace_rank0.json``; torchtitan ``titan/profile_traces/iteration_N/rank0_trace.json``."""
    from etp.train.profile import breakdown

    if name == "torchtitan":
        found = sorted((work / "titan" / "profile_traces").glob("iteration_*/rank0_trace.json"))
    else:
        found = sorted((work / f"{name}_profile").glob("trace_rank0.json"))
    if not found:
        return {"error": "no trace written"}
    table = breakdown(json.loads(found[-1].read_text()))
    table["trace"] = str(found[-1])
    return table


def profile_markdown(runs: dict) -> str:
    """One row per kernel class, one column per profiled run (ms per iteration)."""
    names = [n for n, r in runs.items() if "classes" in r.get("profile", {})]
    if not names:
        return "(no profile)"
    rows = ["| ms per iteration | " + " | ".join(names) + " |", "|---" + "|---:" * len(names) + "|"]
    from etp.train.profile import CLASSES

    for key in (*CLASSES, "busy", "host_gaps", "wall"):
        cells = [runs[n]["profile"]["classes"].get(key) if key in CLASSES else runs[n]["profile"].get(key)
                 for n in names]
        rows.append(f"| {key} | " + " | ".join(_cell(c, 2) for c in cells) + " |")
    return "\n".join(rows)


def _collect(name: str, child: dict | None, command: list[str], work: Path, recipe, args, metrics_path: Path) -> dict:
    """A run's entry of the report: its process status, its steps and its figures."""
    tokens_per_step = recipe.train.micro_batch_size * recipe.model.seq_length
    log_path = work / f"{name}.log"
    log_text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
    if name == "torchtitan":
        steps, header = titan_steps(metrics_path, log_text, tokens_per_step)
        device = next((s["device_name"] for s in steps if s.get("device_name")), None)
        extra = {"launcher": header, "num_flops_per_token_titan": next(
                     (s["num_flops_per_token"] for s in steps if s.get("num_flops_per_token")), None),
                 "titan_max_active_gib": _peak(steps, "titan_max_active_gib"),
                 "titan_max_reserved_gib": _peak(steps, "titan_max_reserved_gib"),
                 "peak_allocated_gib": _peak(steps, "peak_allocated_gib"),
                 "peak_reserved_gib": _peak(steps, "peak_reserved_gib")}
    else:
        steps, report = etp_steps(work / f"{name}.json")
        device = (report.get("provenance") or {}).get("gpu_name")
        extra = {"peak_allocated_gib": report.get("peak_allocated_gib", _peak(steps, "peak_allocated_gib")),
                 "peak_reserved_gib": report.get("peak_reserved_gib"),
                 "etp_report_ms_per_iter": report.get("ms_per_iter"),
                 "flops_per_iter_per_rank_etp": report.get("flops_per_iter_per_rank"),
                 "cuda_graph": next((ln for ln in log_text.splitlines() if "cuda_graph auto ->" in ln), None)}
    from etp.train.flops import training_flops

    return {"status": _status(child, steps, args.steps), **(child or {"command": shlex.join(command)}),
            "device_name": device, **summarize(steps, recipe, args.warmup, device), **extra,
            "etp_flops_per_token": training_flops(recipe, 1), "steps": steps}


if __name__ == "__main__":
    sys.exit(main())
