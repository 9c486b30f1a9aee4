"""etp.jax.ep against an independent float64 NumPy reference (forward and gradients), its
drop rule, its input checks, one trace per config, and its imports (no torch).

The reference (``_reference``) walks the documented receive order with plain loops:
for each destination rank, local expert, source rank, token and k, the matching pair takes
the next row while rows remain, and is dropped after that.
"""
import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# Four host devices; XLA reads this when its CPU backend starts, so before any jax use.
_DEVICE_FLAG = "--xla_force_host_platform_device_count=4"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
if len(jax.devices("cpu")) < 4:
    pytest.skip(f"JAX started with {len(jax.devices('cpu'))} CPU devices before this module set {_DEVICE_FLAG}; "
                "run this file in its own process", allow_module_level=True)

from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from etp.jax import ep as jep  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _reference(idx, x, w, expert_out, num_experts, rows):
    """Float64 dispatch / combine by loops. idx, w [W, T, K]; x [W, T, H]; expert_out [W, C, H].

    Returns the outputs and ``placed``: (s, t, k) -> (d, row) of every kept pair.
    """
    world, tokens, topk = idx.shape
    local = num_experts // world
    recv_x = np.zeros((world, rows, x.shape[-1]))
    recv_w = np.zeros((world, rows))
    per_expert = np.zeros((world, local), np.int64)
    dropped = np.zeros(world, np.int64)
    placed = {}
    for d in range(world):
        row = 0
        for le in range(local):
            for s in range(world):
                for t in range(tokens):
                    for k in range(topk):
                        if idx[s, t, k] != d * local + le:
                            continue
                        if row < rows:
                            recv_x[d, row], recv_w[d, row] = x[s, t], w[s, t, k]
                            per_expert[d, le] += 1
                            placed[(s, t, k)] = (d, row)
                        else:
                            dropped[d] += 1
                        row += 1
    out = np.zeros_like(x)
    for (s, t, _), (d, row) in placed.items():
        out[s, t] += expert_out[d, row]
    return dict(recv_x=recv_x, recv_w=recv_w, tokens_per_expert=per_expert, dropped=dropped, out=out), placed


def _reference_grads(placed, g_recv_x, g_recv_w, g_out, topk):
    """Gradients of x, topk_weights, expert_out from the cotangents, pair by pair."""
    world, tokens, hidden = g_out.shape
    grad_x = np.zeros((world, tokens, hidden))
    grad_w = np.zeros((world, tokens, topk))
    grad_eo = np.zeros(g_recv_x.shape)
    for (s, t, k), (d, row) in placed.items():
        grad_x[s, t] += g_recv_x[d, row]
        grad_w[s, t, k] = g_recv_w[d, row]
        grad_eo[d, row] = g_out[s, t]
    return dict(x=grad_x, w=grad_w, expert_out=grad_eo)


def _mesh(world):
    return Mesh(np.array(jax.devices("cpu")[:world]), ("ep",))


@functools.lru_cache(maxsize=None)
def _program(cfg, world):
    """Jitted forward + VJP over a 1-D mesh of ``world`` devices; all arrays global [W*..]."""
    spec = P("ep")

    def body(idx, x, w, expert_out):
        handle = jep.ep_prepare(cfg, idx)
        recv_x, recv_w, per_expert = jep.ep_dispatch(cfg, x, w, handle)
        out = jep.ep_combine(cfg, expert_out, handle)
        # Scalars get a length-1 axis so that each rank's value concatenates along "ep".
        return (recv_x, recv_w, out), handle._replace(dropped=handle.dropped[None], invalid=handle.invalid[None])

    mapped = jep.shard_map(body, _mesh(world), (spec,) * 4, ((spec,) * 3, spec))

    @jax.jit
    def run(idx, x, w, expert_out, cotangents):
        outs, vjp, aux = jax.vjp(lambda *a: mapped(idx, *a), x, w, expert_out, has_aux=True)
        return outs, aux, vjp(cotangents)

    return run


def _rounded(array, dtype):
    """``array`` in ``dtype`` (what JAX gets) and the same values in float64 (the reference's)."""
    cast = jnp.asarray(array, dtype)
    return cast, np.asarray(cast.astype(jnp.float32), np.float64)


