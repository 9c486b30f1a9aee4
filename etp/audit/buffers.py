"""The runtime's own buffers on one rank, as the memory prediction counts them: the weight
cache's gather buffers, the wgrad pool, and the symmetric memory outside torch's allocator
(the copy-engine transport's shard pool and aliased gather backings, the push reduce-scatter's
staging); and the transports the prediction assumes. See [Note: ETP memory prediction] in
``etp/audit/predict.py``."""
from __future__ import annotations

from ..config import ETPConfig
from .ep_buffers import ep_dispatcher_bytes
from .inventory import weights_on_rank

__all__ = ["MAPPING_GRANULARITY", "SIXTEEN_BIT_WIRE_REDUCTIONS", "gather_buffer_bytes", "gather_transport",
           "outside_allocator_bytes", "push_staging_bytes", "reduce_transport", "unpooled_wgrad_pair_bytes",
           "wgrad_in_place", "wgrad_pool_bytes"]


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
    param_bytes, fmt = 2 if (t.bf16 or t.fp16) else 4, etp.gather_format
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
    for weight, layout, _numel in weights_on_rank(recipe, etp):
        if layout is None:
            continue
        position = positions.get(weight.chain, 0)
        positions[weight.chain] = position + 1
        size = layout.padded_rows // layout.shard_rows
        full = fmt.gathered_bytes(layout.padded_rows, layout.cols, param_bytes)  # packed formats: by bits
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


def wgrad_pool_bytes(shapes_in_forward_order: list[tuple | None], element_bytes: int = 4) -> int:
    """The pool holds one buffer per padded shape, two where two weights of one shape reduce
    back to back: a weight's buffer returns to the pool when the *next* reduce-scatter is
    issued, after that one took its own buffer. ``element_bytes``: the reduction's wire dtype
    (4: the fp32 main-grad dtype NCCL reduces; 2: a 16-bit wire). A None entry is a weight
    reduced from its GEMM's own output (``wgrad_in_place``): it takes no pool buffer, but its
    reduce-scatter still releases the buffer before it, so it separates its neighbours."""
    counts: dict[tuple, int] = {}
    previous = None
    for shape in reversed(shapes_in_forward_order):  # the backward (reduce-scatter) order
        if shape is not None:
            counts[shape] = max(counts.get(shape, 1), 2 if shape == previous else 1)
        previous = shape
    return sum(n * rows * cols * element_bytes for (rows, cols), n in counts.items())


def wgrad_in_place(recipe, weight, layout, wire_bytes: int) -> bool:
    """Whether the reduce-scatter takes the weight GEMM's own output rather than a pool buffer
    (``etp.autograd``: ``op.writes_into`` is false, and ``ReduceSide.reduce_grad`` reduces the
    output as it is when it needs no padding and has the wire dtype). That is etp's grouped
    experts on sm90+ in bf16, whose ``torch._grouped_mm`` (or the FP8 grouped GEMM) returns a
    fresh ``[E, out, in]`` gradient (``GroupedGemm.writes_into``), with a 16-bit wire (the push
    reduction's; NCCL's fp32 wire copies it into a pool buffer). The prediction assumes the
    sm90+ GPUs the recipes are for, as ``gather_transport`` assumes their NVLink.

    Example::

        wgrad_in_place(recipe, weight, layout, 2)   # True for grouped experts on a 16-bit wire
    """
    if layout is None or len(weight.shape) != 3 or not recipe.train.bf16 or wire_bytes != 2:
        return False
    _experts, out_features, in_features = weight.shape
    return out_features % 8 == 0 and in_features % 8 == 0 and layout.rows == layout.padded_rows


def unpooled_wgrad_pair_bytes(sizes_in_forward_order: list[int]) -> int:
    """The most bytes of in-place weight gradients (``wgrad_in_place``; 0 for a pooled weight)
    alive at once in a backward: a gradient lives until the next reduce-scatter is issued, so
    two neighbours in the backward order at most (a layer's fc2 and fc1)."""
    pairs = zip(sizes_in_forward_order, sizes_in_forward_order[1:])
    return max((a + b for a, b in pairs), default=sum(sizes_in_forward_order))


def push_staging_bytes(recipe, etp: ETPConfig) -> int:
    """The push reduce-scatter's symmetric staging: ``SLOTS x (group size - 1)`` 16-bit shards of
    the largest weight each of its shard groups reduces (one transport per group of ranks:
    dense and expert weights share one when their ETP sizes are equal)."""
    from ..transport.push_reduce import CopyEnginePushReduce

    largest: dict[int, int] = {}
    sizes = {False: etp.etp_size, True: etp.expert_etp_size}
    for weight, layout, numel in weights_on_rank(recipe, etp):
        if layout is not None:
            size = sizes[weight.expert]
            largest[size] = max(largest.get(size, 0), numel * 2)
    return sum(CopyEnginePushReduce.SLOTS * (size - 1) * -(-shard // 256) * 256 for size, shard in largest.items())


def _sharded_param_bytes(recipe, etp: ETPConfig) -> int:
    """Bytes of the ETP shards themselves (the recipe's parameter dtype)."""
    param_bytes = 2 if (recipe.train.bf16 or recipe.train.fp16) else 4
    return sum(numel for _, layout, numel in weights_on_rank(recipe, etp) if layout is not None) * param_bytes


def outside_allocator_bytes(recipe, etp: ETPConfig, categories: dict[str, int], gathers: str,
                       distributed: bool, micro_batch_size: int | None = None) -> tuple[int, int]:
    """(bytes in torch symmetric memory, the part of them the categories count) per rank.

    The caching allocator (and so ``torch.cuda.max_memory_allocated``) never sees symmetric
    memory. It holds the copy-engine transport's shard pool: the 16-bit shards themselves,
    which the optimizer then updates in place, or with a quantized gather format (FP8) the
    quantized shards, the 16-bit
    ones staying in the allocator (``ETPRuntime.setup_transports``); and the push reduction's
    staging (its wgrad buffers are ordinary); with or without ETP, etp.ep's receive buffers
    (``ep_dispatcher_bytes``, counted in no category). Under megatron's distributed
    optimizer DDP moves every parameter into its contiguous parameter buffer (an allocator
    tensor) and etp stages the shard into its symmetric home once per pass
    (``ETPRuntime._source``): the 16-bit shards are then in both places.
    """
    outside, counted = ep_dispatcher_bytes(recipe, micro_batch_size), 0
    if etp.etp_size == 1 and etp.expert_etp_size == 1:
        return outside, counted
    if gathers == "copy_engine":
        aliased = sum(part for _, part in gather_buffer_bytes(recipe, etp, gathers).values())
        outside += aliased  # aliased tickets' backings, mapped outside the allocator
        counted += aliased
        if etp.gather_format.quantized:
            outside += categories["fp8_shards"]
            counted += categories["fp8_shards"]
        else:
            shards = _sharded_param_bytes(recipe, etp)
            outside += shards
            counted += 0 if distributed else shards
    reduce = reduce_transport(gathers)
    if reduce == "copy_engine_push":  # plain wgrad buffers; the staging is symmetric
        outside += push_staging_bytes(recipe, etp)
    return outside, counted
