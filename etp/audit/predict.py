"""Memory accounting: predicted per-rank bytes of a recipe with and without ETP.

[Note: ETP memory prediction]
The prediction walks the parameters megatron-core's ``GPTModel`` holds on one rank for the
recipe (TP / EP-local shapes; first pipeline stage; experts either etp's
``ETPGroupedExperts`` or megatron's ``SequentialMLP`` per ``moe_grouped_gemm``) — the same
list ``tests/test_audit.py`` checks against a CPU-built model — instead of building the
model on the meta device: a TP- or EP-sharded megatron model can only be built inside a
process group of its full size, which one CPU process cannot provide. Each ETP weight then
takes the bytes of its padded shard (``ShardLayout``), and the runtime's buffers follow the
runtime's own rules: one gather buffer per (chain, role, padded shape, parity), one fp32
wgrad pool buffer per padded shape (two where weights of one shape reduce back to back),
one FP8 copy of every shard for FP8 gathers.

Categories (bytes per rank): ``params`` (recipe dtype), ``main_grad`` (fp32, megatron-core
mixed precision), ``optimizer`` (Adam: fp32 master weights + 2 moments for bf16/fp16
training, 2 moments for fp32; divided by the replicate size with the distributed
optimizer), ``gather_fwd`` / ``gather_bwd``, ``wgrad_pool``, ``fp8_shards`` and
``activations`` (an estimate: Korthikanti et al. 2022, no recompute, with the MLP part
scaled to the routed experts; it ignores allocator fragmentation and temporary buffers).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import GATHER_DTYPES, ETPConfig
from ..layout import ShardLayout
from .categories import CATEGORIES

__all__ = ["WeightSpec", "predict_memory", "weight_inventory"]


@dataclass(frozen=True)
class WeightSpec:
    """One parameter on one rank: its local (TP/EP) shape and how ETP treats it.

    ``chain`` is None for replicated parameters, else the ETP chain kind (``dense`` or
    ``expert:<role>``); ``expert`` routes it to the expert ETP group.
    """

    name: str
    shape: tuple[int, ...]
    chain: str | None
    expert: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def weight_inventory(recipe) -> list[WeightSpec]:
    """The parameters of one rank (first pipeline stage) in forward order. See
    [Note: ETP memory prediction]."""
    m, p = recipe.model, recipe.parallel
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    etp_tp = p.expert_tensor_parallel_size or tp
    h, kv = m.hidden_size, m.kv_channels
    gated = 2 if m.swiglu else 1
    layer_norm = m.normalization == "LayerNorm"
    bias = m.add_bias_linear
    vocab = recipe.padded_vocab_size // tp
    out: list[WeightSpec] = [WeightSpec("embedding.word_embeddings.weight", (vocab, h), None)]
    if m.position_embedding_type == "learned_absolute":
        out.append(WeightSpec("embedding.position_embeddings.weight",
                              (m.max_position_embeddings or m.seq_length, h), None))

    def norm(prefix):
        out.append(WeightSpec(prefix + ".weight", (h,), None))
        if layer_norm:
            out.append(WeightSpec(prefix + ".bias", (h,), None))

    def linear(name, rows, cols, chain, expert=False, bias_rows=None):
        out.append(WeightSpec(name + ".weight", (rows, cols), chain, expert))
        if bias:
            out.append(WeightSpec(name + ".bias", (bias_rows or rows,), None, expert))

    qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * kv
    for layer in range(m.num_layers // p.pipeline_model_parallel_size):
        pre = f"decoder.layers.{layer}."
        norm(pre + "input_layernorm")
        linear(pre + "self_attention.linear_qkv", qkv_out // tp, h, "dense")
        linear(pre + "self_attention.linear_proj", h, m.num_attention_heads * kv // tp, "dense",
               bias_rows=h)
        norm(pre + "pre_mlp_layernorm")
        if m.is_moe:
            out.append(WeightSpec(pre + "mlp.router.weight", (m.num_experts, h), None))
            local, ffn = m.num_experts // ep, m.moe_ffn_hidden_size
            if m.moe_grouped_gemm:
                out.append(WeightSpec(pre + "mlp.experts.experts.fc1_weight", (local, gated * ffn, h),
                                      "expert:fc1_weight", True))
                out.append(WeightSpec(pre + "mlp.experts.experts.fc2_weight", (local, h, ffn),
                                      "expert:fc2_weight", True))
            else:
                for e in range(local):
                    base = f"{pre}mlp.experts.local_experts.{e}."
                    linear(base + "linear_fc1", gated * ffn // etp_tp, h, "expert:linear_fc1", True)
                    linear(base + "linear_fc2", h, ffn // etp_tp, "expert:linear_fc2", True, bias_rows=h)
        else:
            linear(pre + "mlp.linear_fc1", gated * m.ffn_hidden_size // tp, h, "dense")
            linear(pre + "mlp.linear_fc2", h, m.ffn_hidden_size // tp, "dense", bias_rows=h)
    norm("decoder.final_layernorm")
    if m.untie_embeddings_and_output_weights:
        out.append(WeightSpec("output_layer.weight", (vocab, h), "dense"))
    return out


def _dtype_bytes(name: str, param_bytes: int) -> int:
    dtype = GATHER_DTYPES[name]
    return param_bytes if dtype is None else dtype.itemsize


def predict_memory(recipe, world_size: int, etp: ETPConfig | None = None,
                   distributed_optimizer: bool | None = None) -> dict[str, int]:
    """Predicted bytes per rank of each category for ``recipe`` on ``world_size`` ranks with
    the ETP settings ``etp`` (the recipe's own when None; sizes 1 = without ETP).

    Example::

        with_etp = predict_memory(recipe, 8)
        without = predict_memory(recipe, 8, recipe.etp.replace(etp_size=1, expert_etp_size=1))
    """
    etp = etp or recipe.etp
    t = recipe.train
    mixed = t.bf16 or t.fp16
    param_bytes = 2 if mixed else 4
    optimizer_bytes = 12 if mixed else 8
    distributed = recipe.parallel.use_distributed_optimizer if distributed_optimizer is None else distributed_optimizer
    sizes = {False: etp.etp_size, True: etp.expert_etp_size}
    replicas = {False: recipe.data_parallel_size(world_size) // etp.etp_size,
                True: recipe.expert_data_parallel_size(world_size) // etp.expert_etp_size}
    gather_bytes = _dtype_bytes(etp.gather_dtype, param_bytes)
    fp8 = etp.gather_dtype.startswith("fp8")
    result = dict.fromkeys(CATEGORIES, 0)
    buffers: dict[tuple, int] = {}  # (chain, role, padded shape, parity) -> elements
    pool_order: list[tuple] = []  # padded shapes of the ETP weights, forward order
    positions: dict[str, int] = {}
    for weight in weight_inventory(recipe):
        size = sizes[weight.expert]
        sharded = weight.chain is not None and size > 1
        if sharded:
            layout = ShardLayout(weight.shape, size, 0, etp.pad_for_alignment)
            numel = layout.shard_rows * layout.cols
            position = positions.get(weight.chain, 0)
            positions[weight.chain] = position + 1
            for role in ("fwd", "bwd"):
                buffers[(weight.chain, role, layout.padded_shape, position % 2)] = layout.padded_rows * layout.cols
            pool_order.append(layout.padded_shape)
            if fp8:
                result["fp8_shards"] += numel
        else:
            numel = weight.numel
        result["params"] += numel * param_bytes
        result["main_grad"] += numel * 4
        divisor = replicas[weight.expert] if distributed else 1
        result["optimizer"] += -(-numel * optimizer_bytes // max(1, divisor))
    for (_chain, role, _, _), elements in buffers.items():
        result["gather_" + role] += elements * gather_bytes
    result["wgrad_pool"] = _wgrad_pool_bytes(pool_order)
    result["activations"] = _activation_bytes(recipe)
    return result


def _wgrad_pool_bytes(shapes_in_forward_order: list[tuple]) -> int:
    """The pool holds one fp32 (main-grad dtype) buffer per padded shape, two where two
    weights of one shape reduce back to back: a weight's buffer returns to the pool when the
    *next* reduce-scatter is issued, after that one took its own buffer."""
    counts: dict[tuple, int] = {}
    previous = None
    for shape in reversed(shapes_in_forward_order):  # the backward (reduce-scatter) order
        counts[shape] = max(counts.get(shape, 1), 2 if shape == previous else 1)
        previous = shape
    return sum(n * rows * cols * 4 for (rows, cols), n in counts.items())


def _activation_bytes(recipe) -> int:
    """Korthikanti et al. (2022) per-layer activations without recompute, s·b·h·(34 + 5as/h)
    bytes for 16-bit training, of which 19·s·b·h belong to the 4h MLP: that part is scaled to
    the routed experts (top-k tokens through experts of width moe_ffn_hidden_size)."""
    m, t, p = recipe.model, recipe.train, recipe.parallel
    s, b, h, a = m.seq_length, t.micro_batch_size, m.hidden_size, m.num_attention_heads
    width = 1 if (t.bf16 or t.fp16) else 2  # the formula counts 16-bit values
    mlp = 19.0
    if m.is_moe:
        mlp *= m.moe_router_topk * m.moe_ffn_hidden_size / (4 * h)
    elif m.ffn_hidden_size:
        mlp *= m.ffn_hidden_size / (4 * h)
    per_layer = s * b * h * (15 + mlp + 5 * a * s / h) * width / p.tensor_model_parallel_size
    layers = m.num_layers // p.pipeline_model_parallel_size
    return int(per_layer * layers)