def _check_case(idx, cfg, world, seed=0):
    rng = np.random.default_rng(seed)
    tokens, topk, hidden, rows = idx.shape[1], cfg.topk, cfg.hidden_size, cfg.recv_rows(world)
    x, x64 = _rounded(rng.standard_normal((world * tokens, hidden)), cfg.dtype)
    w, w64 = _rounded(rng.random((world * tokens, topk)), jnp.float32)
    eo, eo64 = _rounded(rng.standard_normal((world * rows, hidden)), cfg.dtype)
    g_rx, g_rx64 = _rounded(rng.standard_normal((world * rows, hidden)), cfg.dtype)
    g_rw, g_rw64 = _rounded(rng.standard_normal(world * rows), jnp.float32)
    g_out, g_out64 = _rounded(rng.standard_normal((world * tokens, hidden)), cfg.dtype)

    run = _program(cfg, world)
    flat_idx = jnp.asarray(idx.reshape(world * tokens, topk), jnp.int32)
    (recv_x, recv_w, out), handle, grads = run(flat_idx, x, w, eo, (g_rx, g_rw, g_out))
    per_expert, dropped = handle.tokens_per_expert, handle.dropped
    _check_handle(handle, world, tokens * topk, rows)
    ref, placed = _reference(idx, x64.reshape(world, tokens, hidden), w64.reshape(world, tokens, topk),
                             eo64.reshape(world, rows, hidden), cfg.num_experts, rows)
    ref_grads = _reference_grads(placed, g_rx64.reshape(world, rows, hidden), g_rw64.reshape(world, rows),
                                 g_out64.reshape(world, tokens, hidden), topk)

    def f64(a, shape):
        return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64).reshape(shape)

    # Moves copy rows: exact. Sums of K rows round once to the row dtype.
    # bf16: one rounding of the exact sum (half an ulp, at most 2**-8 relative).
    sum_tol = dict(rtol=2**-8, atol=1e-5) if cfg.dtype == jnp.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(f64(recv_x, (world, rows, hidden)), ref["recv_x"])
    np.testing.assert_array_equal(f64(recv_w, (world, rows)), ref["recv_w"])
    np.testing.assert_array_equal(np.asarray(per_expert).reshape(world, -1), ref["tokens_per_expert"])
    np.testing.assert_array_equal(np.asarray(dropped), ref["dropped"])
    np.testing.assert_allclose(f64(out, (world, tokens, hidden)), ref["out"], **sum_tol)
    grad_x, grad_w, grad_eo = grads
    np.testing.assert_allclose(f64(grad_x, (world, tokens, hidden)), ref_grads["x"], **sum_tol)
    np.testing.assert_array_equal(f64(grad_w, (world, tokens, topk)), ref_grads["w"])
    np.testing.assert_array_equal(f64(grad_eo, (world, rows, hidden)), ref_grads["expert_out"])
    return dict(ref=ref, placed=placed, invalid=np.asarray(handle.invalid))


def _check_handle(handle, world, pairs, rows):
    """Each rank's index maps are inverse bijections: sent pairs <-> send slots, receive
    slots <-> the first sum(tokens_per_expert) rows of recv_x."""
    fields = {name: np.asarray(value).reshape(world, -1) for name, value in handle._asdict().items()}
    for r in range(world):
        pair_slot, send_pair = fields["pair_slot"][r], fields["send_pair"][r]
        sent = np.flatnonzero(pair_slot >= 0)
        np.testing.assert_array_equal(send_pair[pair_slot[sent]], sent)
        assert (send_pair >= 0).sum() == len(sent) and send_pair.max() < pairs
        recv_row, row_slot = fields["recv_row"][r], fields["row_slot"][r]
        valid_rows = fields["tokens_per_expert"][r].sum()
        slots = np.flatnonzero(recv_row >= 0)
        assert recv_row.max() < rows and len(slots) == valid_rows
        np.testing.assert_array_equal(row_slot[recv_row[slots]], slots)
        np.testing.assert_array_equal(row_slot >= 0, np.arange(rows) < valid_rows)


def _random_routing(rng, world, tokens, topk, experts):
    """[W, T, K] distinct experts per token, uniform."""
    return np.stack([rng.permutation(experts)[:topk] for _ in range(world * tokens)]).reshape(world, tokens, topk)


def test_uniform_routing_w4():
    idx = _random_routing(np.random.default_rng(1), 4, 8, 2, 8)
    _check_case(idx, jep.EPConfig(8, 2, 8, 8, dtype=jnp.float32), 4)


