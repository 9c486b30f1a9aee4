"""etp-train on an indexed dataset: validation every eval_interval iterations and at the end, the
test split at the end, printed and in the JSON; a run resumed from a checkpoint (at another
data-parallel layout) continues the uninterrupted run's training and validation losses, because
the checkpoint holds the samples each split consumed."""
import json

import pytest
import torch
from data_cases import TINY

pytest.importorskip("megatron.core")


def _train(capfd, tmp_path, name, *argv):
    from etp.train.main import main

    base = ["--recipe", str(TINY), "--train-iters", "8", "--log-interval", "2", "--set", "eval_interval=2",
            "--set", "eval_iters=1", "--set", f"data_cache_path={tmp_path / 'cache'}", "--set", "micro_batch_size=2"]
    code = main([*base, *argv, "--json", str(tmp_path / f"{name}.json")])
    out = capfd.readouterr().out
    assert code == 0, out
    return json.loads((tmp_path / f"{name}.json").read_text()), out


@pytest.mark.slow  # three etp-train runs; the readers' resumption is tests/data/test_gpt_batches.py's
def test_validation_and_resumption_at_another_layout(tmp_path, capfd):
    full, out = _train(capfd, tmp_path, "full")
    assert [r["iteration"] for r in full["validation"]] == [2, 4, 6, 8] and full["test"]["iteration"] == 8
    assert all(abs(r["ppl"] - torch.tensor(r["loss"]).exp().item()) < 1e-6 * r["ppl"] for r in full["validation"])
    assert "validation loss at iteration 4 | lm loss" in out and "test loss at iteration 8" in out
    save = ["--set", f"save={tmp_path / 'ckpt'}", "--set", "save_interval=4"]
    first, _ = _train(capfd, tmp_path, "first", *save, "--exit-after", "4")
    four = ["--set", "world_size=4", "--set", "etp.etp_size=4", "--set", "etp.expert_etp_size=4",
            "--set", "micro_batch_size=1", "--set", f"load={tmp_path / 'ckpt'}", "--set", f"save={tmp_path / 'ckpt4'}"]
    resumed, _ = _train(capfd, tmp_path, "resumed", *four, "--resume", "4")
    assert first["losses"] == full["losses"][:4]
    close = dict(rtol=1e-4, atol=0)  # another layout: the same samples, summed in another order
    assert torch.allclose(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][4:]), **close)
    valid = [r["loss"] for r in full["validation"][2:]]
    assert torch.allclose(torch.tensor([r["loss"] for r in resumed["validation"]]), torch.tensor(valid), **close)
    assert abs(resumed["test"]["loss"] - full["test"]["loss"]) < 1e-4 * full["test"]["loss"]
