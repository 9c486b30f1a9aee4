"""etp: Extended Tensor Parallelism for megatron-core Mixture-of-Experts training.

The public API below; see README.md for an example. Names load on first use (PEP 562), so
``import etp`` itself imports nothing else: neither torch (the JAX wing, ``etp.jax``, needs
none) nor an integration (``etp.megatron``, ``etp.audit``, ``etp.ep``), which are imported by
name.

Example::

    import etp
    config = etp.ETPConfig(etp_size=2)
"""
from __future__ import annotations

import importlib

#: public name -> the module that defines it
_EXPORTS = {
    "etp_grouped_linear": "autograd", "etp_linear": "autograd",
    "ETPConfig": "config", "REMOVED_SETTINGS": "config",
    "clip_grad_norm_": "grads", "finalize_grads": "grads", "global_grad_norm": "grads",
    "ETPGroups": "groups", "ShardGroup": "groups", "build_etp_groups": "groups",
    "GraphedStep": "graphs",
    "ShardLayout": "layout",
    "GroupedSwiGLUExperts": "modules",
    "ETPShardedParam": "param",
    "quantize_shards": "quant",
    "ETPRuntime": "runtime", "register_grad_ready_hook": "runtime",
    "ETPStateError": "state_machines",
    "WrapSummary": "wrap", "prefetch_after_step": "wrap", "register_layer_types": "wrap", "runtime_of": "wrap",
    "shard_parameter": "wrap", "wrap_module_params_etp": "wrap",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'etp' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"etp.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
