"""Shared expert-parallel test cases: global routings of every rank and an independent
single-process float64 model of the whole MoE layer (route, per-expert linear, un-route
weighted by the routing weights), used by the EP tests of every backend and of megatron's
dispatcher."""
from __future__ import annotations

import torch


def make_case(case: str, world: int, num_experts=8, topk=3, hidden=5, max_tokens=7, seed=0):
    """Global routing of all ranks: per rank (idx [T, K], weights [T, K], x [T, H]), float64."""
    gen = torch.Generator().manual_seed(seed)
    local = num_experts // world
    ranks = []
    for r in range(world):
        tokens = max_tokens - (r % 3)
        if case == "zero_tokens" and r == 1:
            tokens = 0
        scores = torch.rand(tokens, num_experts, generator=gen, dtype=torch.float64)
        if case == "skewed":
            scores[:, 0] = 2.0  # every token picks expert 0
        elif case == "empty_experts":
            scores[:, 1::2] = -1.0  # odd experts never picked
        elif case == "one_rank":
            scores[:, local:] = -1.0  # all K experts on rank 0: duplicates of one destination
        weights, idx = scores.topk(topk, dim=1)
        x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
        ranks.append((idx, weights.softmax(1), x))
    expert_w = torch.randn(num_experts, hidden, hidden, generator=gen, dtype=torch.float64) / hidden**0.5
    grads = [torch.randn(idx.shape[0], hidden, generator=gen, dtype=torch.float64) for idx, _, _ in ranks]
    return ranks, expert_w, grads


def kept_pairs(ranks, num_experts, expert_capacity):
    """Per rank [T, K] bool: the pairs megatron-style dropping keeps (earlier ranks, then
    earlier (token, k) first, at most ``expert_capacity`` per expert)."""
    used = [0] * num_experts
    out = []
    for idx, _, _ in ranks:
        keep = torch.zeros(idx.shape, dtype=torch.bool)
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if expert_capacity is None or used[e] < expert_capacity:
                    used[e] += 1
                    keep[t, k] = True
        out.append(keep)
    return out


def reference_layer(ranks, expert_w, grads, keep=None):
    """Single-process MoE layer in float64: per rank (out, grad x, grad weights) and grad of
    the expert weights."""
    expert_w = expert_w.clone().requires_grad_(True)
    results = []
    loss = 0.0
    leaves = []
    for r, (idx, weights, x) in enumerate(ranks):
        x = x.clone().requires_grad_(True)
        w = weights.clone().requires_grad_(True)
        out = torch.zeros_like(x)
        for k in range(idx.shape[1]):
            y = torch.einsum("th,thg->tg", x, expert_w[idx[:, k]]) * w[:, k:k + 1]
            if keep is not None:
                y = y * keep[r][:, k:k + 1]
            out = out + y
        loss = loss + (out * grads[r]).sum()
        leaves.append((out, x, w))
    loss.backward()
    for out, x, w in leaves:
        results.append((out.detach(), x.grad, w.grad))
    return results, expert_w.grad


def run_layer(disp, idx, weights, x, local_w, grad, trim=False):
    """This rank's layer through ``disp``: returns out, grad x, grad weights, grad local experts.
    ``trim``: the experts see (and return) only the valid rows."""
    x = x.clone().requires_grad_(True)
    w = weights.clone().requires_grad_(True)
    local_w = local_w.clone().requires_grad_(True)
    handle = disp.prepare(idx)
    recv_x, recv_w, tokens_per_expert = disp.dispatch(x, w, handle, trim=trim)
    rows, start = [], 0
    for le, n in enumerate(tokens_per_expert.tolist()):
        rows.append(recv_x[start:start + n] @ local_w[le] * recv_w[start:start + n, None])
        start += n
    if trim:
        assert tokens_per_expert.device.type == "cpu" and recv_x.shape[0] == start == recv_w.shape[0]
    else:
        rows.append(torch.zeros(disp.capacity - start, x.shape[1], dtype=x.dtype))
    expert_out = torch.cat(rows)
    out = disp.combine(expert_out, handle)
    (out * grad).sum().backward()
    disp.check()
    return out.detach().clone(), x.grad.clone(), w.grad.clone(), local_w.grad.clone()
