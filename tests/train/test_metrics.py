"""etp/train/metrics.py ([Note: the metrics stream]): a JSON-lines stream that a killed writer
leaves readable, TensorBoard scalars read back by TensorBoard's own reader, the fields a W&B run
receives, and a missing package named before a run starts."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

from etp.train import metrics


def _recipe(**train):
    keys = {"tensorboard_dir": None, "wandb_project": None, "wandb_exp_name": None, "wandb_save_dir": None}
    return types.SimpleNamespace(train=types.SimpleNamespace(**{**keys, **train}), source="r.yaml",
                                 model=types.SimpleNamespace(hidden_size=64), etp=types.SimpleNamespace(etp_size=2))


def test_a_killed_writer_leaves_every_line_it_logged(tmp_path):
    path = tmp_path / "run.jsonl"
    code = textwrap.dedent(f"""
        import os
        from etp.train.metrics import JsonlSink
        sink = JsonlSink({str(path)!r})
        for i in (10, 20, 30):
            sink.log({{"iteration": i, "loss": 3.0 - i / 100}})
        os._exit(9)  # no close, no flush at exit: a crash
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    records, summary = metrics.read_stream(path)
    assert [r["iteration"] for r in records] == [10, 20, 30] and records[-1]["loss"] == pytest.approx(2.7)
    assert summary is None
    with open(path, "a") as f:
        f.write('{"iteration": 40, "lo')  # a line cut short
    assert len(metrics.read_stream(path)[0]) == 3


def test_a_clean_close_ends_with_the_summary(tmp_path):
    stream = metrics.MetricsStream.open(_recipe(), rank=0, jsonl=tmp_path / "run.jsonl")
    stream.log({"iteration": 5, "loss": 1.5})
    stream.close({"ms_per_iter": 12.0})
    records, summary = metrics.read_stream(tmp_path / "run.jsonl")
    assert records == [{"iteration": 5, "loss": 1.5}] and summary == {"ms_per_iter": 12.0}
    assert metrics.MetricsStream.open(_recipe(), rank=1, jsonl=tmp_path / "other.jsonl").sinks == []
    assert not (tmp_path / "other.jsonl").exists()


def test_tensorboard_reads_back_each_scalar(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    stream = metrics.MetricsStream.open(_recipe(tensorboard_dir=str(tmp_path / "tb")), rank=0)
    rows = [{"iteration": 10, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "profiled": False},
            {"iteration": 20, "loss": 2.25, "lr": 5e-4, "grad_norm": 0.75, "profiled": True}]
    for row in rows:
        stream.log(row)
    stream.close()
    reader = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    reader.Reload()
    assert set(reader.Tags()["scalars"]) == {"loss", "lr", "grad_norm"}
    assert [(e.step, e.value) for e in reader.Scalars("loss")] == [(10, 2.5), (20, 2.25)]
    assert [(e.step, e.value) for e in reader.Scalars("grad_norm")] == [(20, 0.75)]


def test_wandb_gets_the_numbers_at_their_iteration_offline(tmp_path, monkeypatch):
    calls = {}

    class Run:
        summary = {}

        def log(self, values, step):
            calls.setdefault("log", []).append((step, values))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    stream = metrics.MetricsStream.open(_recipe(wandb_project="p", wandb_exp_name="e",
                                                wandb_save_dir=str(tmp_path / "w")), rank=0)
    stream.log({"iteration": 3, "loss": 2.0, "mfu": None, "note": "x"})
    stream.close({"ms_per_iter": 4.0})
    assert calls["init"]["mode"] == "offline" and calls["init"]["project"] == "p" and calls["init"]["name"] == "e"
    assert calls["init"]["config"]["etp.etp_size"] == 2 and calls["init"]["dir"] == str(tmp_path / "w")
    assert calls["log"] == [(3, {"loss": 2.0})] and calls["finished"]


def test_a_missing_package_is_named(monkeypatch):
    real = metrics.importlib.util.find_spec
    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert metrics.missing_packages(_recipe(wandb_project="p")) == ["wandb"]
    assert metrics.missing_packages(_recipe()) == []


@pytest.mark.slow  # starts wandb's service process; the fake above covers what etp hands it
def test_a_real_offline_wandb_run_writes_its_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    stream = metrics.MetricsStream.open(_recipe(wandb_project="p", wandb_save_dir=str(tmp_path)), rank=0)
    stream.log({"iteration": 1, "loss": 2.0})
    stream.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_etp_train_streams_every_log_window_and_tensorboard_gets_them(tmp_path):
    from pathlib import Path

    from etp.train.main import main

    pytest.importorskip("tensorboard")
    root = Path(__file__).resolve().parents[2]
    report = tmp_path / "run.json"
    assert main(["--recipe", str(root / "recipes" / "tiny_moe_cpu.yaml"), "--train-iters", "4", "--log-interval", "2",
                 "--set", f"tensorboard_dir={tmp_path / 'tb'}", "--set", "eval_interval=4", "--set", "eval_iters=1",
                 "--json", str(report)]) == 0
    records, summary = metrics.read_stream(tmp_path / "run.jsonl")
    windows = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in windows] == [2, 4] and summary is not None
    assert [r["loss"] for r in windows] == [r["loss"] for r in json.loads(report.read_text())["log"]]
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in windows)
    assert any("validation_loss" in r for r in records)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
