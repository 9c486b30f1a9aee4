"""Memory accounting: predicted per-rank bytes of a recipe with and without ETP.

[Note: ETP memory prediction]
The prediction walks the parameters megatron-core's ``GPTModel`` holds on one rank for the
recipe (TP / EP-local shapes; first pipeline stage; experts either etp's
``ETPGroupedExperts`` or megatron's ``SequentialMLP`` per ``moe_grouped_gemm``) — the same
list ``tests/audit/test_audit.py`` checks against a CPU-built model — instead of building the
model on the meta device: a TP- or EP-sharded megatron model can only be built inside a
process group of its full size, which one CPU process cannot provide
(``etp.audit.inventory``). Each ETP weight then takes the bytes of its padded shard
(``ShardLayout``), and the runtime's buffers follow the runtime's own rules
(``etp.audit.buffers``): one gather buffer per (chain, role, padded shape, parity), one wgrad
pool buffer per padded shape in the reduction's wire dtype (fp32 for NCCL's, the 16-bit
parameter dtype for the push reduce-scatter's; two where weights of one shape reduce back to
back; none for grouped experts on a 16-bit wire, reduced from their GEMM's own output:
``wgrad_in_place``), and, with a quantized gather format (FP8), its copy of every shard; the
gather format (``etp.formats``) says the bytes of each (``gathered_bytes``,
``quantized_copy_bytes``) and whether the GEMMs run in FP8 (``fp8_gemms``).

Categories (bytes per rank): ``params`` (recipe dtype), ``main_grad`` (fp32, megatron-core
mixed precision; bf16 where ``Recipe.main_grad_bytes`` says so), ``optimizer`` (Adam: fp32 master weights + 2 moments for bf16/fp16
training, 2 moments for fp32; divided by the replicate size with the distributed
optimizer), ``gather_fwd`` / ``gather_bwd``, ``wgrad_pool``, ``fp8_shards`` and
``activations`` (what the forward keeps for backward, ``etp.audit.activations``).

Each term is read off the code that allocates it, not fitted to measurements; the terms the
allocator's peak is most sensitive to are the local attention's fp32 *and* 16-bit softmax
probabilities [b, heads, s, s] (megatron upcasts the scores when
``attention_softmax_in_fp32``), the logits the cross-entropy keeps [s, b, V], the optimizer's
temporaries, and the tensors etp's grouped experts keep (neither fc2's output nor a
probability-weighted copy: ``activation_bytes``). Symmetric memory (the copy-engine
transport's shard pool and aliased gather backings, the push reduce-scatter's staging) is
invisible to ``torch.cuda.max_memory_allocated``: it is ``outside_allocator``, counted by
``fits`` but not in ``peak``. The prediction against measured peaks: BENCHMARKS.md, the
memory-audit sections; ``tests/audit/test_audit.py`` keeps it within a tolerance of them.

[Note: predicted peak]
The categories are the bytes alive throughout a step; the allocator's peak adds transients.
``predict_peak`` takes the larger of two phases:

* forward / backward: categories + the backward's transient: the weight gradients reduced
  from their GEMM's own output (``wgrad_in_place``: etp's grouped experts; two neighbours
  alive at once) plus the largest gradient of grouped experts left whole (a fresh 16-bit
  tensor until megatron-core's DDP hook adds it into ``main_grad``), and the larger of the
  two expert GEMMs' backward transients beside them (the
  input rebuilt, the activation gradients and their FP8 copies: ``expert_backward_bytes``) less the logits the loss kept (``logits_bytes``), released by the output
  layer's backward before them; or, if larger, the loss's: etp's cross-entropy writes the
  logits' gradient over the logits (``etp.megatron.cross_entropy``), and an ETP-sharded output
  layer with FP8 gathers quantizes it for its FP8 input-gradient GEMM (2 bytes per logit
  measured at that peak, ``logits_bytes``; nothing with bf16 GEMMs);
* optimizer step (activations freed): categories + the larger of the finalize's and the
  optimizer's temporaries. The finalize all-reduces the replicated parameters' fp32 gradients
  over their ETP group through one flat copy (``etp.collectives.all_reduce_coalesced``). torch's
  foreach Adam materializes ``sqrt(v) + eps`` for the whole list: 4 bytes per local
  main-param element, divided by the replicas under the distributed optimizer. Without ETP
  this phase is the peak of the flagship recipe at small micro-batches under
  ``megatron_fallbacks: stock``. With ``fast`` (the default: torch's fused Adam,
  ``etp.megatron.fast_fallbacks``) the step holds no such temporary.

A captured step (``cuda_graph: step``, ``etp.GraphedStep``) moves the activations out of the
allocator's count: the capture allocates them from the graph's private pool, and once it
closes the pool's blocks are free to the allocator (reserved, not allocated) while every
replay writes them without a malloc. So the forward / backward phase is the capture's, in the
first iteration: before the first optimizer step, when Adam's two fp32 moments (8 bytes per
stepped element; torch makes them at its first step) do not exist yet, but while
``GraphedStep`` holds its copy of every ``main_grad`` (restored after the warm-up passes, kept
through the capture). The optimizer-step phase then holds no activations, and the pool stays
reserved beside it: ``fit_peak`` (what ``fits`` checks) is the larger of the peak and the
optimizer step + the pool (activations + the backward's transient); for an eager step it is
the peak.

``fits`` adds what the prediction leaves out: allocator fragmentation (``FRAGMENTATION``, the
caching allocator's peak reserved over peak allocated, set at what the recipes' audits reach
without ETP, the larger case) is a ratio, and the CUDA context, NCCL and cuBLAS workspaces
outside the allocator (``RESERVED_OUTSIDE``) are a constant.
"""
from __future__ import annotations

