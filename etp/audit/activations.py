"""What the forward keeps for backward on one rank, from a recipe alone: the ``activations``
category of the memory prediction (see [Note: ETP memory prediction] in
``etp/audit/predict.py``)."""
from __future__ import annotations

__all__ = ["activation_bytes"]


def activation_bytes(recipe, micro_batch_size: int | None = None) -> int:
    """Bytes the forward keeps for backward on one rank (first pipeline stage), with the
    recipe's activation recompute.

    Per layer, in bytes per element of ``[s, b, h]`` (16-bit training; x2 for fp32):

    * 18 for everything but the attention probabilities and the routed experts' interior:
      norms' inputs and outputs, q / k / v after rope, the attention context, the projection
      input, the router, residuals (calibrated, with the two terms below, against the
      activations measured on the flagship recipe with local attention);
    * routed experts, etp's ``ETPGroupedExperts`` (``moe_grouped_gemm``) behind etp's local
      dispatcher:
      ``topk x (2 + 6 x moe_ffn / h)``: per token copy, fc1's input, the SwiGLU's input (gate
      and up) and fc2's input, all 16-bit (the probabilities are applied inside the SwiGLU
      kernel, and the combine keeps only indices); megatron's ``SequentialMLP`` or any expert
      module behind megatron's own dispatchers (calibrated with ``alltoall``):
      ``topk x (4 + 8 x moe_ffn / h)``: the permuted input and the fc2 output (2 + 2 bytes per
      token copy) and, per copy, the fc1 output (gate and up, 2 x ffn), the SwiGLU output and
      its probability-weighted copy (ffn each); a dense MLP counts ``4 + 8 x ffn / h`` once;
    * attention probabilities, ``attention_backend: local`` only: ``6 x heads x s / h`` (the
      fp32 softmax output and its 16-bit copy, [b, heads, s, s] each); torch's fused SDPA
      kernels keep only their output and a [b, heads, s] fp32 log-sum-exp (negligible).

    Plus the loss: the fp32 softmax of the cross-entropy, ``4 x s x b x V / TP``.

    Recompute (megatron-core's keys): ``full`` keeps each checkpointed unit's 16-bit input and
    rebuilds one unit at a time in backward (uniform: units of ``recompute_num_layers`` layers;
    block: the first ``recompute_num_layers`` layers one by one, the rest stored);
    ``selective`` drops the attention probabilities (``core_attn``) and the MLP interior
    (``mlp`` / ``moe``: its input and output stay).

    Example::

        activation_bytes(recipe, micro_batch_size=8) / 2**30   # GiB kept for backward
    """
    m, t, p = recipe.model, recipe.train, recipe.parallel
    s, b, h, a = m.seq_length, micro_batch_size or t.micro_batch_size, m.hidden_size, m.num_attention_heads
    width = 1 if (t.bf16 or t.fp16) else 2  # the per-element figures are for 16-bit values
    if m.is_moe and getattr(m, "moe_grouped_gemm", False) and getattr(m, "moe_token_dispatcher_type", "") == "local":
        # etp's ETPGroupedExperts: per token copy, fc1's input (h), the SwiGLU's input
        # (gate and up, 2 x ffn: etp.activations saves it, the routing probabilities applied
        # inside the kernel) and fc2's input (ffn); the combine keeps only indices, so fc2's
        # output is not kept. 16-bit each.
        mlp = m.moe_router_topk * (2 + 6 * m.moe_ffn_hidden_size / h)
    elif m.is_moe:
        mlp = m.moe_router_topk * (4 + 8 * m.moe_ffn_hidden_size / h)
    else:
        mlp = 4 + 8 * m.ffn_hidden_size / h
    scores = 6 * a * s / h if getattr(m, "attention_backend", "local") == "local" else 0.0
    granularity = t.recompute_granularity
    modules = set(t.recompute_modules or ("core_attn",))
    if granularity == "selective" and "core_attn" in modules:
        scores = 0.0  # the attention core's interior is rebuilt in backward
    if granularity == "selective" and ({"mlp", "moe"} & modules):
        mlp = 4 if m.is_moe else 2  # the MLP's input and output only (its interior is rebuilt)
    per_layer = s * b * h * (18 + mlp + scores) * width / p.tensor_model_parallel_size
    layers = m.num_layers // p.pipeline_model_parallel_size
    loss = 4 * s * b * recipe.padded_vocab_size // p.tensor_model_parallel_size
    if granularity == "full":
        # Each checkpointed unit keeps only its 16-bit input [s, b, h]; backward rebuilds one
        # unit at a time (uniform: units of recompute_num_layers layers; block: the first
        # recompute_num_layers layers of the stage one by one, the others keep everything).
        n = t.recompute_num_layers or 1
        unit_input = s * b * h * 2 / p.tensor_model_parallel_size
        if t.recompute_method == "block":
            units, stored, rebuilt = min(n, layers), max(0, layers - n), 1
        else:
            units, stored, rebuilt = -(-layers // n), 0, min(n, layers)
        return int(units * unit_input + (stored + rebuilt) * per_layer) + loss
    return int(per_layer * layers) + loss
