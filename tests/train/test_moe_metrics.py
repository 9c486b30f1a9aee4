"""etp/train/moe_metrics.py ([Note: MoE metrics]): each log window's router losses against
megatron-core's formulas recomputed in float64 from the logits every router saw, and its expert
load against the token counts the experts received, summed over both ranks; the same figures in
the log line, the metrics stream, the report and TensorBoard. One 2-rank run of the tiny recipe
(two micro-batches per iteration, a z-loss, a validation inside each window) serves every
assertion."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from harness import run_distributed

from etp.train import metrics

pytest.importorskip("megatron.core")
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_moe_cpu.yaml"
ITERS, INTERVAL, MICRO, TOPK, EXPERTS, TOKENS = 4, 2, 2, 2, 4, 8 * 64  # tokens: global batch x sequence


def _train_with_probes(ctx, out_dir: str):
    """One rank of the run, with megatron-core's router and etp's experts probed: every training
    forward's router logits and the experts' ``tokens_per_expert`` (copies, in call order)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from etp.megatron.model import ETPGroupedExperts
    from etp.recipe import Recipe
    from etp.train import train
    from etp.train.options import RunOptions

    logits, loads = [], []
    routing, forward = TopKRouter.routing, ETPGroupedExperts.forward

    def probed_routing(self, scores, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            logits.append((self.layer_number - 1, scores.detach().reshape(-1, scores.shape[-1]).double().clone()))
        return routing(self, scores, *args, **kwargs)

    def probed_forward(self, hidden, tokens_per_expert, probs):
        if torch.is_grad_enabled():  # validation runs under no_grad
            loads.append((id(self), tokens_per_expert.detach().to(torch.int64).cpu().clone()))
        return forward(self, hidden, tokens_per_expert, probs)

    import importlib.util

    tensorboard = str(Path(out_dir) / "tb") if importlib.util.find_spec("tensorboard") else None
    # Two micro-batches of 2 per rank and iteration: the losses' 1 / micro-batches scale counts.
    recipe = Recipe.from_yaml(RECIPE, train_iters=ITERS, log_interval=INTERVAL, eval_interval=INTERVAL, eval_iters=1,
                              micro_batch_size=4 // MICRO, moe_z_loss_coeff=1e-3, tensorboard_dir=tensorboard)
    TopKRouter.routing, ETPGroupedExperts.forward = probed_routing, probed_forward
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            train(ctx.rank, ctx.world_size, recipe, RunOptions(json_path=str(Path(out_dir) / "run.json")))
    finally:
        TopKRouter.routing, ETPGroupedExperts.forward = routing, forward
    return {"logits": logits, "loads": loads, "stdout": printed.getvalue(), "tensorboard": tensorboard}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_metrics")
    ranks = run_distributed(_train_with_probes, 2, str(out), timeout=600)
    records, _ = metrics.read_stream(out / "run.jsonl")
    windows = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in windows] == [2, 4]
    return {"ranks": ranks, "windows": windows, "report": json.loads((out / "run.json").read_text())}


def _switch_aux_loss(logits: torch.Tensor) -> float:
    """megatron-core's ``switch_load_balancing_loss_func`` without its coefficient, on one rank's
    tokens in float64: E / (K T^2) * sum_i (sum_t p_ti) * (tokens routed to i by the top-k of p)."""
    probs = logits.softmax(dim=-1)
    routed = torch.zeros_like(probs).scatter(1, probs.topk(TOPK, dim=1).indices, 1.0).sum(dim=0)
    tokens = logits.shape[0]
    return float((probs.sum(dim=0) * routed).sum() * EXPERTS / (TOPK * tokens * tokens))


def _z_loss(logits: torch.Tensor) -> float:
    """megatron-core's ``z_loss_func`` without its coefficient: the mean of logsumexp^2."""
    return float(logits.logsumexp(dim=-1).square().mean())


def _per_window(calls: list) -> list[list]:
    """One rank's calls of one layer, split into the log windows."""
    assert len(calls) == ITERS * MICRO  # training forwards only: validation saved nothing
    return [calls[w * INTERVAL * MICRO:(w + 1) * INTERVAL * MICRO] for w in range(ITERS // INTERVAL)]


def test_router_losses_are_megatrons_formulas_averaged_over_ranks_and_iterations(run):
    for name, formula in (("load_balancing_loss", _switch_aux_loss), ("z_loss", _z_loss)):
        for layer in (0, 1):
            per_rank = [_per_window([x for i, x in rank["logits"] if i == layer]) for rank in run["ranks"]]
            for w, window in enumerate(run["windows"]):
                expected = sum(formula(x) for calls in per_rank for x in calls[w]) / (2 * INTERVAL * MICRO)
                assert window[f"moe/{name}_layer_{layer}"] == pytest.approx(expected, rel=1e-5), (name, layer, w)
        for window in run["windows"]:
            assert window[name] == pytest.approx((window[f"moe/{name}_layer_0"] + window[f"moe/{name}_layer_1"]) / 2)


def test_expert_load_is_what_the_experts_received_on_both_ranks(run):
    for layer in (0, 1):
        per_rank = []
        for rank in run["ranks"]:
            modules = list(dict.fromkeys(module for module, _ in rank["loads"]))  # first call first: layer order
            per_rank.append(_per_window([n for module, n in rank["loads"] if module == modules[layer]]))
        for w, window in enumerate(run["windows"]):
            counts = sum(n for calls in per_rank for n in calls[w])
            # Every token of the global batch goes to top-k experts: an exact identity per layer.
            assert int(counts.sum()) == TOKENS * TOPK * INTERVAL
            assert window[f"moe/expert_load_max_layer_{layer}"] == int(counts.max())
            assert window[f"moe/expert_load_mean_layer_{layer}"] == TOKENS * TOPK * INTERVAL / EXPERTS
            assert window[f"moe/expert_load_max_over_mean_layer_{layer}"] == pytest.approx(
                int(counts.max()) * EXPERTS / (TOKENS * TOPK * INTERVAL), rel=1e-12)
    for window in run["windows"]:
        worst = max(window[f"moe/expert_load_max_over_mean_layer_{layer}"] for layer in (0, 1))
        assert window["expert_load_max_over_mean"] == worst and 1 <= worst <= EXPERTS / TOPK


def test_the_log_line_the_report_and_tensorboard_carry_them(run):
    lines = [line for line in run["ranks"][0]["stdout"].splitlines() if line.startswith("iter ")]
    assert len(lines) == len(run["windows"])
    for line, window in zip(lines, run["windows"]):
        worst = max((0, 1), key=lambda i: window[f"moe/expert_load_max_over_mean_layer_{i}"])
        assert line.endswith(f"| load_balancing_loss {window['load_balancing_loss']:.4g} | z_loss "
                             f"{window['z_loss']:.4g} | expert load max/mean "
                             f"{window['expert_load_max_over_mean']:.2f} (layer {worst})"), line
    assert not [line for line in run["ranks"][1]["stdout"].splitlines() if line.startswith("iter ")]
    keys = [k for k in run["windows"][0] if "load" in k or "z_loss" in k]
    assert len(keys) == 2 + 1 + 2 * 2 + 3 * 2  # two losses, the worst ratio; per layer two losses, three loads
    for logged, window in zip(run["report"]["log"], run["windows"]):
        assert {k: logged[k] for k in keys} == {k: window[k] for k in keys}
    if run["ranks"][0]["tensorboard"] is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        reader = EventAccumulator(run["ranks"][0]["tensorboard"])
        reader.Reload()
        for key in ("load_balancing_loss", "moe/z_loss_layer_1", "moe/expert_load_max_layer_0"):
            assert [(e.step, e.value) for e in reader.Scalars(key)] == [
                (w["iteration"], pytest.approx(w[key], rel=1e-6)) for w in run["windows"]]


class _FakeRouter(torch.nn.Module):
    """A router of megatron-core's shape: ``forward`` returns (probs, routing_map)."""

    def __init__(self, layer_number: int, routing_map: torch.Tensor) -> None:
        super().__init__()
        import types

        self.layer_number, self.routing_map = layer_number, routing_map
        self.config = types.SimpleNamespace(num_moe_experts=routing_map.shape[1], sequence_parallel=False)
        self.tp_group = types.SimpleNamespace(size=lambda: 1)
        self.weight = torch.nn.Parameter(torch.zeros(routing_map.shape[1], 2))

    def forward(self, hidden):
        return self.routing_map.float(), self.routing_map


def test_only_training_forwards_count_and_an_untracked_loss_is_absent():
    """No router saved a loss (``moe_aux_loss_coeff: 0``, no z-loss): the window has no loss
    key and the log line names none; evaluation and no-grad forwards add no tokens."""
    from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

    from etp.megatron.compat import moe_router_losses
    from etp.train.moe_metrics import MoEMetrics

    save_to_aux_losses_tracker("stale", torch.tensor(1.0), layer_number=1, num_layers=7)  # a previous run's
    assert "stale" in moe_router_losses()
    routing_map = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)  # 4 tokens, top-2
    model = torch.nn.ModuleList([_FakeRouter(3, routing_map), _FakeRouter(1, routing_map.flip(1))])
    moe = MoEMetrics(list(model), micro_batches=2)
    assert "stale" not in moe_router_losses() and moe.layers == [0, 2]
    for _ in range(3):  # training forwards
        [router(None) for router in model]
    with torch.no_grad():
        [router(None) for router in model]
    model.eval()
    [router(None) for router in model]
    record = moe.window(iterations=3)
    assert not [k for k in record if "loss" in k]
    assert record["moe/expert_load_max_layer_2"] == 9 and record["moe/expert_load_mean_layer_2"] == 8.0
    assert record["moe/expert_load_max_layer_0"] == 9 and record["expert_load_max_over_mean"] == 9 / 8
    assert MoEMetrics.line(record) == "expert load max/mean 1.12 (layer 0)"
    assert moe.window(iterations=1)["moe/expert_load_mean_layer_0"] == 0  # a fresh window
    moe.remove()


def _gpu_run(tmp_path, graph: str) -> list[dict]:
    """The flagship recipe at 2 layers on up to 2 GPUs, deterministic, with a z-loss: its log windows."""
    import os
    import subprocess
    import sys

    world = min(2, torch.cuda.device_count())
    out = tmp_path / f"{graph}.json"
    settings = [f"world_size={world}", "num_layers=2", f"etp.etp_size={world}", f"etp.expert_etp_size={world}",
                "micro_batch_size=1", f"global_batch_size={2 * world}", "lr_warmup_iters=2",
                "overlap_grad_reduce=false", "etp.gather_dtype=param", "etp.gather_reuse=chain", "deterministic=true",
                "moe_z_loss_coeff=1e-3", f"cuda_graph={graph}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", "etp.train", "--recipe", str(ROOT / "recipes" / "moe_flagship.yaml"), "--train-iters", "6",
           "--log-interval", "3", "--json", str(out), *[arg for s in settings for arg in ("--set", s)]]
    subprocess.run(cmd, check=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return json.loads(out.read_text())["log"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_a_captured_step_counts_what_the_eager_step_counts(tmp_path):
    """``cuda_graph: step``: the tracker's and the counts' adds replay inside the graph, and the
    capture's warm-ups are dropped (without ``reset`` the first window counts three more
    forwards). Deterministic runs train bit for bit alike (tests/train/test_captured_step.py),
    so every figure is equal."""
    eager, captured = _gpu_run(tmp_path, "none"), _gpu_run(tmp_path, "step")
    keys = [k for k in eager[0] if "load" in k or "z_loss" in k]
    assert len(keys) == 3 + 5 * 2
    for a, b in zip(eager, captured, strict=True):
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}
        for layer in (0, 1):  # every token of the window's batches to top-4 of 64 experts
            assert b[f"moe/expert_load_mean_layer_{layer}"] * 64 == 2 * min(2, torch.cuda.device_count()) * 2048 * 4 * 3
