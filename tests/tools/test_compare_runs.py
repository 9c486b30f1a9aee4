"""tools/compare_recipe_runs.py: the verdict on the mean of the last 10 losses, per-iteration
and moving-average differences beside it (hand-computed figures)."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "compare_recipe_runs", Path(__file__).resolve().parents[2] / "tools" / "compare_recipe_runs.py")
compare_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_runs)


def test_verdict_on_the_tail_mean():
    base = {"losses": [4.0] * 10 + [2.0] * 10}
    spiky = {"losses": [4.0] * 9 + [5.0] + [2.04] * 10}  # one spike, tail 2% high
    got = compare_runs.compare(spiky, base, tolerance=0.03)
    assert got["within_tolerance"] and got["tail_rel_diff"] == pytest.approx(0.02)
    assert got["max_rel_loss_diff"] == pytest.approx(0.25) and got["at_iteration"] == 10
    # worst window: iterations 10-14, (5 + 4 x 2.04) / 5 against (4 + 4 x 2) / 5
    assert got["max_rel_diff_moving_average_5"] == pytest.approx((13.16 - 12) / 12)
    assert not compare_runs.compare(spiky, base, tolerance=0.01)["within_tolerance"]
    with pytest.raises(ValueError, match="same train_iters"):
        compare_runs.compare({"losses": [1.0]}, base, 0.03)
