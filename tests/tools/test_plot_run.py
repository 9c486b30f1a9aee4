"""tools/plot_run.py: every line it draws holds exactly the values of the stream it read, panels
follow the fields present, and the PNG is written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import plot_run  # noqa: E402


def _stream(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_each_line_is_the_stream_it_read(tmp_path):
    records = [{"iteration": i, "loss": 3.0 / i, "tokens_per_s": 100.0 * i, "load_balancing_loss": 1 + 0.1 / i,
                "moe/expert_load_max_over_mean_layer_10": 1.0 + 2 / i,
                "moe/expert_load_max_over_mean_layer_2": 1.0 + 1 / i} for i in range(1, 6)]
    records[2]["validation_loss"] = 0.9
    figure = plot_run.plot({"run": records})
    lines = {(ax.get_title(), ln.get_label()): (list(ln.get_xdata()), list(ln.get_ydata()))
             for ax in figure.axes for ln in ax.get_lines()}
    assert lines[("loss", "loss")] == ([1, 2, 3, 4, 5], [r["loss"] for r in records])
    assert lines[("loss", "validation_loss")] == ([3], [0.9])
    assert lines[("throughput", "tokens_per_s")][1] == [r["tokens_per_s"] for r in records]
    load = "expert load (max / mean tokens per expert)"
    assert lines[(load, "layer 2")][1] == [1 + 1 / i for i in range(1, 6)]
    assert lines[(load, "layer 10")][1] == [1 + 2 / i for i in range(1, 6)]
    assert [ln.get_label() for ax in figure.axes if ax.get_title() == load for ln in ax.get_lines()] == [
        "layer 2", "layer 10"]
    assert lines[("router losses (mean over MoE layers)", "load_balancing_loss")][1] == [1 + 0.1 / i for i in range(1, 6)]
    assert ("throughput", "tflops_per_rank") not in lines


def test_the_command_writes_the_png(tmp_path):
    stream = _stream(tmp_path / "run.jsonl", [{"iteration": 1, "loss": 2.0}, {"iteration": 2, "loss": 1.5},
                                               {"summary": {"ms_per_iter": 3.0}}])
    out = tmp_path / "run.png"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_run.py"), str(stream), "--out", str(out)],
                          capture_output=True, text=True, check=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "run: 2 records" in done.stdout
