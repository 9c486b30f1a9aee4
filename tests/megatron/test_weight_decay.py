"""etp-train's torch steppers decay weights as megatron-core does by default: biases and 1-D
parameters (norms) take no weight decay. With zero gradients AdamW moves a parameter only by its
decay, ``p <- p * (1 - lr * weight_decay)``, so one step tells the groups apart without reading
them."""
from __future__ import annotations

import pytest
import torch

from etp.train.optimizer_steps import TorchStep, weight_decay_groups


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)
        self.experts = torch.nn.Parameter(torch.randn(2, 8, 8))


def test_only_weights_of_two_or_more_dimensions_decay():
    model = _Block()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    lr, decay = 0.5, 0.2
    optimizer = torch.optim.AdamW(weight_decay_groups(model, decay), lr=lr)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        expected = before[name] * (1 - lr * decay) if before[name].ndim >= 2 else before[name]
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0, msg=name)


def test_the_cpu_stepper_uses_megatron_cores_groups():
    class _Recipe:
        class train:  # noqa: N801 - stands in for Recipe.train
            lr, weight_decay, adam_beta1, adam_beta2, adam_eps = 0.5, 0.2, 0.9, 0.95, 1e-8

    model = _Block()
    step = TorchStep(_Recipe, model, groups=None, tp_group=None)
    decays = {id(p): g["weight_decay"] for g in step.optimizer.param_groups for p in g["params"]}
    names = {name: decays[id(p)] for name, p in model.named_parameters()}
    assert names == {"norm.weight": 0.0, "norm.bias": 0.0, "proj.weight": pytest.approx(0.2),
                     "proj.bias": 0.0, "experts": pytest.approx(0.2)}
