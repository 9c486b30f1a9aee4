"""A small MoE language model that runs anywhere, CPU included: megatron-core TP linears for
attention and the output head, etp's grouped SwiGLU experts, a top-k router.

megatron-core's own attention, MoE router and token dispatchers call ``torch.cuda`` and do
not run on a CPU-only torch; this model keeps the same parameter layout (what ETP shards)
with torch implementations of those parts, so the CPU recipe trains the same kind of model.
On GPUs the driver builds megatron-core's ``GPTModel`` instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import GroupedSwiGLUExperts

__all__ = ["TinyMoELM"]


def _rope(x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``x [b, heads, s, d]`` at ``position_ids
    [b, s]`` (None: 0 .. s - 1)."""
    s, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    positions = torch.arange(s, device=x.device) if position_ids is None else position_ids[:, None, :]
    angles = positions.to(torch.float32)[..., None] * inv
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, config, init) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        self.heads = heads
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, config=config, init_method=init,
                                        bias=False, gather_output=False)
        self.proj = RowParallelLinear(hidden, hidden, config=config, init_method=init, bias=False,
                                      input_is_parallel=True, skip_bias_add=True)

    def forward(self, x: torch.Tensor, attention_mask=None, position_ids=None) -> torch.Tensor:  # x [s, b, h]
        qkv, _ = self.qkv(x)
        s, b, width = qkv.shape
        local_heads = self.heads * width // (3 * x.shape[-1])
        q, k, v = qkv.view(s, b, local_heads, 3, -1).permute(3, 1, 2, 0, 4)  # 3 x [b, heads, s, d]
        # attention_mask: megatron's [b, 1, s, s] bool, True = masked out (etp.data.batch)
        mask = None if attention_mask is None else attention_mask.logical_not()
        out = F.scaled_dot_product_attention(_rope(q, position_ids), _rope(k, position_ids), v, attn_mask=mask,
                                             is_causal=mask is None)
        out, _ = self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))
        return out


class _MoE(nn.Module):
    def __init__(self, hidden: int, experts: int, ffn: int, topk: int, dtype, init_std) -> None:
        super().__init__()
        self.topk, self.num_experts = topk, experts
        # A plain parameter, not an nn.Linear: routers stay replicated under ETP.
        self.router_weight = nn.Parameter(torch.empty(experts, hidden, dtype=dtype))
        nn.init.normal_(self.router_weight, std=init_std)
        self.experts = GroupedSwiGLUExperts(experts, hidden, ffn, dtype=dtype, init_std=init_std)
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores = F.linear(tokens, self.router_weight).float().softmax(dim=-1)
        probs, expert = scores.topk(self.topk, dim=-1)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        # Switch-style load balancing: experts' token share times their mean router score.
        share = F.one_hot(expert, self.num_experts).float().sum(dim=(0, 1)) / expert.numel()
        self.aux_loss = self.num_experts * (share * scores.mean(dim=0)).sum()
        flat_expert = expert.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_of = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.topk)[order]
        counts = torch.bincount(flat_expert, minlength=self.num_experts).cpu()
        out = self.experts(tokens[token_of], counts, probs.reshape(-1)[order].to(x.dtype))
        # Back to (token, k) order by a gather, then a fixed-order sum over k: deterministic on
        # every device (index_add_ accumulates in arrival order on GPUs).
        per_slot = out[torch.argsort(order)].view(tokens.shape[0], self.topk, -1)
        return per_slot.sum(dim=1).view(shape)


def _sharded_state_dict(module: nn.Module, prefix: str, sharded_offsets: tuple, metadata) -> dict:
    """Recursive megatron-style description of a plain torch module: children with their
    own ``sharded_state_dict`` (megatron's TP linears) describe themselves, every other
    parameter is replicated over TP and DP."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    own = {name: p for name, p in module.named_parameters(recurse=False)}
    result = make_sharded_tensors_for_checkpoint(own, prefix, sharded_offsets=sharded_offsets) if own else {}
    for name, child in module.named_children():
        child_prefix = f"{prefix}{name}."
        if hasattr(child, "sharded_state_dict"):
            result.update(child.sharded_state_dict(child_prefix, sharded_offsets, metadata))
        else:
            result.update(_sharded_state_dict(child, child_prefix, sharded_offsets, metadata))
    return result


class TinyMoELM(nn.Module):
    """Decoder-only MoE LM: ``forward(tokens [b, s], attention_mask, position_ids) -> logits [b, s, vocab]``.

    Args:
        recipe: an ``etp.megatron.Recipe`` (model sizes, init std).
        dtype: parameter dtype.

    Example::

        model = TinyMoELM(Recipe.from_yaml("recipes/tiny_moe_cpu.yaml"))
    """

    def __init__(self, recipe, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        from megatron.core import ModelParallelConfig

        m = recipe.model
        config = ModelParallelConfig(
            tensor_model_parallel_size=recipe.parallel.tensor_model_parallel_size,
            params_dtype=dtype, use_cpu_initialization=True,
        )
        init = lambda w: nn.init.normal_(w, std=m.init_method_std)  # noqa: E731
        hidden, vocab = m.hidden_size, recipe.padded_vocab_size
        self.embedding = nn.Embedding(vocab, hidden, dtype=dtype)
        nn.init.normal_(self.embedding.weight, std=m.init_method_std)
        self.layers = nn.ModuleList()
        for _ in range(m.num_layers):
            self.layers.append(nn.ModuleDict({
                "attn_norm": nn.RMSNorm(hidden, dtype=dtype),
                "attention": _Attention(hidden, m.num_attention_heads, config, init),
                "mlp_norm": nn.RMSNorm(hidden, dtype=dtype),
                "moe": _MoE(hidden, m.num_experts, m.moe_ffn_hidden_size or m.ffn_hidden_size,
                            m.moe_router_topk, dtype, m.init_method_std),
            }))
        self.final_norm = nn.RMSNorm(hidden, dtype=dtype)
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        self.output = ColumnParallelLinear(hidden, vocab, config=config, init_method=init,
                                           bias=False, gather_output=True)

    def forward(self, tokens: torch.Tensor, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Logits of ``tokens [b, s]``; ``attention_mask`` / ``position_ids`` as ``etp.data.batch.Batch``'s."""
        x = self.embedding(tokens).transpose(0, 1)  # [s, b, h], megatron's layout
        for layer in self.layers:
            x = x + layer["attention"](layer["attn_norm"](x), attention_mask, position_ids)
            x = x + layer["moe"](layer["mlp_norm"](x))
        logits, _ = self.output(self.final_norm(x))
        return logits.transpose(0, 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron-core's checkpoint description (TP linears TP-sharded, the rest
        replicated), for ``dist_checkpointing`` and ``etp.megatron.checkpoint.model_state``."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        return _sharded_state_dict(self, prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))

    def aux_loss(self) -> torch.Tensor:
        return sum(layer["moe"].aux_loss for layer in self.layers)
