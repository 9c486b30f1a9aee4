"""Expert-parallel dispatch / combine (etp.ep) on gloo, 2 and 4 ranks.

Every CPU backend is checked against an independent single-process float64 model of the
whole MoE layer (route, per-expert linear, un-route weighted by the routing weights),
forward and backward, and against the ``reference`` backend; plus identity experts, bad
input, overflow, token dropping and the profiler's cache. The helpers are reused by
``test_ep_gpu.py``.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from ep_cases import kept_pairs, make_case, reference_layer, run_layer
from harness import run_distributed

from etp import ep

CPU_BACKENDS = ("reference", "nccl", "nccl_padded")
# hierarchical over declared hosts (2 ranks: 2 hosts x 1, 4 ranks: 2 x 2); it sums per host
# first, so it matches the model within rounding, not reference bit for bit.
LAYER_BACKENDS = (*CPU_BACKENDS, "hierarchical")


def _backend_config(cfg, name, world):
    hosts = {"ranks_per_host": max(1, world // 2)} if name == "hierarchical" else {}
    return replace(cfg, backend=name, **hosts)
CASES = ("uniform", "skewed", "empty_experts", "zero_tokens", "one_rank")


def _config(world, **kw):
    base = dict(num_experts=8, topk=3, hidden_size=5, max_tokens_per_rank=7, dtype=torch.float64,
                weight_dtype=torch.float64)
    base.update(kw)
    return ep.EPConfig(**base)


def test_config_rejects_bad_tile_parameters():
    bad = [("tile_rows", 3), ("tile_rows", 0), ("num_warps", 6), ("num_warps", 64), ("num_stages", 0),
           ("num_ctas", 0)]
    for field, value in bad:
        with pytest.raises(ValueError, match=f"EPConfig.{field}="):
            _config(2, **{field: value})
    cfg = _config(2, tile_rows=8, num_warps=16, num_stages=4)
    assert (cfg.tile_rows, cfg.num_warps, cfg.num_stages) == (8, 16, 4)
    assert _config(2).tile_rows is None  # picked per kernel


def _layer_vs_model(ctx, backends, cases, cfg_kw):
    torch.manual_seed(0)
    errors = []
    for case in cases:
        cfg = _config(ctx.world_size, **cfg_kw)
        ranks, expert_w, grads = make_case(case, ctx.world_size, cfg.num_experts, cfg.topk, cfg.hidden_size,
                                           cfg.max_tokens_per_rank)
        keep = None
        if cfg.drop_tokens:
            keep = kept_pairs(ranks, cfg.num_experts, cfg.expert_capacity(ctx.world_size))
        model, model_w_grad = reference_layer(ranks, expert_w, grads, keep)
        local = cfg.num_experts // ctx.world_size
        mine = slice(ctx.rank * local, (ctx.rank + 1) * local)
        idx, weights, x = ranks[ctx.rank]
        outputs = {}
        for name in backends:
            disp = ep.ExpertDispatcher(_backend_config(cfg, name, ctx.world_size), name=f"{case}:{name}")
            for _ in range(2):  # twice: the second step reuses every buffer
                outputs[name] = run_layer(disp, idx, weights, x, expert_w[mine], grads[ctx.rank])
            outputs[f"{name} trim"] = run_layer(disp, idx, weights, x, expert_w[mine], grads[ctx.rank], trim=True)
        want = (*model[ctx.rank], model_w_grad[mine])
        for name, got in outputs.items():
            for label, a, b in zip(("out", "grad_x", "grad_w", "grad_experts"), got, want):
                if not torch.allclose(a, b, rtol=1e-10, atol=1e-12):
                    errors.append(f"{case} {name} {label}: max err {(a - b).abs().max():.3g}")
            for label, a, b in zip(("out", "grad_x", "grad_w", "grad_experts"), got, outputs[backends[0]]):
                if not name.startswith("hierarchical") and not torch.equal(a, b):
                    errors.append(f"{case} {name} {label} differs from {backends[0]}")
    return errors


def _layer_and_identity(ctx, backends):
    return _layer_vs_model(ctx, backends, CASES, {}), _identity(ctx, backends)


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def layer_results(request):
    # One spawn per world size for both checks: spawning ranks is most of the runtime.
    return run_distributed(_layer_and_identity, request.param, LAYER_BACKENDS)


def test_layer_matches_single_process_model(layer_results):
    for errors, _ in layer_results:
        assert not errors, errors


def _identity(ctx, backends):
    ranks, _, _ = make_case("uniform", ctx.world_size, num_experts=8, topk=3, hidden=5, max_tokens=7, seed=3)
    idx, weights, x = ranks[ctx.rank]
    results = {}
    for name in backends:
        disp = ep.ExpertDispatcher(_backend_config(_config(ctx.world_size), name, ctx.world_size))
        handle = disp.prepare(idx)
        recv_x, recv_w, tokens_per_expert = disp.dispatch(x, weights, handle)
        valid = int(tokens_per_expert.sum())
        tail_zero = bool((recv_x[valid:] == 0).all() and (recv_w[valid:] == 0).all())
        # Routing weights arrive beside their rows: their sum over all rows is the sum of all
        # weights sent here; checked globally through combine of ones.
        out = disp.combine(recv_x, handle)
        results[name] = (torch.equal(out, 3 * x) or (out - 3 * x).abs().max().item(), tail_zero,
                         tokens_per_expert.tolist())
    return results


def test_identity_experts_return_k_times_x(layer_results):
    for r, (_, result) in enumerate(layer_results):
        for name, (exact, tail_zero, _counts) in result.items():
            assert exact is True, f"rank {r} {name}: combine(dispatch(x)) != K x (err {exact})"
            assert tail_zero, f"rank {r} {name}: rows past tokens_per_expert not zero"
        assert len({tuple(v[2]) for v in result.values()}) == 1


def _bad_input(ctx):
    caught = {}

    def expect(label, exc, fn):
        try:
            fn()
        except exc as e:
            caught[label] = str(e)
        else:
            caught[label] = None

    world = ctx.world_size
    expect("topk>E", ValueError, lambda: _config(world, topk=9))
    expect("E%W", ValueError, lambda: ep.ExpertDispatcher(_config(world, num_experts=9, topk=2)))
    expect("backend", ValueError, lambda: _config(world, backend="fast"))
    expect("unavailable", ValueError, lambda: ep.ExpertDispatcher(_config(world, backend="symm_push")))
    disp = ep.ExpertDispatcher(_config(world, backend="reference"))
    idx = torch.zeros(4, 3, dtype=torch.int64)
    idx[:, 1], idx[:, 2] = 1, 2
    expect("idx dtype", ValueError, lambda: disp.prepare(idx.int()))
    expect("idx shape", ValueError, lambda: disp.prepare(idx[:, :2]))
    expect("too many tokens", ValueError, lambda: disp.prepare(torch.zeros(8, 3, dtype=torch.int64)))
    expect("idx range", ValueError, lambda: disp.prepare(idx - 1))
    expect("idx range high", ValueError, lambda: disp.prepare(idx + 6))
    handle = disp.prepare(idx)
    x = torch.zeros(4, 5, dtype=torch.float64)
    w = torch.ones(4, 3, dtype=torch.float64)
    expect("x dtype", ValueError, lambda: disp.dispatch(x.float(), w, handle))
    expect("x shape", ValueError, lambda: disp.dispatch(x[:3], w, handle))
    expect("weights shape", ValueError, lambda: disp.dispatch(x, w[:, :2], handle))
    expect("combine first", RuntimeError, lambda: disp.combine(torch.zeros(disp.capacity, 5, dtype=torch.float64),
                                                                handle))
    recv_x, recv_w, _ = disp.dispatch(x, w, handle)
    expect("expert_out shape", ValueError, lambda: disp.combine(recv_x[:-1], handle))
    expect("grad_out shape", ValueError, lambda: disp.combine_backward(x[:3], handle))
    expect("grad_recv_x shape", ValueError, lambda: disp.dispatch_backward(recv_x[:-1], recv_w, handle))
    expect("grad_recv_w shape", ValueError, lambda: disp.dispatch_backward(recv_x, recv_w[:-1], handle))
    disp.prepare(idx)
    expect("stale handle", RuntimeError, lambda: disp.dispatch(x, w, handle))
    # Without host validation, bad indices are left out and reported by check().
    lazy = ep.ExpertDispatcher(_config(world, backend="reference", validate=False), name="layer7")
    bad = idx.clone()
    bad[0, 0] = -1 if ctx.rank == 0 else 8
    h = lazy.prepare(bad)
    out = lazy.combine(lazy.dispatch(x + 1, w, h)[0], h)
    expect("check bad idx", ValueError, lazy.check)
    caught["lazy out"] = out[0, 0].item()  # token 0 lost its bad pair: 2, the others 3
    lazy.check()  # reported once
    return caught


def _padded_overflow(ctx):
    """Every rank routes to the other's experts only: no receive buffer overflows (capacity
    21 rows, 21 arrive), but 21 rows to one peer exceed nccl_padded's 11 per peer."""
    gen = torch.Generator().manual_seed(ctx.rank)
    other = 1 - ctx.rank
    idx = torch.stack([torch.randperm(4, generator=gen)[:3] + 4 * other for _ in range(7)])
    x, w = torch.randn(7, 5, dtype=torch.float64), torch.ones(7, 3, dtype=torch.float64)
    disp = ep.ExpertDispatcher(_config(2, backend="nccl_padded", capacity_factor=1.0), name="layer5")
    handle = disp.prepare(idx)
    out = disp.combine(disp.dispatch(x, w, handle)[0], handle)
    try:
        disp.check()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = None
    sent = (out.sum(1) / x.sum(1)).round()  # identity experts: the number of the token's pairs that went
    return message, sent.tolist()


