"""The CPU-checkable parts of CUDA-graph support: graphed chains are separate from eager
ones and skipped by prefetch_after_step, hooks are muted in warm-up and deferred in capture,
GraphedStep refuses to run without CUDA. The capture itself: tests/test_graphs_gpu.py."""
import pytest
import torch
from harness import run_distributed
from test_async import _setup, _step

from etp import ETPConfig, prefetch_after_step, register_grad_ready_hook, runtime_of
from etp.graphs import GraphedStep


def _graphed_chains(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)
    model, groups = _setup(config)
    runtime = runtime_of(model)
    _step(model, config, groups, seed=0)
    moved = runtime.use_chain_class([model.e0.fc1_weight, model.e1.fc1_weight], "graphed")
    classes = {key.chain_class for key in runtime._chains}
    fired = []
    for p in (model.e0.fc1_weight, model.l0.weight):
        register_grad_ready_hook(p, lambda q: fired.append(q))
    with runtime.hooks_muted():
        _step(model, config, groups, seed=1)
    muted = len(fired)
    with runtime.hooks_deferred() as ready:
        _step(model, config, groups, seed=2)
    deferred = len(fired)
    runtime.fire_grad_ready(ready)
    # Only eager chains' heads are issued after the step.
    issued = prefetch_after_step(model)
    eager_heads = sum(1 for key, chain in runtime._chains.items()
                      if key.chain_class == "eager" and chain.orders[next(iter(chain.orders))].params)
    return moved, classes, muted, deferred, [id(p) for p in ready], len(fired), issued, eager_heads, \
        [id(model.e0.fc1_weight), id(model.l0.weight)]


def test_graphed_chains_and_hook_modes():
    for moved, classes, muted, deferred, ready, fired, issued, eager_heads, ids in run_distributed(_graphed_chains, 2):
        assert moved == 2 and classes == {"eager", "graphed"}
        assert muted == 0 and deferred == 0  # nothing fired inside either context
        # Every ETP weight came due once (7 of them); the two with hooks fire on demand.
        assert len(ready) == len(set(ready)) == 7 and set(ids) <= set(ready) and fired == 2
        assert issued == eager_heads > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_graphed_step_needs_cuda():
    with pytest.raises(ValueError, match="needs CUDA"):
        GraphedStep(torch.nn.Linear(2, 2), lambda x: x, torch.zeros(2))
