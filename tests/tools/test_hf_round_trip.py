"""tools/hf_round_trip.py. Its --cpu-smoke with --leave-alone: the whole round trip on 2 gloo ranks
(import, transformers' loss against etp's, fine-tune, export, reload) with the fine-tune left alone:
an indexed dataset, validation, TensorBoard, async saves, a SIGTERM to the ranks mid-run, and the
same command resuming from that save to the end. And a failed stage ends the run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_smoke_left_alone_passes(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("megatron.core")
    out = tmp_path / "hf.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "hf_round_trip.py"), "--cpu-smoke", "--leave-alone",
                           "--iters", "4", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["leave_alone"] and all(report["leave_alone"].values()), report["leave_alone"]
    assert report["stages"]["finetune_until_sigterm"]["sigterm_at_iteration"] >= 2


def test_a_failed_stage_ends_the_round_trip(tmp_path, monkeypatch):
    """A stage that exits non-zero is the last to run: its name is the report's ``failed_stage``
    and the script exits 1 (a fine-tune out of GPU memory must not go on to export nothing)."""
    pytest.importorskip("transformers")
    pytest.importorskip("megatron.core")
    import importlib.util

    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("_hf_round_trip", ROOT / "tools" / "hf_round_trip.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ran = []

    def fake_timed(command, log, timeout, sigterm_after=None):
        ran.append(log.stem)
        return {"command": " ".join(command), "rc": 1 if log.stem == "import_loss" else 0, "wall_s": 0.0,
                "peak_rss_gb": 0.0, "losses": {}}

    monkeypatch.setattr(tool, "_timed", fake_timed)
    out = tmp_path / "hf.json"
    assert tool.main(["--cpu-smoke", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert ran == ["import", "import_loss"]
    assert report["failed_stage"] == "import_loss" and not report["passed"]
