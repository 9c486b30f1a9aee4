"""Memory accounting: predicted per-rank bytes of a recipe with and without ETP.

[Note: ETP memory prediction]
The prediction walks the parameters megatron-core's ``GPTModel`` holds on one rank for the
recipe (TP / EP-local shapes; first pipeline stage; experts either etp's
``ETPGroupedExperts`` or megatron's ``SequentialMLP`` per ``moe_grouped_gemm``) — the same
list ``tests/test_audit.py`` checks against a CPU-built model — instead of building the
model on the meta device: a TP- or EP-sharded megatron model can only be built inside a
process group of its full size, which one CPU process cannot provide. Each ETP weight then
takes the bytes of its padded shard (``ShardLayout``), and the runtime's buffers follow the
runtime's own rules: one gather buffer per (chain, role, padded shape, parity), one wgrad
pool buffer per padded shape in the reduction's wire dtype (fp32 for NCCL's, the 16-bit
parameter dtype for the symmetric-memory ones; two where weights of one shape reduce back to back),
one FP8 copy of every shard for FP8 gathers.

Categories (bytes per rank): ``params`` (recipe dtype), ``main_grad`` (fp32, megatron-core
mixed precision), ``optimizer`` (Adam: fp32 master weights + 2 moments for bf16/fp16
training, 2 moments for fp32; divided by the replicate size with the distributed
optimizer), ``gather_fwd`` / ``gather_bwd``, ``wgrad_pool``, ``fp8_shards`` and
``activations`` (what the forward keeps for backward, see ``activation_bytes``).

[Note: predicted peak]
The categories are the bytes alive throughout a step; the allocator's peak adds transients.
``predict_peak`` takes the larger of two phases:

* forward / backward: categories + the loss's transient at the start of backward (the bf16
  copy of the fp32 gradient of the logits, 2 x s x b x V bytes: megatron-core's
  ``vocab_parallel_cross_entropy`` computes that gradient in place in its saved fp32 softmax);
* optimizer step (activations freed): categories + one fp32 temporary per element the
  optimizer steps (torch's foreach Adam materializes ``sqrt(v) + eps`` for the whole list:
  4 bytes per local main-param element, divided by the replicas under the distributed
  optimizer). Without ETP this phase is the peak of the flagship recipe at micro-batch 2
  under ``megatron_fallbacks: stock``. With ``fast`` (the default: torch's fused Adam,
  ``etp.megatron.fast_fallbacks``) the step holds no such temporary. Measured on 1 x H200
  (ETP off, SDPA, local dispatcher): micro-batch 2 / 4 / 8 peak 83.05 / 87.30 / 95.80 GiB vs
  83.44 / 88.16 / 97.60 predicted (within 1.9 %); stock micro-batch 2: 95.29 vs 96.21.

Calibration (flagship recipe, 2 and 4 x H200, local attention; measured peaks allocated in
shared/anchors.md and benchmarks/audit_recipe_4xh200_*.json): the old prediction (categories
only, Korthikanti activations) under-predicted by 7-10 %: it missed the local attention's
fp32 *and* bf16 softmax probabilities [b, heads, s, s] (megatron upcasts the scores when
``attention_softmax_in_fp32``), the cross-entropy's fp32 [s, b, V] buffers and the optimizer
temporaries. With them (world 2): ETP 2 micro-batch 2 / 4 / 8: 57.4 / 68.2 / 89.6 GiB
predicted vs 58.1 / 68.0 / 89.3 measured; ETP off micro-batch 2 / 4: 96.2 / 100.2 vs 95.5 /
100.1; distributed optimizer 63.2 vs 63.2; world 4: ETP 4 38.0 vs 38.2, ETP off 96.2 vs 95.5
(all within 1.2 %). The SDPA figures (no score matrices) are not measured yet.

Recalibration (2 x H200, 2026-11-23, SDPA, ``megatron_fallbacks: fast``, etp's grouped experts,
copy-engine gathers; measured in BENCHMARKS.md sessions 6 and 7): the prediction above was
9-19 % high. Three terms were wrong, each read off the code, not fitted: the loss transient
(6 -> 2 x s x b x V, see above), the routed experts' kept tensors (etp's experts keep neither
fc2's output nor a probability-weighted copy: ``activation_bytes``), and the copy-engine
transport's symmetric memory, which ``max_memory_allocated`` does not see
(``outside_allocator``: counted by ``fits``, not in ``peak``). Now, predicted vs measured GiB:
flagship ETP 2 micro-batch 2 45.8 vs 46.9 (bf16 gathers), 47.9 vs 49.1 (FP8); ETP off 82.1 vs
82.4; wide recipe (micro-batch 16) ETP 2 69.5 vs 70.9, FP8 71.6 vs 73.1, ETP 2 + distributed
optimizer 73.8 vs 75.2, DDP 105.8 vs 107.3, distributed optimizer 79.6 vs 81.1 (all within
2.4 %, all slightly low).

Session 11 (2 x H100, 2026-11-26): ``reduce_transport: auto`` became the push reduce-scatter,
whose wgrad buffers are bf16 (its 16-bit wire) instead of fp32, and whose staging is symmetric
memory (``outside_allocator``). Flagship ETP 2 micro-batch 2, predicted vs measured GiB: push
44.6 vs 44.1 (bf16 gathers), 46.7 vs 46.3 (FP8); NCCL reductions 45.8 vs 46.9, 47.9 vs 49.1.

``fits`` adds what the prediction leaves out: allocator fragmentation (``FRAGMENTATION``; the
peak reserved / peak allocated of the 4 x H200 audits was 1.07 with ETP and 1.10 without)
is a ratio, and the CUDA context, NCCL and cuBLAS workspaces outside the allocator
(``RESERVED_OUTSIDE``) are a constant.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import GATHER_DTYPES, ETPConfig
from ..layout import ShardLayout
from .categories import CATEGORIES

__all__ = ["FRAGMENTATION", "RESERVED_OUTSIDE", "WeightSpec", "activation_bytes", "fits", "gather_transport",
           "largest_micro_batch", "predict_memory", "predict_peak", "weight_inventory"]

#: Allocator headroom over the predicted peak when deciding whether a run fits (see [Note: predicted peak]).
FRAGMENTATION = 1.10
#: Bytes per GPU outside the caching allocator (CUDA context, NCCL buffers, cuBLAS workspaces).
RESERVED_OUTSIDE = 2 * 1024**3


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
                   distributed_optimizer: bool | None = None, micro_batch_size: int | None = None,
                   transport: str | None = None) -> dict[str, int]:
    """Predicted bytes per rank of each category for ``recipe`` on ``world_size`` ranks with
    the ETP settings ``etp`` (the recipe's own when None; sizes 1 = without ETP).

    Example::

        with_etp = predict_memory(recipe, 8)
        without = predict_memory(recipe, 8, recipe.etp.replace(etp_size=1, expert_etp_size=1))

    ``micro_batch_size`` replaces the recipe's for the activations (the what-if table).
    ``transport``: the transport (``gather_transport``); it decides the reduction too
    (``reduce_transport``), whose wire dtype sizes the wgrad pool.
    """
    etp = etp or recipe.etp
    t = recipe.train
    mixed = t.bf16 or t.fp16
    param_bytes = 2 if mixed else 4
    optimizer_bytes = 12 if mixed else 8
    distributed = recipe.parallel.use_distributed_optimizer if distributed_optimizer is None else distributed_optimizer
    replicas = {False: recipe.data_parallel_size(world_size) // etp.etp_size,
                True: recipe.expert_data_parallel_size(world_size) // etp.expert_etp_size}
    fp8 = etp.gather_dtype.startswith("fp8")
    result = dict.fromkeys(CATEGORIES, 0)
    pool_order: list[tuple] = []  # padded shapes of the ETP weights, forward order
    for weight, layout, numel in _per_rank(recipe, etp):
        if layout is not None:
            pool_order.append(layout.padded_shape)
            if fp8:
                result["fp8_shards"] += numel
        result["params"] += numel * param_bytes
        result["main_grad"] += numel * 4
        divisor = replicas[weight.expert] if distributed else 1
        result["optimizer"] += -(-numel * optimizer_bytes // max(1, divisor))
    gathers = gather_transport(etp, transport)
    for role, (nbytes, _outside) in gather_buffer_bytes(recipe, etp, gathers).items():
        result["gather_" + role] += nbytes
    reduce = reduce_transport(gathers)
    wire_bytes = param_bytes if reduce in SIXTEEN_BIT_WIRE_REDUCTIONS and param_bytes == 2 else 4
    result["wgrad_pool"] = _wgrad_pool_bytes(pool_order, wire_bytes)
    result["activations"] = activation_bytes(recipe, micro_batch_size)
    return result


#: The driver's mapping granularity (H100 / H200): shards of whole multiples of it get aliased
#: gather buffers ([Note: aliased own rows] in etp/transport/vmm.py).
MAPPING_GRANULARITY = 2 << 20


def gather_buffer_bytes(recipe, etp: ETPConfig, gathers: str, aliased: bool | None = None) -> dict[str, tuple[int, int]]:
    """Per role ("fwd", "bwd", "recompute"), the bytes of the weight cache's gather buffers on
    one rank and the part of them outside torch's allocator: one buffer per (chain, role, padded
    shape, parity) ([Note: ETP buffer keys]); with copy-engine gathers (own rows aliased,
    [Note: aliased own rows]), a weight whose shard is a whole multiple of ``MAPPING_GRANULARITY``
    has a backing of its ``size - 1`` peers' rows only, mapped outside the allocator.
    ``aliased``: whether copy-engine gathers alias (None: they do; False: a host whose ranks
    cannot share allocations, see ``etp.transport.vmm.handle_sharing_status``)."""
    t = recipe.train
    gather_bytes = _dtype_bytes(etp.gather_dtype, 2 if (t.bf16 or t.fp16) else 4)
    # A recomputed forward that consumes ETP weights gathers them into buffers of its own
    # role ([Note: ETP recompute chain]); those of a prefetching chain are kept like the others.
    roles = ("fwd", "bwd", "recompute") if _recomputes_weights(t) and etp.prefetch else ("fwd", "bwd")
    # gather_reuse "pass" / "step": one forward buffer per weight, which backward and recompute
    # read ([Note: gather reuse]); nothing of theirs is allocated.
    keep = etp.gather_reuse != "chain"
    if keep:
        roles = ("fwd",)
    aliased = gathers == "copy_engine" and aliased is not False
    buffers: dict[tuple, tuple[int, int]] = {}  # (chain, role, padded shape, parity) -> (bytes, outside)
    positions: dict[str, int] = {}
    for weight, layout, _numel in _per_rank(recipe, etp):
        if layout is None:
            continue
        position = positions.get(weight.chain, 0)
        positions[weight.chain] = position + 1
        size = layout.padded_rows // layout.shard_rows
        full = layout.padded_rows * layout.cols * gather_bytes
        shard = full // size
        nbytes, outside = (shard * (size - 1),) * 2 if aliased and shard % MAPPING_GRANULARITY == 0 else (full, 0)
        for role in roles:
            slot = -1 - position if keep else position % 2
            buffers[(weight.chain, role, layout.padded_shape, slot)] = (nbytes, outside)
    result = {role: (0, 0) for role in roles}
    for (_chain, role, _, _), (nbytes, outside) in buffers.items():
        result[role] = (result[role][0] + nbytes, result[role][1] + outside)
    return result


def _recomputes_weights(train) -> bool:
    """Whether activation recompute re-runs modules holding weights (full recompute, or
    selective recompute of the MLP / MoE)."""
    if train.recompute_granularity == "full":
        return True
    if train.recompute_granularity == "selective":
        return bool({"mlp", "moe"} & set(train.recompute_modules or ()))
    return False


def _per_rank(recipe, etp: ETPConfig):
    """Yields ``(weight, layout, elements on this rank)`` for every weight of the recipe:
    ``layout`` is the ETP ``ShardLayout`` of a sharded weight (its shard's elements), None for
    a replicated one (all its elements)."""
    sizes = {False: etp.etp_size, True: etp.expert_etp_size}
    for weight in weight_inventory(recipe):
        size = sizes[weight.expert]
        if weight.chain is not None and size > 1:
            layout = ShardLayout(weight.shape, size, 0, etp.pad_for_alignment)
            yield weight, layout, layout.shard_rows * layout.cols
        else:
            yield weight, None, weight.numel


def _stepped_elements(recipe, world_size: int, etp: ETPConfig, distributed: bool) -> int:
    """Main-param elements the optimizer steps on one rank (ETP shards, replicated params)."""
    replicas = {False: recipe.data_parallel_size(world_size) // etp.etp_size,
                True: recipe.expert_data_parallel_size(world_size) // etp.expert_etp_size}
    return sum(-(-numel // max(1, replicas[weight.expert])) if distributed else numel
               for weight, _, numel in _per_rank(recipe, etp))


def gather_transport(etp: ETPConfig, transport: str | None = None) -> str:
    """The gather transport the prediction assumes: ``transport`` when given (etp-train
    passes the one its runtime chose), else ``etp.transport`` with ``auto`` taken as
    ``copy_engine``, which is what ``auto`` picks on NVLink GPUs of one host (the machines
    the recipes are for); on CPU / gloo or across hosts it picks ``nccl``: pass that.

    Example::

        gather_transport(ETPConfig(etp_size=2))             # "copy_engine"
        gather_transport(ETPConfig(etp_size=2), "nccl")     # "nccl"
    """
    name = transport or etp.transport
    if name not in ("auto", "nccl", "copy_engine"):
        raise ValueError(f"transport={name!r}: expected auto, nccl or copy_engine")
    return "copy_engine" if name == "auto" else name


#: Reductions whose wire (and so wgrad buffer) is the 16-bit parameter dtype, fp32 sums at the
#: receiver (``etp.transport.base.SixteenBitWireReduce``); the NCCL one reduces the fp32 main-grad dtype.
SIXTEEN_BIT_WIRE_REDUCTIONS = ("copy_engine_push",)


def reduce_transport(gathers: str) -> str:
    """The reduction the prediction assumes, as ``choose_transports`` pairs it with the gathers:
    "copy_engine_push" with copy-engine gathers, else "nccl".

    Example::

        reduce_transport("copy_engine")   # "copy_engine_push"
    """
    return "copy_engine_push" if gathers == "copy_engine" else "nccl"


def _push_staging_bytes(recipe, etp: ETPConfig) -> int:
    """The push reduce-scatter's symmetric staging: ``SLOTS x (group size - 1)`` 16-bit shards of
    the largest weight each of its shard groups reduces (one transport per group of ranks:
    dense and expert weights share one when their ETP sizes are equal)."""
    from ..transport.push_reduce import CopyEnginePushReduce

    largest: dict[int, int] = {}
    sizes = {False: etp.etp_size, True: etp.expert_etp_size}
    for weight, layout, numel in _per_rank(recipe, etp):
        if layout is not None:
            size = sizes[weight.expert]
            largest[size] = max(largest.get(size, 0), numel * 2)
    return sum(CopyEnginePushReduce.SLOTS * (size - 1) * -(-shard // 256) * 256 for size, shard in largest.items())


def _sharded_param_bytes(recipe, etp: ETPConfig) -> int:
    """Bytes of the ETP shards themselves (the recipe's parameter dtype)."""
    param_bytes = 2 if (recipe.train.bf16 or recipe.train.fp16) else 4
    return sum(numel for _, layout, numel in _per_rank(recipe, etp) if layout is not None) * param_bytes


def _outside_allocator(recipe, etp: ETPConfig, categories: dict[str, int], gathers: str,
                       distributed: bool) -> tuple[int, int]:
    """(bytes in torch symmetric memory, the part of them the categories count) per rank.

    The caching allocator (and so ``torch.cuda.max_memory_allocated``) never sees symmetric
    memory. It holds the copy-engine transport's shard pool: the 16-bit shards themselves,
    which the optimizer then updates in place, or with FP8 gathers the FP8 shards, the 16-bit
    ones staying in the allocator (``ETPRuntime.setup_transports``); and the push reduction's
    staging (its wgrad buffers are ordinary). Under megatron's distributed
    optimizer DDP moves every parameter into its contiguous parameter buffer (an allocator
    tensor) and etp stages the shard into its symmetric home once per pass
    (``ETPRuntime._source``): the 16-bit shards are then in both places.
    """
    if etp.etp_size == 1 and etp.expert_etp_size == 1:
        return 0, 0
    outside = counted = 0
    if gathers == "copy_engine":
        aliased = sum(part for _, part in gather_buffer_bytes(recipe, etp, gathers).values())
        outside += aliased  # aliased tickets' backings, mapped outside the allocator
        counted += aliased
        if etp.gather_dtype.startswith("fp8"):
            outside += categories["fp8_shards"]
            counted += categories["fp8_shards"]
        else:
            shards = _sharded_param_bytes(recipe, etp)
            outside += shards
            counted += 0 if distributed else shards
    reduce = reduce_transport(gathers)
    if reduce == "copy_engine_push":  # plain wgrad buffers; the staging is symmetric
        outside += _push_staging_bytes(recipe, etp)
    return outside, counted


def predict_peak(recipe, world_size: int, etp: ETPConfig | None = None, distributed_optimizer: bool | None = None,
                 micro_batch_size: int | None = None, transport: str | None = None) -> dict:
    """The predicted peak allocated bytes per rank and where it happens. See [Note: predicted peak].

    ``transport``: the gather transport (``gather_transport``): with ``copy_engine`` the shards
    live in symmetric memory, outside the allocator's peak (``outside_allocator``) but on the GPU
    (``device_peak``, what ``fits`` must hold).

    Returns:
        ``{"categories": predict_memory(...), "steady": sum of categories, "loss_transient",
        "optimizer_transient", "forward_backward", "optimizer_step", "peak", "peak_phase",
        "outside_allocator", "device_peak", "gather_transport"}``; ``peak`` and the two phases
        are allocator bytes (comparable with ``torch.cuda.max_memory_allocated``).

    Example::

        predict_peak(recipe, 2, micro_batch_size=8)["peak"] / 2**30
    """
    etp = etp or recipe.etp
    distributed = recipe.parallel.use_distributed_optimizer if distributed_optimizer is None else distributed_optimizer
    categories = predict_memory(recipe, world_size, etp, distributed, micro_batch_size, transport)
    gathers = gather_transport(etp, transport)
    outside, counted = _outside_allocator(recipe, etp, categories, gathers, distributed)
    steady = sum(categories[c] for c in CATEGORIES) - counted
    m = recipe.model
    b = micro_batch_size or recipe.train.micro_batch_size
    vocab = recipe.padded_vocab_size // recipe.parallel.tensor_model_parallel_size
    # megatron-core's vocab_parallel_cross_entropy turns its saved fp32 softmax (counted in
    # the activations) into the fp32 gradient of the logits in place; what backward adds at the
    # loss is the 16-bit copy of that gradient (the backward of the logits' .float()).
    loss_transient = 2 * m.seq_length * b * vocab
    # Fused Adam (megatron_fallbacks: fast, or apex / TE) steps in place; torch's foreach Adam
    # (megatron's stock fallback) holds one fp32 temporary per stepped element.
    optimizer_transient = 0 if recipe.train.megatron_fallbacks == "fast" else 4 * _stepped_elements(recipe, world_size, etp, distributed)
    forward_backward = steady + loss_transient
    optimizer_step = steady - categories["activations"] + optimizer_transient
    peak = max(forward_backward, optimizer_step)
    return {"categories": categories, "steady": steady, "loss_transient": loss_transient,
            "optimizer_transient": optimizer_transient, "forward_backward": forward_backward,
            "optimizer_step": optimizer_step, "peak": peak,
            "peak_phase": "forward_backward" if forward_backward >= optimizer_step else "optimizer_step",
            "outside_allocator": outside, "device_peak": peak + outside,
            "gather_transport": gathers}


def fits(peak_bytes: int, gpu_bytes: int, outside_bytes: int = 0) -> bool:
    """Whether a predicted allocator peak fits a GPU of ``gpu_bytes`` once fragmentation, the
    CUDA context / NCCL / cuBLAS memory (``FRAGMENTATION``, ``RESERVED_OUTSIDE``) and the
    predicted symmetric-memory bytes (``outside_bytes``: ``predict_peak``'s
    ``outside_allocator``) are added."""
    return peak_bytes * FRAGMENTATION + outside_bytes + RESERVED_OUTSIDE <= gpu_bytes


def largest_micro_batch(recipe, world_size: int, gpu_bytes: int, etp: ETPConfig | None = None,
                        distributed_optimizer: bool | None = None,
                        candidates=(1, 2, 4, 8, 16, 32, 64),
                        transport: str | None = None) -> tuple[int | None, list[tuple[int, int]]]:
    """The largest candidate micro-batch whose predicted peak fits, and (micro-batch, allocator
    peak) for every candidate (the symmetric-memory bytes, the same for every micro-batch,
    are counted in the fit)."""
    peaks = [predict_peak(recipe, world_size, etp, distributed_optimizer, b, transport) for b in candidates]
    table = [(b, peak["peak"]) for b, peak in zip(candidates, peaks)]
    good = [b for b, peak in zip(candidates, peaks) if fits(peak["peak"], gpu_bytes, peak["outside_allocator"])]
    return (max(good) if good else None), table


def _wgrad_pool_bytes(shapes_in_forward_order: list[tuple], element_bytes: int = 4) -> int:
    """The pool holds one buffer per padded shape, two where two weights of one shape reduce
    back to back: a weight's buffer returns to the pool when the *next* reduce-scatter is
    issued, after that one took its own buffer. ``element_bytes``: the reduction's wire dtype
    (4: the fp32 main-grad dtype NCCL reduces; 2: a 16-bit wire)."""
    counts: dict[tuple, int] = {}
    previous = None
    for shape in reversed(shapes_in_forward_order):  # the backward (reduce-scatter) order
        counts[shape] = max(counts.get(shape, 1), 2 if shape == previous else 1)
        previous = shape
    return sum(n * rows * cols * element_bytes for (rows, cols), n in counts.items())


def activation_bytes(recipe, micro_batch_size: int | None = None) -> int:
    """Bytes the forward keeps for backward on one rank (first pipeline stage), with the
    recipe's activation recompute.

    Per layer, in bytes per element of ``[s, b, h]`` (16-bit training; x2 for fp32):

    * 18 for everything but the attention probabilities and the routed experts' interior:
      norms' inputs and outputs, q / k / v after rope, the attention context, the projection
      input, the router, residuals (calibrated: with the two terms below it reproduces the
      measured 152 of the flagship recipe, local attention, within 1 %);
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