def _wire_rows(ctx):
    ranks, _, _ = make_case("uniform", ctx.world_size, seed=2)
    rows = {}
    for name in LAYER_BACKENDS:
        disp = ep.ExpertDispatcher(_backend_config(_config(ctx.world_size), name, ctx.world_size))
        rows[name] = disp.dispatch_backend.wire_rows(disp.prepare(ranks[ctx.rank][0]), "dispatch")
    return rows


def test_wire_rows_count_what_each_backend_moves(misc_results):
    """The benchmark's byte counts, against counts taken from the routing itself (2 ranks,
    4 experts each): a row per pair to the other rank; nccl_padded its whole per-peer
    capacity (7 tokens x min(K=3, 4 local experts)); hierarchical (2 hosts x 1) a row per
    token with any expert on the other host."""
    ranks, _, _ = make_case("uniform", 2, seed=2)
    for r, rows in enumerate(result["wire"] for result in misc_results[0]):
        to_other = ranks[r][0] // 4 == 1 - r
        want = {"reference": int(to_other.sum()), "nccl": int(to_other.sum()), "nccl_padded": 21,
                "hierarchical": int(to_other.any(1).sum())}
        for name, n in want.items():
            assert rows[name][1 - r] == n and rows[name][r] == 0, (name, rows[name], n)