def test_skewed_routing_with_empty_experts_bf16():
    rng = np.random.default_rng(2)
    # Every token's first expert is 0 (rank 0 takes half of all pairs); 5 and 7 are never picked.
    second = rng.choice([1, 2, 3, 4, 6], size=(4, 8))
    idx = np.stack([np.zeros_like(second), second], axis=-1)
    result = _check_case(idx, jep.EPConfig(8, 2, 16, 8, dtype=jnp.bfloat16), 4)
    per_expert = result["ref"]["tokens_per_expert"]
    assert per_expert[0, 0] == 32 and per_expert[2, 1] == 0 and per_expert[3, 1] == 0


def test_token_routed_twice_to_one_rank_w2():
    # L = 4 experts per rank; every token's two experts sit on the same rank.
    pairs = np.array([[0, 3], [5, 6], [2, 1], [7, 4], [1, 0], [6, 5]])
    idx = np.stack([pairs, pairs[::-1]])
    _check_case(idx, jep.EPConfig(8, 2, 8, 6, dtype=jnp.float32), 2)


def test_k1_fewer_tokens_than_max_and_out_of_range_ids():
    idx = np.random.default_rng(3).integers(0, 4, size=(2, 6, 1))
    idx[0, 2, 0], idx[1, 5, 0] = -1, 4  # out of range: not sent, counted, add zero
    result = _check_case(idx, jep.EPConfig(4, 1, 8, 10, dtype=jnp.float32), 2)
    np.testing.assert_array_equal(result["invalid"], [1, 1])


def test_k8_w4():
    idx = _random_routing(np.random.default_rng(4), 4, 4, 8, 16)
    _check_case(idx, jep.EPConfig(16, 8, 8, 4, dtype=jnp.float32), 4)


def test_capacity_overflow_matches_reference():
    rng = np.random.default_rng(5)
    idx = _random_routing(rng, 4, 8, 2, 8)
    # Rank 0 gets every token's first pair (32 rows) and keeps 6: source 0 alone sends 8 to
    # expert 0, so its all_to_all block to rank 0 is full (P = C < T * K).
    idx[:, :, 0] = rng.choice([0, 1], size=(4, 8))
    idx[0, :, 0] = 0
    idx[:, :, 1] = rng.choice(np.arange(2, 8), size=(4, 8))
    result = _check_case(idx, jep.EPConfig(8, 2, 8, 8, dtype=jnp.float32, capacity=6), 4)
    assert result["ref"]["dropped"][0] > 0
    assert result["ref"]["dropped"].sum() + len(result["placed"]) == idx.size


def test_drop_rule_keeps_lowest_source_then_token():
    # E = W = 2, every token picks experts [0, 1], capacity 3: each rank keeps source 0's
    # tokens 0, 1, 2 and drops source 0's token 3 and all of source 1 (5 rows each).
    cfg = jep.EPConfig(2, 2, 8, 4, dtype=jnp.float32, capacity=3)
    idx = jnp.tile(jnp.array([[0, 1]], jnp.int32), (8, 1))
    x = jnp.arange(8 * 8, dtype=jnp.float32).reshape(8, 8)
    w = jnp.ones((8, 2), jnp.float32)
    # Row r of rank d returns 10 * d + r + 1 in every column.
    expert_out = jnp.repeat(jnp.array([1, 2, 3, 11, 12, 13], jnp.float32)[:, None], 8, axis=1)
    cot = (jnp.zeros((6, 8)), jnp.zeros(6), jnp.zeros((8, 8)))
    (recv_x, _, out), handle, _ = _program(cfg, 2)(idx, x, w, expert_out, cot)
    per_expert, dropped = handle.tokens_per_expert, handle.dropped
    recv_x = np.asarray(recv_x)
    np.testing.assert_array_equal(recv_x[:3], np.asarray(x)[:3])
    np.testing.assert_array_equal(recv_x[3:], np.asarray(x)[:3])
    np.testing.assert_array_equal(np.asarray(dropped), [5, 5])
    np.testing.assert_array_equal(np.asarray(per_expert), [3, 3])
    np.testing.assert_array_equal(np.asarray(out)[:, 0], [12, 14, 16, 0, 0, 0, 0, 0])


