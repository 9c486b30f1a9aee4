"""GroupedSwiGLUExperts' initialization: the same experts at any expert-parallel size."""
import torch

from etp import GroupedSwiGLUExperts


def test_experts_are_the_same_at_any_expert_parallel_size():
    # EP 1 builds experts 0-3 on one rank; EP 2 builds 0-1 on one and 2-3 on the other, each
    # rank from the same seed: the pieces must be the whole, and the default generator must
    # stand where it stands after the whole (the modules built next draw the same numbers).
    torch.manual_seed(7)
    whole = GroupedSwiGLUExperts(4, 8, 6, init_std=0.5)
    next_draw = torch.randn(5)
    parts = []
    for first in (0, 2):
        torch.manual_seed(7)
        parts.append(GroupedSwiGLUExperts(2, 8, 6, init_std=0.5, first_expert=first))
        assert torch.equal(torch.randn(5), next_draw)
    for name in ("fc1_weight", "fc2_weight"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(whole, name))
    # Distinct experts, distinct weights, drawn from N(0, 0.5^2).
    assert not torch.equal(whole.fc1_weight[0], whole.fc1_weight[1])
    assert abs(float(whole.fc1_weight.std()) - 0.5) < 0.05


def test_experts_build_on_the_meta_device():
    # etp-convert builds the model on meta before it streams the weights in.
    with torch.device("meta"):
        experts = GroupedSwiGLUExperts(2, 8, 6)
    assert experts.fc1_weight.is_meta
