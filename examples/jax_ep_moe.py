"""A small MoE layer trained with etp.jax.ep on a dp x ep mesh, checked against a dense
single-device computation of the same layer.

Each step computes the loss and its gradients twice: with expert parallelism (router and
top-k softmax per shard, tokens dispatched to the SwiGLU experts sharded over ``ep``, a
grouped matmul per local expert, combine) and densely on one device (every token through
its top-k experts, no communication). It prints the largest differences of the output and
of every gradient, then takes a plain SGD step with the EP gradients. Exits 1 on a mismatch.

Run (4 host CPU devices are made when XLA_FLAGS does not say otherwise)::

    python examples/jax_ep_moe.py
"""
import os
import sys

# XLA reads this when its backend starts: it must be set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from etp.jax import ep as jep  # noqa: E402

DP, EP = 2, 2
EXPERTS, TOPK, HIDDEN, FFN, TOKENS_PER_SHARD = 8, 2, 16, 32, 16
STEPS, LR, TOL = 4, 0.5, 1e-5
CFG = jep.EPConfig(num_experts=EXPERTS, topk=TOPK, hidden_size=HIDDEN, max_tokens_per_rank=TOKENS_PER_SHARD,
                   dtype=jnp.float32, axis_name="ep", capacity=None)


def route(x, router):
    """Top-k experts of each token and their softmax weights (renormalised over the k)."""
    logits = jnp.dot(x, router, precision=jax.lax.Precision.HIGHEST)
    top_logits, topk_idx = jax.lax.top_k(logits, TOPK)
    return topk_idx.astype(jnp.int32), jax.nn.softmax(top_logits, axis=-1)


def moe_shard(x, router, w_gate, w_up, w_down):
    """One (dp, ep) shard: x [T, H]; w_* hold this rank's E/W experts."""
    topk_idx, topk_weights = route(x, router)
    handle = jep.ep_prepare(CFG, topk_idx)
    recv_x, recv_w, tokens_per_expert = jep.ep_dispatch(CFG, x, topk_weights, handle)
    # Grouped matmuls: expert j multiplies its tokens_per_expert[j] rows; padding rows give 0.
    gate = jax.lax.ragged_dot(recv_x, w_gate, tokens_per_expert)
    up = jax.lax.ragged_dot(recv_x, w_up, tokens_per_expert)
    expert_out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, tokens_per_expert)
    return jep.ep_combine(CFG, expert_out * recv_w[:, None], handle)


def moe_dense(x, router, w_gate, w_up, w_down):
    """The same layer on one device: every expert on every token, then each token's top-k."""
    topk_idx, topk_weights = route(x, router)
    hidden = jax.nn.silu(jnp.einsum("nh,ehf->enf", x, w_gate)) * jnp.einsum("nh,ehf->enf", x, w_up)
    every = jnp.einsum("enf,efh->enh", hidden, w_down)  # [E, N, H]
    picked = every[topk_idx, jnp.arange(x.shape[0])[:, None]]  # [N, K, H]
    return (picked * topk_weights[..., None]).sum(axis=1)


def loss_of(layer):
    def loss(params, x, target):
        out = layer(x, *params)
        return jnp.mean((out - target) ** 2), out
    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def relative_error(value, reference) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    value, reference = np.asarray(value), np.asarray(reference)
    return float(np.abs(value - reference).max() / max(np.abs(reference).max(), 1e-12))


def main() -> int:
    devices = jax.devices()
    if len(devices) < DP * EP:
        print(f"needs {DP * EP} devices, found {len(devices)}; set XLA_FLAGS=--xla_force_host_platform_device_count=4")
        return 2
    mesh = Mesh(np.array(devices[:DP * EP]).reshape(DP, EP), ("dp", "ep"))
    tokens = DP * EP * TOKENS_PER_SHARD
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape).astype(np.float32) * scale for shape, scale in [
        ((HIDDEN, EXPERTS), 1.0), ((EXPERTS, HIDDEN, FFN), 0.3), ((EXPERTS, HIDDEN, FFN), 0.3),
        ((EXPERTS, FFN, HIDDEN), 0.3)]]
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    target = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)

    param_specs = (P(), P("ep"), P("ep"), P("ep"))  # router replicated, experts sharded over ep
    token_spec = P(("dp", "ep"))  # every (dp, ep) shard routes its own tokens
    sharded_layer = jep.shard_map(moe_shard, mesh, (token_spec, *param_specs), token_spec)
    ep_step = loss_of(lambda x, *p: sharded_layer(x, *p))
    dense_step = loss_of(moe_dense)

    params = [jax.device_put(p, NamedSharding(mesh, s)) for p, s in zip(host, param_specs)]
    x_ep, target_ep = (jax.device_put(a, NamedSharding(mesh, token_spec)) for a in (x, target))
    worst = 0.0
    for step in range(STEPS):
        (loss, out), grads = ep_step(params, x_ep, target_ep)
        one_device = [jax.device_put(np.asarray(p), devices[0]) for p in params]
        (dense_loss, dense_out), dense_grads = dense_step(one_device, jax.device_put(x, devices[0]),
                                                          jax.device_put(target, devices[0]))
        pairs = zip(("out", "grad router", "grad w_gate", "grad w_up", "grad w_down"),
                    (out, *grads), (dense_out, *dense_grads))
        errors = {name: relative_error(a, b) for name, a, b in pairs}
        worst = max(worst, *errors.values())
        print(f"step {step}: loss {float(loss):.5f} (dense {float(dense_loss):.5f}) max relative errors: "
              + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        params = [p - LR * g for p, g in zip(params, grads)]
    if worst > TOL:
        print(f"MISMATCH: max relative error {worst:.2e} > {TOL:.0e}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
