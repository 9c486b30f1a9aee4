"""The recipe's parallel sizes reach megatron-core as the recipe states them: the expert
tensor-parallel size goes to ``parallel_state.initialize_model_parallel`` (the groups) and to the
``TransformerConfig`` (the layers), not megatron-core's default (the tensor size)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from etp.recipe import Recipe

pytest.importorskip("megatron.core")
TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe_cpu.yaml"


def _recipe():
    return Recipe.from_yaml(TINY, world_size=None, tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
                            sequence_parallel=True, etp={"etp_size": 1, "expert_etp_size": 1})


def test_the_transformer_config_gets_the_expert_tensor_parallel_size():
    from etp.train.model_build import transformer_config

    config = transformer_config(_recipe(), torch.device("cpu"))
    assert (config.tensor_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)


def test_the_parallel_state_gets_the_expert_tensor_parallel_size(monkeypatch):
    from megatron.core import parallel_state

    from etp.train import setup

    class _Stop(Exception):
        pass

    asked = {}

    def initialize_model_parallel(**sizes):
        asked.update(sizes)
        raise _Stop  # the groups are what this test is about

    monkeypatch.setattr(setup, "_init_process_group", lambda recipe, rank, world, port: (0, 4, "gloo",
                                                                                         torch.device("cpu")))
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", initialize_model_parallel)
    with pytest.raises(_Stop):
        setup.set_up(_recipe(), 0, 4)
    assert (asked["tensor_model_parallel_size"], asked["expert_tensor_parallel_size"]) == (2, 1)
