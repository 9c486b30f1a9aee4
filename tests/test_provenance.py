"""etp.provenance: the command that reproduces a run (as typed, under torchrun too), the GPUs and
the commit, against what git and the environment say independently."""
import subprocess
from pathlib import Path

from etp.provenance import run_provenance

ROOT = Path(__file__).resolve().parents[1]


def test_a_torchrun_worker_records_the_launcher_and_the_module(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    found = run_provenance([str(ROOT / "etp" / "train" / "__main__.py"), "--recipe", "recipes/moe_wide.yaml"])
    assert found["command"] == ("torchrun --standalone --nproc-per-node=2 -m etp.train "
                                "--recipe recipes/moe_wide.yaml")
    tool = run_provenance([str(ROOT / "tools" / "bench_kernels.py"), "--out", "k.json"])
    assert tool["command"].endswith("tools/bench_kernels.py --out k.json")


def test_the_commit_and_tree_state_are_gits():
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    found = run_provenance([])
    assert found["commit"] == head.stdout.strip()
    assert isinstance(found["dirty"], bool) and found["gpu_count"] >= 0 and found["torch"]