from ..config import ETPConfig
from .activations import activation_bytes, expert_backward_bytes, logits_bytes
from .buffers import (
    SIXTEEN_BIT_WIRE_REDUCTIONS,
    gather_buffer_bytes,
    gather_transport,
    outside_allocator_bytes,
    reduce_transport,
    unpooled_wgrad_pair_bytes,
    wgrad_in_place,
    wgrad_pool_bytes,
)
from .categories import CATEGORIES
from .inventory import WeightSpec, weight_inventory, weights_on_rank

__all__ = ["FRAGMENTATION", "RESERVED_OUTSIDE", "WeightSpec", "activation_bytes", "fits", "gather_transport",
           "largest_micro_batch", "predict_memory", "predict_peak", "weight_inventory"]

#: Allocator headroom over the predicted peak when deciding whether a run fits (see [Note: predicted peak]).
FRAGMENTATION = 1.10
#: Bytes per GPU outside the caching allocator (CUDA context, NCCL buffers, cuBLAS workspaces).
RESERVED_OUTSIDE = 2 * 1024**3


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
    fmt = etp.gather_format
    # What-if rows that switch the distributed optimizer on or off keep fp32 buffers unless bf16 is asked for.
    same_optimizer = distributed == recipe.parallel.use_distributed_optimizer
    grad_bytes = recipe.main_grad_bytes(world_size) if same_optimizer else 2 if recipe.parallel.grad_reduce_in_bf16 else 4
    result = dict.fromkeys(CATEGORIES, 0)
    for weight, layout, numel in weights_on_rank(recipe, etp):
        if layout is not None:  # the per-step quantized copy of the shard (FP8 gathers; else 0)
            result["fp8_shards"] += fmt.quantized_copy_bytes(numel, param_bytes)
        result["params"] += numel * param_bytes
        result["main_grad"] += numel * grad_bytes
        divisor = replicas[weight.expert] if distributed else 1
        result["optimizer"] += -(-numel * optimizer_bytes // max(1, divisor))
    gathers = gather_transport(etp, transport)
    for role, (nbytes, _outside) in gather_buffer_bytes(recipe, etp, gathers).items():
        result["gather_" + role] += nbytes
    wire_bytes = _wire_bytes(recipe, gathers)
    result["wgrad_pool"] = wgrad_pool_bytes(_wgrad_order(recipe, etp, wire_bytes)[0], wire_bytes)
    result["activations"] = activation_bytes(recipe, micro_batch_size)
    return result


def _wire_bytes(recipe, gathers: str) -> int:
    """Bytes per element of the reduction's wire: the 16-bit parameter dtype for the push
    reduce-scatter's, else the fp32 main-grad dtype."""
    sixteen_bit = recipe.train.bf16 or recipe.train.fp16
    return 2 if sixteen_bit and reduce_transport(gathers) in SIXTEEN_BIT_WIRE_REDUCTIONS else 4


def _wgrad_order(recipe, etp: ETPConfig, wire_bytes: int) -> tuple[list, list[int]]:
    """The ETP weights in forward order: their padded shapes (None where the gradient is reduced
    from the GEMM's own output, ``wgrad_in_place``) and the bytes of those in-place gradients
    (0 for a pooled one)."""
    shapes, in_place = [], []
    for weight, layout, _numel in weights_on_rank(recipe, etp):
        if layout is None:
            continue
        own = wgrad_in_place(recipe, weight, layout, wire_bytes)
        shapes.append(None if own else layout.padded_shape)
        in_place.append(layout.padded_rows * layout.cols * wire_bytes if own else 0)
    return shapes, in_place


def _unsharded_expert_wgrad_bytes(recipe, etp: ETPConfig) -> int:
    """The largest 16-bit weight gradient of grouped experts that ETP leaves whole: their
    grouped GEMM returns a fresh ``[E, out, in]`` gradient, which megatron-core's DDP hook adds
    into ``main_grad`` and frees before the next one (so one at a time, beside that GEMM's
    backward transients). Sharded experts' gradients are ``wgrad_in_place`` or pooled instead."""
    param_bytes = 2 if (recipe.train.bf16 or recipe.train.fp16) else 4
    return max((numel * param_bytes for weight, layout, numel in weights_on_rank(recipe, etp)
                if layout is None and weight.expert and len(weight.shape) == 3), default=0)


def _finalize_transient(recipe, etp: ETPConfig) -> int:
    """The finalize's flat fp32 copy of the replicated parameters' gradients, all-reduced over
    their ETP group (dense and expert groups one after the other; none of size 1)."""
    sizes = {False: etp.etp_size, True: etp.expert_etp_size}
    flat = {False: 0, True: 0}
    for weight, layout, numel in weights_on_rank(recipe, etp):
        if layout is None and sizes[weight.expert] > 1:
            flat[weight.expert] += numel
    return 4 * max(flat.values())


def _stepped_elements(recipe, world_size: int, etp: ETPConfig, distributed: bool) -> int:
    """Main-param elements the optimizer steps on one rank (ETP shards, replicated params)."""
    replicas = {False: recipe.data_parallel_size(world_size) // etp.etp_size,
                True: recipe.expert_data_parallel_size(world_size) // etp.expert_etp_size}
    return sum(-(-numel // max(1, replicas[weight.expert])) if distributed else numel
               for weight, _, numel in weights_on_rank(recipe, etp))


def predict_peak(recipe, world_size: int, etp: ETPConfig | None = None, distributed_optimizer: bool | None = None,
                 micro_batch_size: int | None = None, transport: str | None = None) -> dict:
    """The predicted peak allocated bytes per rank and where it happens. See [Note: predicted peak].

    ``transport``: the gather transport (``gather_transport``): with ``copy_engine`` the shards
    live in symmetric memory, outside the allocator's peak (``outside_allocator``) but on the GPU
    (``device_peak``, what ``fits`` must hold).

    Returns:
        ``{"categories": predict_memory(...), "steady": sum of categories, "loss_transient",
        "backward_transient", "finalize_transient", "optimizer_transient", "forward_backward",
        "optimizer_step", "graph_pool", "peak", "peak_phase", "fit_peak", "outside_allocator",
        "device_peak", "gather_transport"}``; ``peak`` and the two phases are allocator bytes
        (comparable with ``torch.cuda.max_memory_allocated``); ``peak_phase`` is
        "forward_backward", "capture" (its captured form) or "optimizer_step"; ``fit_peak`` adds
        a captured step's private pool (``graph_pool``), reserved beside the optimizer step.

    Example::

        predict_peak(recipe, 2, micro_batch_size=8)["peak"] / 2**30
    """
    etp = etp or recipe.etp
    distributed = recipe.parallel.use_distributed_optimizer if distributed_optimizer is None else distributed_optimizer
    categories = predict_memory(recipe, world_size, etp, distributed, micro_batch_size, transport)
    gathers = gather_transport(etp, transport)
    outside, counted = outside_allocator_bytes(recipe, etp, categories, gathers, distributed, micro_batch_size)
    steady = sum(categories[c] for c in CATEGORIES) - counted
    activations = categories["activations"]
    b = micro_batch_size or recipe.train.micro_batch_size
    # etp's cross-entropy (etp.megatron.cross_entropy) writes the logits' gradient over the
    # logits it kept (counted in the activations). An ETP-sharded output layer with FP8 gathers
    # then quantizes that gradient for its FP8 input-gradient GEMM: 2 bytes per logit at the
    # peak, the FP8 copy and as much again (calibrated on Qwen3-30B-A3B and the flagship
    # recipe, captured: BENCHMARKS.md, the memory audit); nothing with bf16 GEMMs.
    fp8_output = (etp.gather_format.fp8_gemms and etp.etp_size > 1
                  and recipe.model.untie_embeddings_and_output_weights)
    loss_transient = logits_bytes(recipe, b) if fp8_output else 0
    # In-place weight gradients (grouped experts) come after the output layer's backward has
    # released those logits, beside the larger of their two GEMMs' backward transients.
    in_place = unpooled_wgrad_pair_bytes(_wgrad_order(recipe, etp, _wire_bytes(recipe, gathers))[1])
    fp8_experts = etp.gather_format.fp8_gemms and etp.expert_etp_size > 1 and etp.fp8_wgrad
    experts = (in_place + _unsharded_expert_wgrad_bytes(recipe, etp)
               + expert_backward_bytes(recipe, b, fp8=fp8_experts))
    backward_transient = max(loss_transient, experts - logits_bytes(recipe, b))
    # Fused Adam (megatron_fallbacks: fast, or apex / TE) steps in place; torch's foreach Adam
    # (megatron's stock fallback) holds one fp32 temporary per stepped element.
    stepped = _stepped_elements(recipe, world_size, etp, distributed)
    optimizer_transient = 0 if recipe.train.megatron_fallbacks == "fast" else 4 * stepped
    finalize_transient = _finalize_transient(recipe, etp)
    forward_backward = steady + backward_transient
    optimizer_step = steady - activations + max(optimizer_transient, finalize_transient)
    captured = recipe.train.cuda_graph == "step"
    graph_pool = 0
    if captured:
        # The capture: no Adam moments yet (8 bytes per stepped element), GraphedStep's copy
        # of every main_grad alive; after it the activations sit in the graph's pool.
        forward_backward += categories["main_grad"] - 8 * stepped
        graph_pool = activations + backward_transient
    peak = max(forward_backward, optimizer_step)
    fit_peak = max(peak, optimizer_step + graph_pool)
    phase = ("capture" if captured else "forward_backward") if forward_backward >= optimizer_step else "optimizer_step"
    return {"categories": categories, "steady": steady, "loss_transient": loss_transient,
            "backward_transient": backward_transient, "finalize_transient": finalize_transient,
            "optimizer_transient": optimizer_transient, "forward_backward": forward_backward,
            "optimizer_step": optimizer_step, "graph_pool": graph_pool, "peak": peak, "peak_phase": phase,
            "fit_peak": fit_peak, "outside_allocator": outside, "device_peak": fit_peak + outside,
            "gather_transport": gathers}


def fits(peak: dict, gpu_bytes: int) -> bool:
    """Whether a prediction of ``predict_peak`` fits a GPU of ``gpu_bytes``: its ``fit_peak`` (a
    captured step's graph pool included) once fragmentation (``FRAGMENTATION``), the CUDA
    context / NCCL / cuBLAS memory (``RESERVED_OUTSIDE``) and its symmetric-memory bytes
    (``outside_allocator``) are added.

    Example::

        fits(predict_peak(recipe, 2), 80 * 2**30)
    """
    return fit_bytes(peak) <= gpu_bytes


def fit_bytes(peak: dict) -> float:
    """The GPU bytes ``fits`` asks of a prediction of ``predict_peak``: its ``fit_peak`` with
    fragmentation, the memory outside the allocator and its symmetric-memory bytes."""
    return peak["fit_peak"] * FRAGMENTATION + peak["outside_allocator"] + RESERVED_OUTSIDE


def largest_micro_batch(recipe, world_size: int, gpu_bytes: int, etp: ETPConfig | None = None,
                        distributed_optimizer: bool | None = None,
                        candidates=(1, 2, 4, 8, 16, 32, 64),
                        transport: str | None = None) -> tuple[int | None, list[tuple[int, int, bool]]]:
    """The largest candidate micro-batch whose predicted peak fits, and (micro-batch, allocator
    peak, fits) for every candidate (the symmetric-memory bytes, the same for every
    micro-batch, and a captured step's graph pool are counted in the fit: ``fit_peak``).

    Example::

        best, table = largest_micro_batch(recipe, 2, 80 * 2**30)
    """
    peaks = [predict_peak(recipe, world_size, etp, distributed_optimizer, b, transport) for b in candidates]
    table = [(b, peak["peak"], fits(peak, gpu_bytes))
             for b, peak in zip(candidates, peaks)]
    good = [b for b, _peak, ok in table if ok]
    return (max(good) if good else None), table
