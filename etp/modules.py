"""GroupedSwiGLUExperts: routed experts with stacked weights, the carrier of ETP expert shards.

Weights are stacked per expert: ``fc1_weight [E, 2 * ffn, hidden]`` (gate rows first, then
up rows) and ``fc2_weight [E, hidden, ffn]``. Tokens arrive sorted by expert with a count
per expert (the layout megatron-core's token dispatchers produce).
"""
from __future__ import annotations

import torch
from torch import nn

from .autograd import etp_grouped_linear
from .expert_swiglu import expert_swiglu, expert_swiglu_output
from .gemm import plain_grouped_linear, valid_rows_of
from .param import ETPShardedParam
from .rebuilt_activations import rebuilt_in_backward

__all__ = ["GroupedSwiGLUExperts", "grouped_linear"]


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Per-expert linear for a plain or an ETP-sharded stacked weight (same GEMM kernels)."""
    if isinstance(weight, ETPShardedParam):
        return etp_grouped_linear(x, weight, tokens_per_expert)
    return plain_grouped_linear(x, weight, tokens_per_expert)


class GroupedSwiGLUExperts(nn.Module):
    """SwiGLU experts ``fc2(silu(x W_gate^T) * (x W_up^T))`` evaluated for all experts at once.

    Args:
        num_experts: experts held by this module (E).
        hidden_size: model width.
        ffn_hidden_size: width of each expert's hidden layer.
        dtype, device: of the weights.
        init_std: standard deviation of the normal initialization.
        first_expert: the global index of this module's first expert (an expert-parallel
            rank's offset). Expert ``e`` is drawn from its own generator, seeded by one number
            from the default generator and ``e``: a model built at any expert-parallel size
            holds the same experts, and the modules built after it draw the same numbers.

    Example::

        experts = GroupedSwiGLUExperts(num_experts=4, hidden_size=64, ffn_hidden_size=128)
        y = experts(x_sorted_by_expert, tokens_per_expert)   # x: [T, 64], counts: [4]
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        init_std: float = 0.02,
        first_expert: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_experts", num_experts),
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GroupedSwiGLUExperts {name}={value!r}: expected a positive int")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        kw = dict(dtype=dtype, device=device)
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size, **kw))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size, **kw))
        self._init_by_global_expert(init_std, first_expert)
        for weight in (self.fc1_weight, self.fc2_weight):
            # megatron-core's convention for expert params: reduced over the expert DP group.
            weight.allreduce = False
            weight.is_expert = True

    @torch.no_grad()
    def _init_by_global_expert(self, std: float, first_expert: int) -> None:
        # One draw from the default (CPU) generator whatever the expert count, so the default
        # stream advances the same at every expert-parallel size.
        base = int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))
        if self.fc1_weight.device.type == "meta":
            return
        for local in range(self.num_experts):
            for k, weight in enumerate((self.fc1_weight, self.fc2_weight)):
                gen = torch.Generator(device=weight.device).manual_seed(base + 2 * (first_expert + local) + k)
                weight[local].normal_(0.0, std, generator=gen)

    def forward(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [T, hidden]`` sorted by expert, ``tokens_per_expert [E]``; ``probs [T]``, when
        given, scales each token's hidden activation before fc2 (megatron-core's MoE
        convention for router probabilities). The SwiGLU is ``etp.expert_swiglu.swiglu``: one
        fused kernel each way, float32 math rounded once."""
        if tokens_per_expert.numel() != self.num_experts:
            raise ValueError(
                f"tokens_per_expert has {tokens_per_expert.numel()} entries; this module holds "
                f"{self.num_experts} experts"
            )
        gate_up = grouped_linear(x, self.fc1_weight, tokens_per_expert)
        # x may be a padded buffer (captured expert parallelism) whose valid length only the
        # device knows: the SwiGLU stops where the GEMMs do ([Note: valid rows]).
        valid = valid_rows_of(tokens_per_expert, x.device) if x.is_cuda else None
        hidden = expert_swiglu(gate_up, probs, quantize=self._fp8_operands(x), valid_rows=valid)
        # fc2 keeps its input for the weight gradient; the SwiGLU keeps gate_up anyway, so
        # backward runs the SwiGLU's forward kernel again instead ([Note: rebuilt activations]).
        with rebuilt_in_backward(hidden, lambda: expert_swiglu_output(gate_up, probs, valid), [gate_up, probs],
                                 "the experts' SwiGLU output"):
            return grouped_linear(hidden, self.fc2_weight, tokens_per_expert)

    def _fp8_operands(self, x: torch.Tensor) -> bool:
        """Whether both GEMMs around the SwiGLU run in FP8, so that the SwiGLU kernels quantize
        fc2's input and fc1's input gradient as they write them."""
        return all(
            isinstance(w, ETPShardedParam)
            and w.etp_config.gather_format.fp8_gemm_applies(x, w.etp_layout.logical_shape, grouped=True)
            for w in (self.fc1_weight, self.fc2_weight)
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}"
        )
