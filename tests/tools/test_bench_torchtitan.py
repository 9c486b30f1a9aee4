"""tools/bench_torchtitan.py on CPU: the inputs it writes (etp-train's batches as torchtitan's token
file, the torchtitan job config and model shape from the recipe), the figures it reads back
(etp-train's ``--json`` report, torchtitan's log lines and the launcher's metrics file, captured
samples under data/), etp's FLOP formula applied to them, and a run that fails or times out
beside one that succeeds.

The torchtitan samples (``data/torchtitan_0.2.2*.log``, ``data/torchtitan_0.2.2_metrics.jsonl``)
were written by torchtitan 0.2.2's own ``MetricsProcessor.log`` behind the launcher's
``build_capturing_metrics`` on a CPU with a stand-in device module (peak memory figures given,
the allocator's own ones therefore null); the etp sample (``data/etp_train_report.json``) is
``etp-train --recipe recipes/tiny_moe_cpu.yaml --train-iters 3 --log-interval 1 --json`` on CPU,
its per-layer MoE fields left out. Tests that need torchtitan itself skip without it.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest
import torch
import yaml

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
RECIPE = ROOT / "recipes" / "qwen3_30b_a3b.yaml"
sys.path.insert(0, str(ROOT / "tools"))
spec = importlib.util.spec_from_file_location("bench_torchtitan", ROOT / "tools" / "bench_torchtitan.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _recipe(layers=4, micro=2, steps=3, extra=()):
    return bench.load_recipe(RECIPE, bench.etp_overrides(layers, micro, steps, extra=extra))


def _flops_per_token_by_hand(layers: int) -> int:
    """Qwen3-30B-A3B's training FLOPs per token from the recipe's own parameter arithmetic (its
    header comment): per layer attention 18,874,368 + QK norms 256 + router 262,144 + 2 RMSNorms
    4,096 + top-8 of 128 experts of 4,718,592 each; the untied output 151936 x 2048 and the final
    norm; 6 per weight, plus 12 x layers x 32 heads x 128 x 4096 for the attention square."""
    per_layer = 18_874_368 + 256 + 262_144 + 4_096 + 8 * (603_979_776 // 128)
    weights = layers * per_layer + 151_936 * 2048 + 2048
    return 6 * weights + 12 * layers * 32 * 128 * 4096


def test_dry_run_gives_torchtitan_etps_batches_and_the_recipes_settings(tmp_path):
    out, work = tmp_path / "titan.json", tmp_path / "work"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_torchtitan.py"), "--dry-run", "--layers", "2",
                           "--steps", "3", "--warmup", "1", "--work-dir", str(work), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {name: run["status"] for name, run in report["runs"].items()} == dict.fromkeys(bench.RUNS, "not run")
    assert report["provenance"]["command"].endswith(f"--out {out}")

    # The token file: step i is what etp-train's reader hands iteration i, each row a window of the corpus.
    from etp.train.batches import Batches

    recipe = _recipe(layers=2, steps=3)
    ids = numpy.load(work / "tokens.npy")
    assert ids.shape == (3, 2, 4097) and report["data"]["shape"] == [3, 2, 4097]
    reader = Batches(recipe, 0, torch.device("cpu"), 1)
    corpus = (ROOT / "etp" / "data" / "tiny_corpus.txt").read_bytes()
    for step in range(3):
        batch = reader.get(step, 0)
        assert numpy.array_equal(ids[step, :, :-1], batch.tokens.numpy())
        assert numpy.array_equal(ids[step, :, 1:], batch.labels.numpy())
        for row in ids[step]:
            assert bytes(row.astype(numpy.uint8).tolist()) in corpus
    assert not numpy.array_equal(ids[0], ids[1])  # a fresh batch every step

    # torchtitan's config: the recipe's optimizer and clip (read from the YAML here), constant lr, the same batch.
    raw = yaml.safe_load(RECIPE.read_text())
    job = tomllib.loads((work / "titan.toml").read_text())
    assert job["optimizer"] == {"name": "AdamW", "lr": raw["lr"], "beta1": raw["adam_beta1"], "beta2": raw["adam_beta2"],
                                "eps": raw["adam_eps"], "weight_decay": raw["weight_decay"], "implementation": "fused"}
    assert job["training"]["max_norm"] == raw["clip_grad"] and job["debug"]["seed"] == raw["seed"]
    assert job["lr_scheduler"] == {"warmup_steps": 0, "decay_ratio": 0.0}
    assert (job["training"]["local_batch_size"], job["training"]["global_batch_size"], job["training"]["seq_len"],
            job["training"]["steps"]) == (2, 2, raw["seq_length"], 3)
    assert job["compile"] == {"enable": True, "components": ["model", "loss"]}
    assert job["activation_checkpoint"]["mode"] == "none" and job["training"]["dataset_path"] == str(work / "tokens.npy")
    titan_spec = json.loads((work / "titan_spec.json").read_text())
    assert titan_spec["model_args"]["n_layers"] == 2

    # etp-train's commands: the same layers, batch, steps and schedule; the stock row adds its switches.
    etp = shlex.split(report["runs"]["etp"]["command"])
    stock = shlex.split(report["runs"]["megatron_stock"]["command"])
    sets = [etp[i + 1] for i, a in enumerate(etp) if a == "--set"]
    assert {"num_layers=2", "micro_batch_size=2", "global_batch_size=2", "train_iters=3", "lr_warmup_iters=0",
            "lr_decay_style=constant"} <= set(sets)
    assert [stock[i + 1] for i, a in enumerate(stock) if a == "--set"] == [*sets, *bench.STOCK_SETS]
    assert etp[etp.index("--json") + 1] == str(work / "etp.json")


def test_model_args_are_qwen3_30b_a3bs_shape_at_n_layers():
    args = bench.titan_model_args(_recipe(layers=4))
    # Qwen/Qwen3-30B-A3B's config.json, as the recipe's header quotes it.
    assert {k: args[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "norm_eps",
                                 "rope_theta", "qk_norm", "enable_weight_tying", "moe_inter_dim", "max_seq_len")} == {
        "dim": 2048, "n_layers": 4, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "norm_eps": 1e-6, "rope_theta": 1e6, "qk_norm": True, "enable_weight_tying": False, "moe_inter_dim": 768,
        "max_seq_len": 4096}
    moe = args["moe_args"]
    assert (moe["num_experts"], moe["top_k"], moe["num_shared_experts"], moe["route_norm"], moe["use_grouped_mm"]) == (
        128, 8, 0, True, True)
    with pytest.raises(ValueError, match="add_bias_linear"):
        bench.titan_model_args(_recipe(extra=("add_bias_linear=true",)))
    with pytest.raises(ValueError, match="moe_shared_expert_intermediate_size"):
        bench.titan_model_args(_recipe(extra=("moe_shared_expert_intermediate_size=768",)))


def test_model_args_match_torchtitans_own_30b_a3b_flavor_and_its_flop_count():
    pytest.importorskip("torchtitan")
    launch = pytest.importorskip("bench_torchtitan_launch")
    launch.import_datasets_or_stub()
    import dataclasses

    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    theirs = dataclasses.asdict(qwen3_args["30B-A3B"])
    ours = bench.titan_model_args(_recipe(layers=48))
    for key, value in ours.items():
        if key == "moe_args":
            for moe_key, moe_value in value.items():
                assert theirs["moe_args"][moe_key] == moe_value, moe_key
        elif key != "max_seq_len":  # theirs: 262144, the released context; ours: the recipe's
            assert theirs[key] == value, key
    fields = dict(bench.titan_model_args(_recipe(layers=4)))
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    model_args = Qwen3ModelArgs(**{k: v for k, v in fields.items() if k != "moe_args"},
                                moe_args=MoEArgs(**fields["moe_args"]))
    with torch.device("meta"):
        model = Qwen3Model(model_args)
    _, per_token = model_args.get_nparams_and_flops(model, 4096)
    from etp.train.flops import training_flops

    assert per_token == training_flops(_recipe(layers=4), 1) == _flops_per_token_by_hand(4)


def test_toml_round_trips_through_a_toml_reader():
    config = {"a": {"s": 'quote " and \\ backslash', "t": True, "f": False, "i": 3, "x": 1e-08, "y": 0.0003,
                    "l": ["model", "loss"]},
              "b": {"z": 0.0}}
    assert tomllib.loads(bench.to_toml(config)) == config
    with pytest.raises(TypeError):
        bench.to_toml({"a": {"d": {"nested": 1}}})
    with pytest.raises(ValueError):
        bench.to_toml({"a": {"n": float("nan")}})


def test_titans_log_lines_and_metrics_file_read_the_same_steps():
    plain = bench.parse_titan_log((DATA / "torchtitan_0.2.2_plain.log").read_text())
    colored = bench.parse_titan_log((DATA / "torchtitan_0.2.2_color.log").read_text())
    assert plain == colored and [s["step"] for s in plain] == [1, 2, 3]
    assert plain[1] == {"step": 2, "loss": 11.4375, "grad_norm": 2.875, "reserved_gib": 70.1, "tps": 45259.0,
                        "tflops": 182.74, "mfu_pct": 18.48}
    from_file, _ = bench.titan_steps(DATA / "torchtitan_0.2.2_metrics.jsonl", "", tokens_per_step=8192)
    from_log, _ = bench.titan_steps(DATA / "missing.jsonl", (DATA / "torchtitan_0.2.2_plain.log").read_text(), 8192)
    for a, b in zip(from_file, from_log, strict=True):
        assert a["step"] == b["step"] and a["loss"] == b["loss"]
        # 8192 tokens over the logged tps, which the log rounds to a whole number
        assert a["ms"] == pytest.approx(b["ms"], rel=1 / b["tokens_per_s"])
        assert a["own_tflops"] == pytest.approx(b["own_tflops"], abs=0.006)
        assert a["own_mfu"] == pytest.approx(b["own_mfu"], abs=6e-5)
    assert from_file[1]["ms"] == pytest.approx(181.0, abs=0.1) and from_file[1]["titan_max_active_gib"] == pytest.approx(55.7)


def test_summary_applies_etps_formula_to_the_median_of_the_timed_steps():
    recipe = _recipe(layers=4, micro=2, steps=10)
    steps = [{"step": i, "ms": 5000.0 if i <= 3 else 100.0 + i, "loss": 12.0 - i, "own_tflops": 1.0}
             for i in range(1, 11)]
    summary = bench.summarize(steps, recipe, warmup=3, device_name="NVIDIA H200")
    assert summary["timed_steps"] == [4, 5, 6, 7, 8, 9, 10]
    assert summary["ms_per_step_median"] == 107.0  # steps 4..10: 104..110; the warm-up's 5000 ms left out
    flops = _flops_per_token_by_hand(4) * 2 * 4096
    assert summary["flops_per_step"] == flops
    assert summary["tflops_etp_formula"] == pytest.approx(flops / 0.107 / 1e12)
    assert summary["mfu_etp_formula"] == pytest.approx(flops / 0.107 / 1e12 / 989.0)
    assert summary["losses"] == [12.0 - i for i in range(1, 11)]
    assert bench.summarize(steps, recipe, warmup=3, device_name=None)["mfu_etp_formula"] is None


def test_etp_report_and_its_stream_read_the_same_iterations(tmp_path):
    sample = json.loads((DATA / "etp_train_report.json").read_text())
    steps, report = bench.etp_steps(DATA / "etp_train_report.json")
    assert [s["step"] for s in steps] == [1, 2, 3] and [s["loss"] for s in steps] == sample["losses"]
    assert steps[1]["ms"] == sample["log"][1]["ms_per_iter"] and report["ms_per_iter"] == sample["ms_per_iter"]
    # A run killed before its report: the .jsonl stream beside it (validation records skipped).
    stream = tmp_path / "run.jsonl"
    stream.write_text("\n".join(json.dumps(r) for r in [*sample["log"][:2], {"iteration": 2, "validation_loss": 5.8}])
                      + "\n{\"iteration\": 3, \"lo")
    streamed, missing = bench.etp_steps(tmp_path / "run.json")
    assert missing == {} and [s["loss"] for s in streamed] == sample["losses"][:2]


def test_run_child_records_a_failure_and_stops_a_run_past_its_timeout(tmp_path, capsys):
    lines = "; ".join(f"print('iter {i:5d}/20 | loss 1.0')" for i in range(1, 8))
    failed = bench.run_child("fails", [sys.executable, "-c", f"{lines}; raise SystemExit(3)"], {}, 30,
                             tmp_path / "fails.log")
    assert failed["returncode"] == 3 and not failed["timed_out"] and "iter     7/20" in failed["error_tail"]
    echoed = capsys.readouterr().out
    assert "s] iter     1/20" in echoed and "s] iter     5/20" in echoed and "s] iter     4/20" not in echoed
    began = time.monotonic()
    # A parent (torchrun's place) whose child (a worker's) sleeps too: the whole process group goes.
    hung = bench.run_child("hangs", [sys.executable, "-c", "import subprocess, sys, time; worker = subprocess.Popen("
                                     "[sys.executable, '-c', 'import time; time.sleep(60)']); print('worker', "
                                     "worker.pid, flush=True); time.sleep(60)"], {}, 2, tmp_path / "hangs.log")
    assert hung["timed_out"] and time.monotonic() - began < 30
    worker = int(hung["error_tail"].split("worker ")[1].split()[0])
    for _ in range(50):
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the worker {worker} outlived the timeout")


def test_main_reports_every_run_when_one_fails(tmp_path, monkeypatch, capsys):
    """The three runs replaced by stand-ins writing the captured samples: etp succeeds, torchtitan
    succeeds, megatron_stock fails; the report keeps all three, the failure's tail included."""
    def fake_run_child(name, command, env, timeout, log_path):
        work = log_path.parent
        if name == "etp":
            (work / "etp.json").write_text((DATA / "etp_train_report.json").read_text())
            log_path.write_text("etp-train: cuda_graph auto -> step: captured\n")
        elif name == "torchtitan":
            assert env["ETP_TITAN_BENCH"] == str(work / "titan_spec.json")
            (work / "titan_metrics.jsonl").write_text((DATA / "torchtitan_0.2.2_metrics.jsonl").read_text())
            log_path.write_text((DATA / "torchtitan_0.2.2_plain.log").read_text())
        else:
            log_path.write_text("Traceback\ntorch.OutOfMemoryError: CUDA out of memory\n")
            return {"command": shlex.join(command), "returncode": 1, "timed_out": False, "timeout_s": timeout,
                    "wall_s": 1.0, "log": str(log_path), "error_tail": log_path.read_text()}
        return {"command": shlex.join(command), "returncode": 0, "timed_out": False, "timeout_s": timeout,
                "wall_s": 1.0, "log": str(log_path)}

    monkeypatch.setattr(bench, "run_child", fake_run_child)
    out = tmp_path / "titan.json"
    assert bench.main(["--steps", "3", "--warmup", "1", "--work-dir", str(tmp_path / "w"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [runs[n]["status"] for n in bench.RUNS] == ["ok", "ok", "failed, exit 1 (0/3 steps)"]
    assert "CUDA out of memory" in runs["megatron_stock"]["error_tail"]
    assert runs["torchtitan"]["ms_per_step_median"] == pytest.approx((181.0 + 176.0) / 2, abs=0.1)
    assert runs["torchtitan"]["num_flops_per_token_titan"] == runs["torchtitan"]["etp_flops_per_token"]
    assert runs["torchtitan"]["titan_max_reserved_gib"] == pytest.approx(70.1)
    assert runs["etp"]["losses"] == json.loads((DATA / "etp_train_report.json").read_text())["losses"]
    assert runs["etp"]["cuda_graph"].startswith("etp-train: cuda_graph auto -> step")
    assert report["differences"] == list(bench.DIFFERENCES)
    printed = capsys.readouterr().out
    assert "| torchtitan | ok | 178.5 |" in printed and "| megatron_stock | failed, exit 1 (0/3 steps) |" in printed


launch = importlib.import_module("bench_torchtitan_launch")


def test_token_file_loader_yields_each_steps_rows_then_stops(tmp_path):
    ids = numpy.arange(3 * 4 * 6, dtype=numpy.int32).reshape(3, 4, 6)
    numpy.save(tmp_path / "ids.npy", ids)
    loader = launch.TokenFileLoader(tmp_path / "ids.npy", dp_rank=1, dp_world_size=2)
    batches = list(loader)
    assert len(batches) == 3
    for step, (inputs, labels) in enumerate(batches):
        assert inputs["input"].dtype == torch.int64 and inputs["input"].shape == (2, 5)
        assert torch.equal(inputs["input"], torch.from_numpy(ids[step, 2:4, :-1]).long())
        assert torch.equal(labels, torch.from_numpy(ids[step, 2:4, 1:]).long())
    resumed = launch.TokenFileLoader(tmp_path / "ids.npy", dp_rank=0, dp_world_size=1)
    resumed.load_state_dict({"next_step": 2})
    assert [b[1].shape for b in resumed] == [(4, 5)] and resumed.state_dict() == {"next_step": 3}
    with pytest.raises(ValueError, match="divisible by 3"):
        launch.TokenFileLoader(tmp_path / "ids.npy", dp_rank=0, dp_world_size=3)


def test_capturing_logger_writes_the_step_before_handing_it_on(tmp_path):
    seen = []

    class Inner:
        def log(self, metrics, step):
            seen.append((step, metrics, (tmp_path / "m.jsonl").read_text().count("\n")))

        def close(self):
            seen.append("closed")

    class Monitor:
        device_name = "NVIDIA H200"

    class Processor:
        num_flops_per_token, gpu_peak_flops, device_memory_monitor = 7, 989e12, Monitor()

    logger = launch.CapturingLogger(Inner(), tmp_path / "m.jsonl", Processor())
    metrics = {"loss_metrics/global_avg_loss": torch.tensor(2.5), "tflops": 1.5, "mfu(%)": 0.2}
    logger.log(metrics, 4)
    logger.close()
    record = json.loads((tmp_path / "m.jsonl").read_text())
    assert record["step"] == 4 and record["loss_metrics/global_avg_loss"] == 2.5 and record["num_flops_per_token"] == 7
    assert record["device_name"] == "NVIDIA H200" and "max_memory_allocated_gib" in record
    assert seen == [(4, metrics, 1), "closed"]  # the record was on disk when torchtitan's logger ran


def test_datasets_stand_in_only_where_datasets_does_not_import():
    code = ("import sys; sys.path.insert(0, 'tools'); sys.modules['datasets'] = None; import bench_torchtitan_launch as l; "
            "print(l.import_datasets_or_stub()); from datasets import Dataset, load_dataset; "
            "from datasets.distributed import split_dataset_by_node\n"
            "try:\n    split_dataset_by_node(None)\nexcept RuntimeError as e:\n    print('raises', e)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("stub (ModuleNotFoundError") and "raises the datasets package did not import" in done.stdout


def test_torchtitans_metrics_processor_writes_the_fields_the_tool_reads(tmp_path, monkeypatch):
    pytest.importorskip("torchtitan")
    launch.import_datasets_or_stub()
    import types

    import torchtitan.components.metrics as metrics
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    class Props:
        total_memory = 139 * 2**30

    stats = {"active_bytes.all.peak": 50 * 2**30, "reserved_bytes.all.peak": 60 * 2**30, "num_alloc_retries": 0,
             "num_ooms": 0}
    monkeypatch.setattr(metrics, "device_module", types.SimpleNamespace(
        get_device_name=lambda d=None: "NVIDIA H200", current_device=lambda: 0, get_device_properties=lambda d=None: Props(),
        reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None, memory_stats=lambda d=None: stats))
    config = ConfigManager().parse_args(["--metrics.log_freq", "1"])
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    processor = launch.build_capturing_metrics(tmp_path / "m.jsonl", config, dims, None)
    processor.num_flops_per_token, processor.ntokens_since_last_log = 1000, 8192
    processor.data_loading_times.append(0.0)
    processor.time_last_log = time.perf_counter() - 0.25
    processor.log(1, 3.5, 3.5, 1.25, extra_metrics={"lr": 3e-4})
    steps, _ = bench.titan_steps(tmp_path / "m.jsonl", "", tokens_per_step=8192)
    assert steps[0]["loss"] == 3.5 and steps[0]["ms"] == pytest.approx(250, rel=0.05)
    assert steps[0]["own_tflops"] == pytest.approx(1000 * 8192 / (steps[0]["ms"] / 1e3) / 1e12)
    assert steps[0]["titan_max_active_gib"] == 50 and steps[0]["titan_max_reserved_gib"] == 60


def test_each_run_gets_its_cap_or_what_the_budget_leaves_the_later_runs(tmp_path, monkeypatch):
    given = {}

    def fake_run_child(name, command, env, timeout, log_path):
        given[name] = timeout
        log_path.write_text("")
        return {"command": shlex.join(command), "returncode": 0, "timed_out": False, "timeout_s": timeout,
                "wall_s": 0.0, "log": str(log_path)}

    monkeypatch.setattr(bench, "run_child", fake_run_child)
    common = ["--steps", "3", "--warmup", "1", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "r.json")]
    bench.main(["--budget-s", "200", *common])
    # etp: 200 less 60 s for each of the two later runs; torchtitan: less 60 for one; the last its cap.
    assert 70 < given["etp"] <= 80 and 130 < given["torchtitan"] <= 140 and given["megatron_stock"] == 120
    given.clear()
    bench.main(["--budget-s", "100", "--timeout", "megatron_stock=50", *common])
    report = json.loads((tmp_path / "r.json").read_text())
    assert "etp" not in given and report["runs"]["etp"]["status"] == "not run"  # under 30 s left for it
    assert 30 <= given["torchtitan"] <= 40 and given["megatron_stock"] == 50


def _trace(gemm_us: float, adam_us: float) -> dict:
    """A two-kernel Chrome trace over one profiler step (microseconds)."""
    return {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#9", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 10, "dur": gemm_us, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>",
         "ts": 500, "dur": adam_us, "args": {}}]}


def test_profile_finds_each_runs_trace_and_classifies_it(tmp_path):
    """``--profile``: etp-train's trace under ``<run>_profile/`` and torchtitan's under its dump
    folder, each through etp's classifier; a run without a trace says so."""
    (tmp_path / "etp_profile").mkdir()
    (tmp_path / "etp_profile" / "trace_rank0.json").write_text(json.dumps(_trace(300, 200)))
    titan = tmp_path / "titan" / "profile_traces" / "iteration_10"
    titan.mkdir(parents=True)
    (titan / "rank0_trace.json").write_text(json.dumps(_trace(100, 400)))
    runs = {name: {"profile": bench.profile_breakdown(name, tmp_path)}
            for name in ("etp", "torchtitan", "megatron_stock")}
    assert runs["megatron_stock"]["profile"] == {"error": "no trace written"}
    assert runs["etp"]["profile"]["classes"]["gemm"] == pytest.approx(0.3)
    assert runs["torchtitan"]["profile"]["classes"]["optimizer"] == pytest.approx(0.4)
    table = bench.profile_markdown(runs)
    assert "| gemm | 0.30 | 0.10 |" in table and "megatron_stock" not in table