def test_first_pairs_marks_each_tokens_first_pair_per_destination():
    from etp.ep.backends.base import first_pairs

    key = torch.tensor([[1, 0, 1, 1], [2, 2, 2, 0], [0, 1, 2, 3]])
    sent = torch.tensor([[True, True, True, True], [False, True, True, True], [True, True, False, True]])
    want = torch.tensor([[True, True, False, False], [False, True, False, True], [True, True, False, True]])
    assert torch.equal(first_pairs(key, sent), want)


def _backward_moves(ctx):
    """The backward moves called directly, outside autograd (as the profiler and
    ``tools/bench_ep.py`` run them). With the forward dispatch's rows as gradients, dispatch's
    backward returns K x each token and the routing weights themselves; combine's backward of g
    puts g[t] in each of t's pair rows, so combining them gives K x g (combine is checked
    against the float64 model above) and the rows past the valid ones are zero."""
    ranks, _, grads = make_case("uniform", ctx.world_size, seed=4)
    (idx, weights, x), g = ranks[ctx.rank], grads[ctx.rank]
    K, errors = idx.shape[1], []
    for name in LAYER_BACKENDS:
        for trim in (False, True):
            label = f"{name}{' trim' if trim else ''}"
            disp = ep.ExpertDispatcher(_backend_config(_config(ctx.world_size), name, ctx.world_size))
            with torch.no_grad():
                handle = disp.prepare(idx)
                recv_x, recv_w, counts = disp.dispatch(x, weights, handle, trim=trim)
                grad_x, grad_w = disp.dispatch_backward(recv_x.clone(), recv_w.clone(), handle)
                if not torch.allclose(grad_x, K * x, rtol=1e-12, atol=0) or not torch.equal(grad_w, weights):
                    errors.append(f"{label}: dispatch_backward is not (K x, weights)")
                grad_rows = disp.combine_backward(g, handle)
                valid = int(counts.sum())
                if grad_rows.shape != recv_x.shape or grad_rows[valid:].any():
                    errors.append(f"{label}: combine_backward rows {tuple(grad_rows.shape)}, tail not zero")
                if not torch.allclose(disp.combine(grad_rows.clone(), handle), K * g, rtol=1e-12, atol=0):
                    errors.append(f"{label}: combine(combine_backward(g)) != K x g")
            disp.check()
    return errors


