"""The gradient-scaling table of README.md ("Gradients"), checked with uneven token counts
per rank against the unsharded gradient of the global per-token mean loss."""
import pytest
import torch
from harness import run_distributed
from torch import nn

from etp import ETPConfig, ETPShardedParam, build_etp_groups, finalize_grads, wrap_module_params_etp

TOKENS = [3, 7]  # uneven on purpose: per-rank means would weight rank 0's tokens more


def _scaled(ctx, reduction, normalization):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, reduction=reduction,
                       pad_for_alignment=1)  # every rank holds real rows
    torch.manual_seed(0)
    reference = nn.Linear(6, 4, dtype=torch.float64)
    model = nn.Linear(6, 4, dtype=torch.float64)
    model.load_state_dict(reference.state_dict())
    groups = build_etp_groups(config)
    wrap_module_params_etp(model, config, groups)
    data = [torch.randn(n, 6, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
            for r, n in enumerate(TOKENS)]
    # Reference: the global per-token mean over every rank's tokens.
    torch.cat([reference(x).square().sum(-1) for x in data]).mean().backward()
    per_token = model(data[ctx.rank]).square().sum(-1)
    if normalization == "rank_mean":
        loss = per_token.mean()
    else:  # per-token sum divided by the global token count (known to every rank)
        loss = per_token.sum() / sum(TOKENS)
    loss.backward()
    finalize_grads(model, config, groups)
    weight = model.weight
    want = weight.etp_layout.shard_of(reference.weight.grad) if isinstance(weight, ETPShardedParam) else reference.weight.grad
    return [torch.allclose(weight.grad, want, rtol=1e-12), torch.allclose(model.bias.grad, reference.bias.grad, rtol=1e-12)]


@pytest.mark.parametrize(
    "reduction,normalization,exact",
    [
        ("sum", "global_token_count", True),   # the exact recipe for per-token losses
        ("mean", "global_token_count", False),  # off by 1/N: mean divides once more
        ("mean", "rank_mean", False),           # exact only when every rank has as many tokens
    ],
)
def test_gradient_scaling_table(reduction, normalization, exact):
    for flags in run_distributed(_scaled, 2, reduction, normalization):
        assert flags == [exact, exact]
