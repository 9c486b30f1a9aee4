"""etp.megatron.compat's readers on the installed megatron-core (the others run inside the tests of
their users: layer specs, the sync-free step, the MoE metrics)."""
import warnings

import pytest

pytest.importorskip("megatron.core")


def _config(**kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **kwargs)
    graph_warnings = [str(w.message) for w in caught if "cuda_graph" in str(w.message) or "scope" in str(w.message)]
    return config, graph_warnings


def test_whole_layer_cuda_graphs_is_megatrons_default_without_its_warning():
    from etp.megatron.compat import whole_layer_cuda_graphs

    default, default_warnings = _config()
    ours, our_warnings = _config(**whole_layer_cuda_graphs())
    assert default_warnings and not our_warnings  # megatron-core deprecates its own default
    for name in ("cuda_graph_scope", "cuda_graph_modules"):
        assert getattr(ours, name, None) == getattr(default, name, None), name