def test_backward_moves_called_directly_move_what_autograd_moves(misc_results):
    for errors in (result["backward"] for result in misc_results[0]):
        assert not errors, errors


def _misc(ctx, cache_dir):
    kw = dict(capacity_factor=0.5, drop_tokens=True)
    return dict(wire=_wire_rows(ctx), bad_input=_bad_input(ctx), overflow=_overflow(ctx, CPU_BACKENDS), padded=_padded_overflow(ctx),
                dropping=_layer_vs_model(ctx, CPU_BACKENDS, ("uniform", "skewed"), kw),
                cache=_profile_cache(ctx, cache_dir), backward=_backward_moves(ctx))


@pytest.fixture(scope="module")
def misc_results(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("ep_cache")
    return run_distributed(_misc, 2, str(cache_dir)), cache_dir


def test_token_dropping_matches_model(misc_results):
    for result in misc_results[0]:
        assert not result["dropping"], result["dropping"]


def test_bad_input_raises_naming_the_argument(misc_results):
    for r, caught in enumerate(result["bad_input"] for result in misc_results[0]):
        lazy_out = caught.pop("lazy out")
        assert lazy_out == 2.0
        for label, msg in caught.items():
            assert msg is not None, f"rank {r}: {label} did not raise"
        assert "topk" in caught["topk>E"] and "divisible" in caught["E%W"]
        assert "symm_push" in caught["unavailable"] and "not available" in caught["unavailable"]
        for label in ("idx dtype", "idx shape", "too many tokens", "idx range", "idx range high"):
            assert caught[label].startswith("topk_idx"), caught[label]
        for label in ("x dtype", "x shape"):
            assert caught[label].startswith("x:"), caught[label]
        assert caught["weights shape"].startswith("topk_weights")
        assert caught["expert_out shape"].startswith("expert_out")
        for label in ("grad_out", "grad_recv_x", "grad_recv_w"):
            assert caught[f"{label} shape"].startswith(f"{label}:"), caught[f"{label} shape"]
        assert "layer7" in caught["check bad idx"] and "rank: count {0: 1, 1: 1}" in caught["check bad idx"]


def _overflow(ctx, backends):
    ranks, _, _ = make_case("skewed", ctx.world_size, seed=1)
    idx, weights, x = ranks[ctx.rank]
    messages = {}
    for name in backends:
        disp = ep.ExpertDispatcher(_config(ctx.world_size, backend=name, capacity_factor=0.9), name="layer3")
        handle = disp.prepare(idx)
        recv_x, _, tokens_per_expert = disp.dispatch(x, weights, handle)
        disp.combine(recv_x, handle)
        assert int(tokens_per_expert.sum()) <= disp.capacity
        try:
            disp.check()
        except RuntimeError as exc:
            messages[name] = str(exc)
        else:
            messages[name] = None
    return messages


def test_overflow_is_reported(misc_results):
    for r, messages in enumerate(result["overflow"] for result in misc_results[0]):
        for name, msg in messages.items():
            assert msg is not None, f"rank {r} {name}: overflow not reported"
            assert "layer3" in msg and "rank(s) [0]" in msg and "capacity 19" in msg and "{0: 21}" in msg, msg


def test_padded_overflow_is_reported(misc_results):
    for result in misc_results[0]:
        message, sent_per_token = result["padded"]
        assert message is not None and "layer5" in message and "at most 11 rows" in message and "needed 21" in message
        assert sum(sent_per_token) == 11, sent_per_token  # the first 11 rows went, the rest contribute nothing


def _profile_cache(ctx, cache_dir):
    from etp.ep import profiler

    cfg = _config(ctx.world_size, backend="auto", cache_dir=cache_dir)
    first = ep.ExpertDispatcher(cfg)
    runs_after_first = profiler.PROFILE_RUNS
    second = ep.ExpertDispatcher(cfg)
    return runs_after_first, profiler.PROFILE_RUNS, first.backend_report, second.backend_report


def test_profiler_chooses_each_move_and_caches_its_choice(misc_results):
    results = [result["cache"] for result in misc_results[0]]
    tmp_path = misc_results[1]
    for first_runs, second_runs, first, second in results:
        assert (first_runs, second_runs) == (1, 1)
        assert (first["source"], second["source"]) == ("profiled", "cache")
        assert {k: first[k] for k in ("dispatch", "combine")} == {k: second[k] for k in ("dispatch", "combine")}
    assert len({(r[2]["dispatch"], r[2]["combine"]) for r in results}) == 1  # all ranks agree
    import json

    table = json.loads((tmp_path / "ep_backends.json").read_text())
    assert list(table) == ["cpu|2|7|5|3|8|torch.float64"]
    entry = table["cpu|2|7|5|3|8|torch.float64"]
    ms = entry["ms"]
    assert set(ms) == set(CPU_BACKENDS) and all(len(t) == 4 for t in ms.values())
    # Each side is the fastest of its own moves: forward plus the backward that runs on it.
    assert entry["dispatch"] == min(ms, key=lambda n: ms[n]["dispatch"] + ms[n]["combine_backward"])
    assert entry["combine"] == min(ms, key=lambda n: ms[n]["combine"] + ms[n]["dispatch_backward"])


def _two_groups_choose(ctx, cache_dir, agree):
    """EP groups {0, 1} and {2, 3} whose measurements disagree: group 0 times ``reference``
    fastest, group 1 ``nccl`` (as two groups' noise can on GPUs)."""
    import torch.distributed as dist

    from etp.ep import profiler

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[ctx.rank // 2]
    fastest = ("reference", "nccl")[ctx.rank // 2]

    def fake_time_moves(disp, cfg, group, iters, warmup):
        seconds = 1e-3 if disp.cfg.backend == fastest else 2e-3
        return dict.fromkeys(("dispatch", "combine", "dispatch_backward", "combine_backward"), seconds)

    profiler._time_moves = fake_time_moves
    cfg = _config(2, backend="auto", cache_dir=cache_dir)
    kw = {"agree_group": dist.group.WORLD} if agree else {}
    first = ep.ExpertDispatcher(cfg, mine, **kw)
    second = ep.ExpertDispatcher(cfg, mine, **kw)
    return first.backend_names, first.backend_report["source"], second.backend_names, second.backend_report["source"]


def _capturable_choice(ctx, cache_dir):
    """``nccl`` times fastest, ``nccl_padded`` second, ``reference`` slowest."""
    from etp.ep import profiler

    order = {"nccl": 1e-3, "nccl_padded": 2e-3, "reference": 3e-3}
    profiler._time_moves = lambda disp, cfg, group, iters, warmup: dict.fromkeys(
        ("dispatch", "combine", "dispatch_backward", "combine_backward"), order[disp.cfg.backend])
    captured = ep.ExpertDispatcher(_config(ctx.world_size, backend="auto", cache_dir=cache_dir, capturable=True))
    plain = ep.ExpertDispatcher(_config(ctx.world_size, backend="auto", cache_dir=cache_dir))
    refused = []
    for name in ("nccl", "nccl_padded+reference", "hierarchical"):
        try:
            ep.ExpertDispatcher(_config(ctx.world_size, backend=name, capturable=True))
        except ValueError as exc:
            refused.append(str(exc))
    return plain.backend_names, captured.backend_names, captured.backend_report["source"], refused, \
        plain.backend_report["source"]


def test_capturable_auto_takes_the_fastest_backend_that_reads_no_host_splits(tmp_path):
    """A dispatcher to be captured in a CUDA graph: ``auto`` keeps the profile (and its cache)
    but chooses among the backends that read no split sizes on the host; a named one that
    reads them is refused with the reason. The capturable dispatcher comes first: it profiles
    (every candidate timed), the plain one reads the cache."""
    for plain, captured, source, refused, plain_source in run_distributed(_capturable_choice, 2, str(tmp_path)):
        assert plain == ("nccl", "nccl") and plain_source == "cache"
        assert captured == ("nccl_padded", "nccl_padded") and source == "profiled, capturable"
        assert len(refused) == 3
        assert "nccl reads split sizes on the host" in refused[0]
        assert "reference reads split sizes on the host" in refused[1]
        assert "hierarchical" in refused[2]


@pytest.mark.parametrize("agree", [pytest.param(False, marks=pytest.mark.slow), True])  # False: the hazard itself
def test_coexisting_ep_groups_choose_one_backend_with_an_agree_group(tmp_path, agree):
    """Two EP groups choosing on their own can end with different backends, which makes the
    ranks' symmetric-memory rendezvous counts differ and hangs the next rendezvous over a
    group crossing them (EP 2 x expert ETP 2 at world 4). With ``agree_group`` every group
    gets one choice from the merged (slowest) times, and later layers read it from the cache."""
    results = run_distributed(_two_groups_choose, 4, str(tmp_path), agree)
    firsts = {r[0] for r in results}
    if not agree:  # the hazard the agree group removes
        assert firsts == {("reference", "reference"), ("nccl", "nccl")}, results
        return
    assert len(firsts) == 1, results
    assert all(r[1] == "profiled" and r[3] == "cache" and r[2] == r[0] for r in results), results
    import json

    entry = json.loads((tmp_path / "ep_backends.json").read_text())["cpu|2|7|5|3|8|torch.float64"]
    assert entry["ms"]["reference"]["dispatch"] == entry["ms"]["nccl"]["dispatch"] == 2.0  # each the slowest group's
    assert not list(tmp_path.glob("*.tmp"))


def _trim_order(ctx):
    calls = []

    class Event:  # stands in for the CUDA event of a GPU dispatcher
        def record(self):
            calls.append("counts copy queued")

        def synchronize(self):
            calls.append("host waits for counts")

    disp = ep.ExpertDispatcher(_config(ctx.world_size, backend="reference"))
    disp._counts_copied = Event()
    move = disp.dispatch_backend.dispatch
    disp.dispatch_backend.dispatch = lambda *a: (calls.append("move queued"), move(*a))[1]
    ranks, _, _ = make_case("uniform", ctx.world_size, seed=3)
    idx = ranks[ctx.rank][0]
    handle = disp.prepare(idx)
    x = torch.randn(idx.shape[0], 5, dtype=torch.float64)
    recv_x, recv_w, counts = disp.dispatch(x, torch.ones(idx.shape, dtype=torch.float64), handle, trim=True)
    return calls, recv_x.shape[0], recv_w.shape[0], counts.tolist(), handle.layout.tokens_per_expert.tolist()


def test_trimmed_dispatch_queues_the_move_before_the_host_waits_for_the_counts():
    """trim's one host sync waits for the counts' copy only after the move is queued, so the
    GPU never idles while the host launches the move."""
    for calls, rows_x, rows_w, counts, device_counts in run_distributed(_trim_order, 2):
        assert calls == ["counts copy queued", "move queued", "host waits for counts"], calls
        assert counts == device_counts and rows_x == rows_w == sum(counts)
