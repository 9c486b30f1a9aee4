"""What the forward keeps for backward on one rank, from a recipe alone: the ``activations``
category of the memory prediction (see [Note: ETP memory prediction] in
``etp/audit/predict.py``)."""
from __future__ import annotations

__all__ = ["activation_bytes", "expert_backward_bytes", "logits_bytes", "moe_layers_on_stage", "padded_expert_rows",
           "value_bytes"]


def activation_bytes(recipe, micro_batch_size: int | None = None) -> int:
    """Bytes the forward keeps for backward on one rank (first pipeline stage), with the
    recipe's activation recompute.

    Per layer, in bytes per element of ``[s, b, h]`` (16-bit training; x2 for fp32), with
    ``a`` heads, ``g`` key / value groups of width ``kv``:

    * 18 for everything but the attention probabilities and the MLP's interior when
      ``a x kv = h`` and ``g = a``: norms' inputs and outputs, q / k / v after rope, the
      attention context, the projection input, the router, residuals (calibrated, with the two
      terms below, against the activations measured on the flagship recipe with local
      attention). In general ``10 + 2 (a + 2 g) kv / h + 2 a kv / h``: q, k and v at their
      widths (local attention expands k and v to ``a`` heads) and the attention output; plus
      ``2 (a + g) kv / h`` with ``qk_layernorm`` (the norms' inputs; best effort, not measured);
    * routed experts, etp's ``ETPGroupedExperts`` (``moe_grouped_gemm``) behind etp's local
      dispatcher:
      ``topk x 4 x moe_ffn / h``: per token copy, the SwiGLU's input (gate and up), 16-bit (the
      probabilities are applied inside the SwiGLU kernel, fc1's and fc2's inputs are rebuilt
      in backward, ``expert_backward_bytes``, and the combine keeps only indices); megatron's ``SequentialMLP`` or any expert
      module behind megatron's own dispatchers (calibrated with ``alltoall``):
      ``topk x (4 + 8 x moe_ffn / h)``: the permuted input and the fc2 output (2 + 2 bytes per
      token copy) and, per copy, the fc1 output (gate and up, 2 x ffn), the SwiGLU output and
      its probability-weighted copy (ffn each); etp's grouped experts behind etp's dispatcher:
      ``R x 4 x moe_ffn / h + 2 x topk``, the SwiGLU's input of every row handed over (``R``
      per token: ``padded_expert_rows``, topk eager, the receive capacity captured) and 2 bytes
      per token copy (calibrated on three measured runs of the flagship); a dense MLP (a dense layer of
      ``moe_layer_freq``) counts ``4 + 8 x ffn / h`` once, shared experts
      ``8 x moe_shared_expert_intermediate_size / h`` (a dense MLP's interior: their input is
      the router's, their output summed into the routed one; best effort, not measured);
    * attention probabilities, ``attention_backend: local`` only: ``6 x heads x s / h`` (the
      fp32 softmax output and its 16-bit copy, [b, heads, s, s] each); torch's fused SDPA
      kernels keep only their output and a [b, heads, s] fp32 log-sum-exp (negligible).

    Plus the loss: the logits etp's cross-entropy keeps for backward (``logits_bytes``: ``2 x s x b x
    V / TP`` in 16-bit training), where megatron-core's would keep their fp32 softmax.

    Recompute (megatron-core's keys): ``full`` keeps each checkpointed unit's 16-bit input and
    rebuilds one unit at a time in backward (uniform: units of ``recompute_num_layers`` layers;
    block: the first ``recompute_num_layers`` layers one by one, the rest stored);
    ``selective`` drops the attention probabilities (``core_attn``) and the MLP interior
    (``mlp`` / ``moe``: its input and output stay; ``shared_experts``: theirs). Under full
    recompute the unit rebuilt at a time is counted at the larger (MoE) layer's size.

    Example::

        activation_bytes(recipe, micro_batch_size=8) / 2**30   # GiB kept for backward
    """
    m, t, p = recipe.model, recipe.train, recipe.parallel
    s, b, h = m.seq_length, micro_batch_size or t.micro_batch_size, m.hidden_size
    width = 1 if (t.bf16 or t.fp16) else 2  # the per-element figures are for 16-bit values
    dense, moe = _layer_factors(recipe)
    element = s * b * h * width / p.tensor_model_parallel_size  # bytes of one [s, b, h] 16-bit factor
    stage = m.moe_layers[: m.num_layers // p.pipeline_model_parallel_size]
    layers, moe_layers = len(stage), sum(stage)
    loss = logits_bytes(recipe, b)
    if t.recompute_granularity == "full":
        # Each checkpointed unit keeps only its 16-bit input [s, b, h]; backward rebuilds one
        # unit at a time (uniform: units of recompute_num_layers layers; block: the first
        # recompute_num_layers layers of the stage one by one, the others keep everything).
        n = t.recompute_num_layers or 1
        unit_input = s * b * h * 2 / p.tensor_model_parallel_size
        largest = element * (moe if moe_layers else dense)
        if t.recompute_method == "block":
            units, rebuilt = min(n, layers), 1
            kept = stage[n:]
            stored = element * (sum(kept) * moe + (len(kept) - sum(kept)) * dense)
        else:
            units, stored, rebuilt = -(-layers // n), 0.0, min(n, layers)
        return int(units * unit_input + stored + rebuilt * largest) + loss
    return int(element * (moe_layers * moe + (layers - moe_layers) * dense)) + loss


def value_bytes(recipe) -> int:
    """Bytes of one activation value: 2 in 16-bit training, 4 in fp32."""
    return 2 if (recipe.train.bf16 or recipe.train.fp16) else 4


def moe_layers_on_stage(recipe) -> int:
    """MoE layers of the first pipeline stage."""
    m = recipe.model
    return sum(m.moe_layers[: m.num_layers // recipe.parallel.pipeline_model_parallel_size])


def logits_bytes(recipe, micro_batch_size: int | None = None) -> int:
    """Bytes of one micro-batch's logits on one rank, ``[s, b, V / TP]`` in the training dtype: what
    etp's cross-entropy (``etp.megatron.cross_entropy``) keeps from the forward to the backward.

    Example::

        logits_bytes(recipe, micro_batch_size=4) / 2**30
    """
    b = micro_batch_size or recipe.train.micro_batch_size
    return (value_bytes(recipe) * recipe.model.seq_length * b * recipe.padded_vocab_size
            // recipe.parallel.tensor_model_parallel_size)


def expert_backward_bytes(recipe, micro_batch_size: int | None = None, fp8: bool = False) -> int:
    """Bytes one MoE layer of etp's grouped experts (behind etp's local dispatcher; 0 otherwise)
    holds at the worst moment of its two GEMMs' backward (``etp.autograd``: the weight gradient,
    then the input gradient), beyond what it kept from the forward and its weight gradients, per
    token copy (``s x b x topk`` rows). fc1's backward holds its input, rebuilt ([Note: rebuilt
    activations] in ``etp.rebuilt_activations``: gathered again from the layer's input, ``h``) and the SwiGLU's
    input gradient (``2 x ffn``), 16-bit, and
    with ``fp8`` (FP8 GEMMs and weight gradients) that gradient's rowwise FP8 copy (``2 x ffn``);
    then during the weight gradient both operands' per-expert columnwise FP8 copies
    (``2 x ffn + h``), or during the input gradient its result (``h``, 16-bit). fc2's the same
    with its input the rebuilt SwiGLU output (``ffn``), its output gradient (``h``) and its
    input gradient (``ffn``).

    (Calibrated on Mixtral-8x7B's captured step at micro-batch 4, whose graph pool held fc1's
    weight-gradient moment: BENCHMARKS.md, the memory audit.)

    Example::

        expert_backward_bytes(recipe, micro_batch_size=4, fp8=True) / 2**30
    """
    m = recipe.model
    if not (m.is_moe and _local_grouped(m)):
        return 0
    b = micro_batch_size or recipe.train.micro_batch_size
    v, h, ffn, q = value_bytes(recipe), m.hidden_size, m.moe_ffn_hidden_size, 1 if fp8 else 0

    def gemm(x: int, gy: int, dx: int) -> int:  # widths of the input, output gradient, input gradient
        held = v * (x + gy) + q * gy
        return held + max(q * (gy + x), v * dx)

    per_copy = max(gemm(h, 2 * ffn, h), gemm(ffn, h, ffn))
    return (per_copy * m.seq_length * b * m.moe_router_topk
            // recipe.parallel.tensor_model_parallel_size)


def padded_expert_rows(recipe) -> int:
    """Expert rows per token the experts are handed: ``topk``, or, with etp's dispatcher in a
    captured step (``cuda_graph: step``), its receive capacity per token, ``EP x min(topk,
    experts per rank)``, valid rows and padding alike.

    Example::

        padded_expert_rows(recipe)   # 16 for top-4 of 64 experts at EP 4, captured
    """
    m, ep = recipe.model, recipe.parallel.expert_model_parallel_size
    if m.is_moe and m.moe_token_dispatcher_type == "etp" and recipe.train.cuda_graph == "step":
        return ep * min(m.moe_router_topk, m.num_experts // ep)
    return m.moe_router_topk


def _local_grouped(m) -> bool:
    return getattr(m, "moe_grouped_gemm", False) and getattr(m, "moe_token_dispatcher_type", "") == "local"


def _layer_factors(recipe) -> tuple[float, float]:
    """(dense layer, MoE layer): bytes kept per [s, b, h] element (16-bit), recompute applied."""
    m, t = recipe.model, recipe.train
    h, a, g, kv, s = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels, m.seq_length
    local = getattr(m, "attention_backend", "local") == "local"
    # q, k, v as the core attention keeps them (megatron's local attention expands the key /
    # value groups to every head), the attention output, and the per-head QK norms' inputs.
    qkv = 2 * (a + 2 * (a if local else g)) * kv / h
    attention = 10 + qkv + 2 * a * kv / h + (2 * (a + g) * kv / h if m.qk_layernorm else 0.0)
    scores = 6 * a * s / h if local else 0.0
    if m.is_moe and _local_grouped(m):
        # etp's ETPGroupedExperts: per token copy, the SwiGLU's input (gate and up, 2 x ffn:
        # etp.expert_swiglu saves it, the routing probabilities applied inside the kernel), 16-bit.
        # fc1's input and fc2's are rebuilt in backward (expert_backward_bytes), and
        # the combine keeps only indices, so fc2's output is not kept.
        routed = m.moe_router_topk * 4 * m.moe_ffn_hidden_size / h
    elif m.is_moe and getattr(m, "moe_grouped_gemm", False) and m.moe_token_dispatcher_type == "etp":
        # etp's ETPGroupedExperts behind etp's dispatcher: the SwiGLU's input for every row the
        # dispatcher hands over, valid or padding (captured: its receive capacity; the kernels
        # skip the padding, the allocation does not: [Note: valid rows] in etp.kernels.blockwise),
        # and 2 bytes per token copy (calibrated on the flagship at EP 4, eager and captured, and
        # EP 2 captured: BENCHMARKS.md, the memory audit).
        routed = padded_expert_rows(recipe) * 4 * m.moe_ffn_hidden_size / h + 2 * m.moe_router_topk
    elif m.is_moe:
        routed = m.moe_router_topk * (4 + 8 * m.moe_ffn_hidden_size / h)
    else:
        routed = 0.0
    # Shared experts: a dense MLP's interior (8 x width / h), its input being the router's and
    # its output summed into the routed experts'.
    shared = 8 * (m.moe_shared_expert_intermediate_size or 0) / h
    mlp = 4 + 8 * m.ffn_hidden_size / h
    modules = set(t.recompute_modules or ("core_attn",))
    if t.recompute_granularity == "selective":
        if "core_attn" in modules:
            scores = 0.0  # the attention core's interior is rebuilt in backward
        if "moe" in modules:
            routed, shared = 4.0, 0.0  # the MoE layer's input and output only
        if "shared_experts" in modules:
            shared = 0.0
        if "mlp" in modules:
            mlp = 2.0  # the MLP's input and output only (its interior is rebuilt)
    return attention + scores + mlp, attention + scores + routed + shared