def _trace(cfg, world, idx_shape=(8, 2), x_shape=(8, 8), x_dtype=jnp.float32, idx_dtype=jnp.int32,
           w_dtype=jnp.float32, eo_rows=None):
    """Traces prepare / dispatch / combine on abstract inputs (no compile): raises what they raise."""
    eo_rows = eo_rows if eo_rows is not None else world * cfg.recv_rows(world)
    t, k = idx_shape

    def body(idx, x, w, eo):
        handle = jep.ep_prepare(cfg, idx)
        jep.ep_dispatch(cfg, x, w, handle)
        return jep.ep_combine(cfg, eo, handle)

    mapped = jep.shard_map(body, _mesh(world), (P("ep"),) * 4, P("ep"))
    specs = [jax.ShapeDtypeStruct((world * t, k), idx_dtype), jax.ShapeDtypeStruct((world * x_shape[0], x_shape[1]),
             x_dtype), jax.ShapeDtypeStruct((world * t, k), w_dtype),
             jax.ShapeDtypeStruct((eo_rows, cfg.hidden_size), cfg.dtype)]
    return jax.eval_shape(mapped, *specs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=0), "num_experts=0"),
    (dict(topk=0), "topk=0"),
    (dict(topk=9), "topk=9 is larger"),
    (dict(capacity=0), "capacity=0"),
    (dict(hidden_size=True), "hidden_size=True"),
    (dict(dtype=jnp.int32), "dtype="),
])
def test_config_rejects(kwargs, match):
    base = dict(num_experts=8, topk=2, hidden_size=8, max_tokens_per_rank=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match=match):
        jep.EPConfig(**{**base, **kwargs})


def test_trace_time_checks():
    cfg = jep.EPConfig(8, 2, 8, 8, dtype=jnp.float32)
    assert _trace(cfg, 4).shape == (32, 8)  # the valid call traces
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the size 4"):
        _trace(jep.EPConfig(6, 2, 8, 8, dtype=jnp.float32), 4)
    with pytest.raises(ValueError, match="topk_idx.dtype=float32"):
        _trace(cfg, 4, idx_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"topk_idx.shape=\(8, 3\)"):
        _trace(cfg, 4, idx_shape=(8, 3))
    with pytest.raises(ValueError, match="T=9 tokens"):
        _trace(cfg, 4, idx_shape=(9, 2), x_shape=(9, 8))
    with pytest.raises(ValueError, match="x.dtype=bfloat16"):
        _trace(cfg, 4, x_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"x.shape=\(8, 4\)"):
        _trace(cfg, 4, x_shape=(8, 4))
    with pytest.raises(ValueError, match="topk_weights.dtype=int32"):
        _trace(cfg, 4, w_dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"expert_out.shape=\(63, 8\)"):
        _trace(cfg, 4, eo_rows=4 * 63)


def test_out_of_range_ids_raise_when_concrete():
    cfg = jep.EPConfig(8, 2, 8, 8, dtype=jnp.float32)
    jep.validate_topk_idx(cfg, np.array([[0, 7]], np.int32))
    with pytest.raises(ValueError, match=r"topk_idx\[1, 0\]=8 is out of range"):
        jep.validate_topk_idx(cfg, np.array([[0, 7], [8, 1]], np.int32))
    with pytest.raises(ValueError, match="-1 is out of range"):
        jep.ep_prepare(cfg, jnp.array([[0, -1]], jnp.int32))
    with pytest.raises(ValueError, match="not bound here"):
        jep.ep_prepare(cfg, jnp.array([[0, 1]], jnp.int32))


def test_jit_traces_once_per_config():
    traces = []

    def make(cfg):
        def body(idx, x, w):
            traces.append(cfg)  # runs only while tracing
            handle = jep.ep_prepare(cfg, idx)
            recv_x, _, _ = jep.ep_dispatch(cfg, x, w, handle)
            return jep.ep_combine(cfg, recv_x, handle)
        return jax.jit(jep.shard_map(body, _mesh(2), (P("ep"),) * 3, P("ep")))

    cfg = jep.EPConfig(4, 2, 8, 4, dtype=jnp.float32)
    step = make(cfg)
    idx, x, w = jnp.zeros((8, 2), jnp.int32), jnp.ones((8, 8)), jnp.ones((8, 2))
    step(idx, x, w)
    step(idx + 1, x * 2, w)
    assert len(traces) == 1
    make(jep.EPConfig(4, 2, 8, 4, dtype=jnp.float32))(idx, x, w)  # an equal config: its own jit, one trace
    assert len(traces) == 2


def _run_python(code):
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_import_etp_jax_ep_does_not_import_torch():
    result = _run_python("import etp.jax.ep, sys; assert 'torch' not in sys.modules, 'torch was imported'")
    assert result.returncode == 0, result.stderr
