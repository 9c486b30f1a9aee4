"""``etp.megatron.ep_dispatcher.EtpTokenDispatcher`` on gloo (2 ranks, reference backend; on
2 GPUs with ``ETP_TEST_BACKEND=nccl``):
megatron's dispatcher call sequence with per-expert linear experts, against the float64
single-process MoE layer of test_ep.py, forward and backward, trimmed and padded input."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ep_cases import make_case, reference_layer
from harness import run_distributed

E, K, H, T = 8, 3, 5, 7


def _megatron_layer(ctx, trim):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from etp.megatron.ep_dispatcher import EtpTokenDispatcher

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
                               moe_router_topk=K, params_dtype=torch.float64, use_cpu_initialization=True)
    singles = [dist.new_group([r]) for r in range(ctx.world_size)]  # every rank makes every group
    pgs = ProcessGroupCollection(ep=dist.group.WORLD, expt_tp=singles[ctx.rank], tp_ep=dist.group.WORLD)
    local = E // ctx.world_size
    d = EtpTokenDispatcher(local, list(range(ctx.rank * local, (ctx.rank + 1) * local)), config, pgs,
                           max_tokens_per_rank=T, backend="reference", trim=trim,
                           weight_dtype=torch.float64, device=ctx.device)
    ranks, expert_w, grads = make_case("uniform", ctx.world_size, E, K, H, T, seed=4)
    idx, weights, x = (t.to(ctx.device) for t in ranks[ctx.rank])
    expert_w, grad = expert_w.to(ctx.device), grads[ctx.rank].to(ctx.device)
    routing_map = torch.zeros(idx.shape[0], E, dtype=torch.bool, device=ctx.device).scatter_(1, idx, True)
    probs = torch.zeros(idx.shape[0], E, dtype=torch.float64, device=ctx.device).scatter(1, idx, weights)
    probs.requires_grad_(True)
    x = x.clone().requires_grad_(True)
    tokens, p = d.dispatch_preprocess(x, routing_map, probs)
    tokens, p = d.token_dispatch(tokens, p)
    h, tokens_per_expert, p = d.dispatch_postprocess(tokens, p)
    assert (h.shape[0] == int(tokens_per_expert.sum())) == trim or int(tokens_per_expert.sum()) == d.dispatcher.capacity
    rows, start = [], 0
    for e, n in enumerate(tokens_per_expert.tolist()):  # megatron's experts apply the probabilities
        rows.append(h[start:start + n] @ expert_w[ctx.rank * local + e] * p[start:start + n, None])
        start += n
    rows.append(h[start:] * 0)
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(torch.cat(rows))))
    out.backward(grad)
    return [t.tolist() for t in (out.detach(), x.grad, probs.grad.gather(1, idx))]  # lists: plain pickles


@pytest.mark.parametrize("trim", [True, False])
def test_megatron_dispatcher_matches_single_process_model(trim):
    results = run_distributed(_megatron_layer, 2, trim)
    ranks, expert_w, grads = make_case("uniform", 2, E, K, H, T, seed=4)
    want, _ = reference_layer(ranks, expert_w, grads)
    for r, (got, ref) in enumerate(zip(results, want)):
        for name, a, b in zip(("out", "grad x", "grad probs"), got, ref):
            torch.testing.assert_close(torch.tensor(a, dtype=torch.float64).reshape(b.shape), b, rtol=1e-12, atol=1e-12, msg=f"rank {r} {name}")


# ---------------------------------------------------------------- EP composed with expert ETP
# etp-train on the CPU recipe at world 4: expert parallelism through the etp dispatcher
# beside ETP sharding of the expert weights over the expert-data-parallel ranks, against
# megatron's own allgather dispatcher with every expert on every rank (EP 1) and the expert
# weights sharded 4 ways: the same model and data, so the same losses. The first iteration's
# loss is the same computation (bit for bit here); later ones differ by summation order
# through Adam, within 1e-3.
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _train(tmp_path, name, ep_size, expert_etp, dispatcher):
    import json
    import os

    from etp.train.main import main

    out = tmp_path / f"{name}.json"
    saved = os.environ.get("ETP_CACHE_DIR")
    os.environ["ETP_CACHE_DIR"] = str(tmp_path / "cache")  # backend auto's choice, not the user's cache
    try:
        code = main(["--recipe", str(ROOT / "recipes" / "tiny_moe_cpu.yaml"), "--train-iters", "3", "--log-interval",
                     "1", "--set", "lr_warmup_iters=1", "--set", "world_size=4", "--set", "global_batch_size=16",
                     "--set", f"moe_token_dispatcher_type={dispatcher}", "--set",
                     f"expert_model_parallel_size={ep_size}",
                     "--set", "etp.etp_size=4", "--set", f"etp.expert_etp_size={expert_etp}", "--json", str(out)])
    finally:
        if saved is None:
            os.environ.pop("ETP_CACHE_DIR", None)
        else:
            os.environ["ETP_CACHE_DIR"] = saved
    assert code == 0
    return json.loads(out.read_text())["log"]


def _compare(got, want):
    assert len(got) == len(want) == 3
    assert abs(got[0]["loss"] - want[0]["loss"]) <= 1e-6 * want[0]["loss"], (got[0], want[0])
    assert abs(got[0]["grad_norm"] - want[0]["grad_norm"]) <= 1e-3 * want[0]["grad_norm"], (got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * b["loss"], (a, b)


# CPU runs (the recipe is gloo's): nothing to add to a GPU session (ETP_TEST_BACKEND=nccl).
cpu_only = pytest.mark.skipif(__import__("harness").backend() == "nccl", reason="CPU recipe runs; the CPU suite has them")


@pytest.fixture(scope="module")
def expert_etp_4(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("ep1"), "ep1_xetp4", 1, 4, "allgather")


@cpu_only
def test_ep2_with_expert_etp2_tracks_expert_etp4(tmp_path, expert_etp_4):
    _compare(_train(tmp_path, "ep2_xetp2", 2, 2, "etp"), expert_etp_4)


@cpu_only
@pytest.mark.slow
def test_ep4_tracks_expert_etp4(tmp_path, expert_etp_4):
    _compare(_train(tmp_path, "ep4", 4, 1, "etp"), expert_etp_4)
