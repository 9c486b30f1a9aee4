"""tools/hf_round_trip.py's --cpu-smoke with --leave-alone: the whole round trip on 2 gloo ranks
(import, transformers' loss against etp's, fine-tune, export, reload) with the fine-tune left alone:
an indexed dataset, validation, TensorBoard, async saves, a SIGTERM to the ranks mid-run, and the
same command resuming from that save to the end."""
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
