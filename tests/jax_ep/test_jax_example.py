"""examples/jax_ep_moe.py trains a few steps and matches the dense single-device layer."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax.numpy")

REPO = Path(__file__).resolve().parents[2]


def test_jax_ep_moe_example_matches_dense():
    env = dict(os.environ)
    # The example makes 4 host devices itself unless XLA_FLAGS already sets a count.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run([sys.executable, str(REPO / "examples" / "jax_ep_moe.py")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK"), result.stdout
