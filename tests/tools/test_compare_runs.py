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


def test_window_labels_and_plot(tmp_path, capsys):
    import json

    base = {"losses": [4.0] * 10 + [2.0] * 10}
    late = {"losses": [4.0] * 10 + [2.0] * 5 + [2.1] * 5}  # the last 5 are 5% high: 2.5% over the last 10
    assert compare_runs.compare(late, base, 0.03, window=10)["within_tolerance"]
    assert not compare_runs.compare(late, base, 0.03, window=5)["within_tolerance"]
    run = {"param_bytes_per_rank": {"after_etp": 2**30}, "etp": {"etp_size": 4, "expert_etp_size": 4},
           "ms_per_iter": 1.0, "tflops_per_rank": 1.0, "peak_allocated_gib": 1.0, "peak_reserved_gib": 1.0}
    paths = []
    for name, losses in (("a", late), ("b", base)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({**run, **losses}))
    png = tmp_path / "losses.png"
    code = compare_runs.main(["--etp", str(paths[0]), "--baseline", str(paths[1]), "--window", "5",
                              "--labels", "FP8,bf16", "--plot", str(png), "--floor", "1.5"])
    assert code == 1 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| FP8 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compare_runs.main(["--etp", str(paths[0]), "--baseline", str(paths[1]), "--labels", "only-one"])
