"""Triton kernels for the FP8 weight gather of Extended Tensor Parallelism.

* :func:`multi_tensor_amax` - max(|x|) of many tensors in one launch.
* :func:`amax_to_scale` - per-tensor scale ``448 / amax``.
* :func:`multi_tensor_cast_fp8` - per-tensor-scaled e4m3 cast of many tensors in
  one launch, optionally recording each one's amax from the same read (delayed scaling);
  :class:`MultiTensorCastPlan` - the same for fixed destinations, its launch tables kept.
* :func:`quantize_blockwise` / :func:`dequantize_fp8` - (1, 128) / (128, 128)
  blockwise format and dequantization.
* :func:`quantize_rowwise` - one-pass per-row FP8 quantization of activations.
* :func:`swiglu` / :func:`swiglu_backward` - fused SwiGLU (optionally FP8-quantizing its
  output rowwise in the same pass), the experts' activation.
* :func:`quantize_grouped_colwise` - per-(expert, column) FP8 of a token-sorted activation,
  transposed and padded per expert: the FP8 weight-gradient GEMM's operands.
* :func:`transpose_last2` - tiled transpose of FP8 matrices (the backward GEMM operand).
* :func:`embedding_backward` - deterministic, capture-safe embedding weight gradient.
* :func:`multi_tensor_adamw` - one AdamW pass over fp32 masters that writes the bf16 weights.
* ``etp.kernels.rope.rope`` - megatron-core's unfused RoPE in one pass each way, the same bits.
* ``etp.kernels.gather_sum.gather_sum`` - each token's sum of its K expert rows in one pass
  (the local combine). These two are not re-exported here: the names are their modules'.

Every op takes ``impl="auto" | "triton" | "torch"``; the pure-torch references
in :mod:`etp.kernels.reference` define the numerics and are the CPU fallback.
To run the Triton kernels on CPU set ``TRITON_INTERPRET=1`` before triton is
first imported.
"""

from etp.kernels.adam import multi_tensor_adamw
from etp.kernels.amax import multi_tensor_amax
from etp.kernels.blockwise import quantize_blockwise, quantize_rowwise
from etp.kernels.cast import MultiTensorCastPlan, amax_to_scale, multi_tensor_cast_fp8
from etp.kernels.colwise import grouped_colwise_layout, quantize_grouped_colwise
from etp.kernels.dequantize import dequantize_fp8
from etp.kernels.embedding import embedding_backward
from etp.kernels.reference import FP8_E4M3_MAX
from etp.kernels.swiglu import swiglu, swiglu_backward
from etp.kernels.transpose import transpose_last2

__all__ = [
    "FP8_E4M3_MAX",
    "MultiTensorCastPlan",
    "amax_to_scale",
    "dequantize_fp8",
    "embedding_backward",
    "multi_tensor_adamw",
    "multi_tensor_amax",
    "multi_tensor_cast_fp8",
    "quantize_blockwise",
    "grouped_colwise_layout",
    "quantize_grouped_colwise",
    "quantize_rowwise",
    "swiglu",
    "swiglu_backward",
    "transpose_last2",
]
