"""etp: Extended Tensor Parallelism for megatron-core Mixture-of-Experts training.

Public API; see README.md for an example.
"""
from .autograd import etp_grouped_linear, etp_linear
from .config import ETPConfig
from .grads import clip_grad_norm_, finalize_grads, global_grad_norm
from .groups import ETPGroups, ShardGroup, build_etp_groups
from .layout import ShardLayout
from .modules import GroupedSwiGLUExperts
from .param import ETPShardedParam
from .quant import quantize_shards
from .runtime import ETPRuntime, register_grad_ready_hook
from .state import ETPStateError
from .wrap import WrapSummary, prefetch_after_step, runtime_of, shard_parameter, wrap_module_params_etp

__all__ = [
    "ETPConfig",
    "ETPGroups",
    "ETPRuntime",
    "ETPStateError",
    "ETPShardedParam",
    "GroupedSwiGLUExperts",
    "ShardGroup",
    "ShardLayout",
    "WrapSummary",
    "build_etp_groups",
    "etp_grouped_linear",
    "etp_linear",
    "clip_grad_norm_",
    "finalize_grads",
    "global_grad_norm",
    "prefetch_after_step",
    "quantize_shards",
    "register_grad_ready_hook",
    "runtime_of",
    "shard_parameter",
    "wrap_module_params_etp",
]
__version__ = "0.1.0"
