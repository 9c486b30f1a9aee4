"""Every patch etp makes to megatron-core's internals, in one place, for the megatron-core
versions it supports: ``>=0.16.1,<0.20``, tested on 0.16.1 and 0.19.2 (Python 3.12; 0.17 and
later need it).

etp plugs into megatron-core mostly by composition (layer specs, its own experts and token
dispatchers, DDP / optimizer builders). Where that is not enough, it rebinds a name inside
megatron-core or replaces a method of one of its objects. Those rebindings live here and
nowhere else, because each one depends on megatron-core's internals staying as they are in
the versions below: importing this module (``import etp.megatron`` does) checks the installed
version and refuses any other with one line.

Process-wide rebindings (idempotent, each with its way back):

* ``use_te_free_router()``: ``moe_utils.te_general_gemm = None`` where TransformerEngine is
  absent (megatron-core tests the name unconditionally in the router).
* ``use_fast_fallbacks(on)``: ``l2_norm_impl`` / ``multi_tensor_scale_impl`` in megatron-core's
  optimizer modules, bound to :mod:`etp.megatron.fast_fallbacks` ([Note: megatron fallbacks]).
* ``use_fused_rope(on)``: ``apply_rotary_pos_emb`` in megatron-core's attention, bound to
  :func:`etp.megatron.rope.fused_apply_rotary_pos_emb` ([Note: RoPE in megatron-core]).
* ``use_cpu_megatron_core(on)``: the few megatron-core methods that place tensors on the current
  CUDA device, make CUDA streams or save CUDA RNG states, run on CPU ([Note: megatron-core on CPU]).

Per-run settings of megatron-core's state:

* ``time_out_megatron_groups(timeout)``: after ``parallel_state.initialize_model_parallel``, every
  group it made waits ``timeout`` (megatron-core's expert-data-parallel gloo group is created
  without the ``distributed_timeout_minutes`` it was given; [Note: group timeouts] in etp/groups.py).

Per-optimizer replacements (a megatron-core optimizer, chained or not):

* ``step_with_fused_adamw(optimizer)``: each torch AdamW's ``step`` becomes etp's fused AdamW,
  which also writes the bf16 model weights ([Note: etp AdamW step]).
* ``step_without_host_sync(optimizer)``: ``optimizer.step`` becomes the same step with the
  norm and the clip on the device ([Note: sync-free step]).

What the supported versions name or build differently (not patches: etp reads it) is read
through one helper each in :mod:`etp.megatron.compat`.

Example::

    from etp.megatron import patches
    patches.use_fast_fallbacks(True)            # before building the optimizer
    optimizer = get_megatron_optimizer(config, [ddp_model])
    patches.step_with_fused_adamw(optimizer)
    patches.step_without_host_sync(optimizer)
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import logging
import sys
import types

__all__ = ["SUPPORTED_MEGATRON_CORE", "check_megatron_core", "read_bf16_grads_in_place", "step_with_fused_adamw",
           "step_without_host_sync",
           "time_out_megatron_groups", "use_cpu_megatron_core", "use_fast_fallbacks", "use_fused_rope",
           "use_te_free_router"]

log = logging.getLogger(__name__)

#: The megatron-core releases these patches support: [lowest, first not). Tested on 0.16.1 and 0.19.2.
SUPPORTED_MEGATRON_CORE = ("0.16.1", "0.20")


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_megatron_core(version: str | None = None) -> str:
    """The installed megatron-core version, if these patches support it; ImportError otherwise.

    Example::

        check_megatron_core("0.19.2")   # "0.19.2"
        check_megatron_core("0.20.0")   # ImportError: etp supports megatron-core >=0.16.1,<0.20, found 0.20.0 ...
    """
    low, high = SUPPORTED_MEGATRON_CORE
    if version is None:
        try:
            version = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"etp.megatron needs megatron-core: pip install 'megatron-core>={low},<{high}'") from None
    if not _release(low) <= _release(version) < _release(high):
        raise ImportError(f"etp supports megatron-core >={low},<{high}, found {version}: "
                          f"pip install 'megatron-core>={low},<{high}'")
    return version


check_megatron_core()









def use_te_free_router() -> None:
    """megatron-core's MoE utilities import ``te_general_gemm`` only when TransformerEngine is
    installed but the router tests the name unconditionally (a NameError without TE); defining
    it as None, only where it is missing, restores the TE-free path. Idempotent."""
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is None:
        import megatron.core.transformer.moe.moe_utils as moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_FALLBACK_MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")


def _fallback_bindings() -> dict[str, tuple]:
    """Module attribute -> (megatron-core's local fallback, etp's replacement)."""
    from megatron.core import utils

    from etp.megatron.fast_fallbacks import foreach_l2_norm, foreach_scale

    return {"l2_norm_impl": (utils.local_multi_tensor_l2_norm, foreach_l2_norm),
            "multi_tensor_scale_impl": (utils.local_multi_tensor_scale, foreach_scale)}


def use_fast_fallbacks(on: bool) -> bool:
    """Binds etp's ``foreach_l2_norm`` / ``foreach_scale`` where megatron-core bound its local
    fallbacks (``on``), or puts megatron-core's back. Nothing changes where apex or
    TransformerEngine supplied the helpers. Returns whether any binding changed."""
    swapped = False
    for name in _FALLBACK_MODULES:
        module = importlib.import_module(name)
        for attr, (fallback, ours) in _fallback_bindings().items():
            old, new = (fallback, ours) if on else (ours, fallback)
            if getattr(module, attr, None) is old:
                setattr(module, attr, new)
                swapped = True
    return swapped


_ATTENTION = "megatron.core.transformer.attention"


def use_fused_rope(on: bool) -> bool:
    """Binds etp's fused RoPE in megatron-core's attention (``on``), or megatron-core's own.
    Returns whether the binding changed."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from etp.megatron.rope import fused_apply_rotary_pos_emb

    module = importlib.import_module(_ATTENTION)
    wanted = fused_apply_rotary_pos_emb if on else apply_rotary_pos_emb
    if module.apply_rotary_pos_emb is wanted:
        return False
    module.apply_rotary_pos_emb = wanted
    return True


# [Note: megatron-core on CPU]
# megatron-core's GPTModel (etp's layer spec) trains on CPU ranks (gloo) but for a few places
# written for the GPU, each of which would raise on a CPU-only torch (or, on a GPU host running a
# gloo job, move a CPU model's tensor to the GPU):
#
# * Tensors placed on ``torch.cuda.current_device()``: the router moves its weight there at every
#   forward and makes its expert-bias / global-aux-loss buffers there; the rotary embedding moves
#   its frequencies there at its first forward; local attention's score buffer is allocated there,
#   and so are the outputs of the tensor- and expert-parallel collectives. Those methods run
#   unchanged with ``torch.cuda.current_device`` answering the CPU while they run
#   (``_CPU_DEVICE_METHODS``), unless their first tensor argument is on a GPU.
# * Local attention's default causal mask is made with ``device="cuda"`` written out: bound to the
#   same mask made on the CPU.
# * Named CUDA RNG streams: without CUDA nothing adds any (``model_parallel_cuda_manual_seed``
#   needs CUDA), so forking an unknown one is a no-op and dropout draws from torch's CPU
#   generator, as etp's SDPA attention does on CPU; recompute saves and restores that generator
#   itself, and the CUDA generator's state it also saves is none until CUDA is initialized.
# * The alltoall dispatcher's device-to-host stream and copies: on CPU its split sizes and counts
#   are host tensors already, so there is nothing to copy and nothing to wait for.
#
# Nothing else changes: the modules, their parameters, their arithmetic and the dispatchers'
# collectives are megatron-core's own, which is what lets the CPU suite prove parity for the model
# GPUs train. etp-train turns it on for a CPU run and off for a GPU one (``build_model`` in
# ``etp.train.model_build``); a process that trains on GPUs after CPU work turns it off.

_MAPPINGS = "megatron.core.tensor_parallel.mappings"
#: (module, class or None for the module's own function, name) placing tensors on the current CUDA
#: device, reached by a CPU run: run with it answering the CPU
_CPU_DEVICE_METHODS = (
    ("megatron.core.transformer.moe.router", "Router", "gating"),
    ("megatron.core.transformer.moe.router", "TopKRouter", "__init__"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding", "get_emb"),
    ("megatron.core.utils", "GlobalMemoryBuffer", "get_tensor"),
    # the collectives' output buffers (expert parallelism, tensor parallelism's gathers)
    (_MAPPINGS, None, "_gather_along_last_dim"),
    (_MAPPINGS, None, "_gather_along_first_dim"),
    (_MAPPINGS, None, "_reduce_scatter_along_first_dim"),
    (_MAPPINGS, "_AllToAll", "forward"),
)
_RANDOM = "megatron.core.tensor_parallel.random"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_SOFTMAX = "megatron.core.fusions.fused_softmax"


def _cpu_device():
    import torch

    return torch.device("cpu")


@contextlib.contextmanager
def _current_device_is_cpu():
    """``torch.cuda.current_device()`` answers the CPU inside (nested uses restore in order)."""
    import torch

    saved = torch.cuda.current_device
    torch.cuda.current_device = _cpu_device
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def _on_cpu(method):
    """``method`` with the current device answering the CPU, unless its first tensor argument is
    on a GPU (then megatron-core's placement is the right one)."""
    import torch

    @functools.wraps(method)  # __wrapped__: megatron-core's own
    def on_cpu(*args, **kwargs):
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if tensor is not None and tensor.device.type != "cpu":
            return method(*args, **kwargs)
        with _current_device_is_cpu():
            return method(*args, **kwargs)

    return on_cpu


def _causal_mask_on_cpu(sq: int):
    """megatron-core's ``get_default_causal_mask`` (True above the diagonal), on the CPU."""
    import torch

    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cuda_rng_state_if_any(get_state):
    """megatron-core's ``_get_cuda_rng_state``, or None before CUDA is initialized (a CPU run:
    there is no CUDA generator to save; recompute saves the CPU generator itself)."""
    import torch

    @functools.wraps(get_state)
    def cuda_rng_state(*args, **kwargs):
        return get_state(*args, **kwargs) if torch.cuda.is_initialized() else None

    return cuda_rng_state


def _cuda_rng_restore_if_any(set_state):
    """megatron-core's ``_set_cuda_rng_state``, nothing for the None a CPU run saved."""

    @functools.wraps(set_state)
    def restore_cuda_rng_state(new_state, *args, **kwargs):
        if new_state is not None:
            set_state(new_state, *args, **kwargs)

    return restore_cuda_rng_state


def _fork_if_tracked(fork):
    """megatron-core's ``CudaRNGStatesTracker.fork`` for a named state it holds; a no-op for one
    nothing added (on CPU: none), so dropout draws from torch's CPU generator there."""
    name_default = importlib.import_module(_RANDOM)._MODEL_PARALLEL_RNG_TRACKER_NAME

    @functools.wraps(fork)
    def fork_if_tracked(self, name=name_default):
        return fork(self, name) if name in self.states_ else contextlib.nullcontext()

    return fork_if_tracked


def _host_counts(self, point, tokens_per_expert=None):
    """The alltoall dispatcher's device-to-host step on CPU: its counts are host tensors already
    (nothing to copy, nothing to wait for); the split sizes become numpy arrays, as megatron-core's
    copies make them (its collectives take sequences of ints, not tensors)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            splits = getattr(self, name)
            if hasattr(splits, "numpy"):
                setattr(self, name, splits.numpy())
    return tokens_per_expert


#: the alltoall dispatcher's device-to-host stream on CPU: none (its class attribute, set once)
_NO_STREAM = "etp: no CUDA stream on CPU"


def _cpu_bindings() -> list[tuple[object, str, object]]:
    """(owner, attribute, etp's CPU binding) of every binding of [Note: megatron-core on CPU]."""
    bindings = []
    for module_name, class_name, name in _CPU_DEVICE_METHODS:
        module = importlib.import_module(module_name)
        owner = module if class_name is None else getattr(module, class_name)
        original = owner.__dict__[name]
        if isinstance(original, staticmethod):  # an autograd Function's forward
            bindings.append((owner, name, staticmethod(_on_cpu(original.__func__))))
        else:
            bindings.append((owner, name, _on_cpu(original)))
    random, dispatcher = importlib.import_module(_RANDOM), importlib.import_module(_DISPATCHER)
    tracker = random.CudaRNGStatesTracker
    bindings += [(importlib.import_module(_SOFTMAX), "get_default_causal_mask", _causal_mask_on_cpu),
                 (random, "_get_cuda_rng_state", _cuda_rng_state_if_any(random._get_cuda_rng_state)),
                 (random, "_set_cuda_rng_state", _cuda_rng_restore_if_any(random._set_cuda_rng_state)),
                 (tracker, "fork", _fork_if_tracked(tracker.__dict__["fork"])),
                 (dispatcher.MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize", _host_counts)]
    return bindings


#: (owner, attribute) -> megatron-core's own, kept while etp's CPU binding is in place
_CPU_ORIGINALS: dict[tuple[object, str], object] = {}


def use_cpu_megatron_core(on: bool) -> bool:
    """Lets megatron-core's GPTModel run on CPU ranks ([Note: megatron-core on CPU]) (``on``), or
    puts megatron-core's CUDA-only code back. Idempotent; returns whether any binding changed.

    Example::

        patches.use_cpu_megatron_core(True)   # before building a GPTModel on CPU
    """
    if on == bool(_CPU_ORIGINALS):
        return False
    dispatcher = importlib.import_module(_DISPATCHER).MoEAlltoAllTokenDispatcher
    if on:
        for owner, name, ours in _cpu_bindings():
            _CPU_ORIGINALS[(owner, name)] = owner.__dict__[name]
            setattr(owner, name, ours)
        if dispatcher.cuda_dtoh_stream is None:  # the constructor makes one only while it is None
            dispatcher.cuda_dtoh_stream = _NO_STREAM
        use_te_free_router()
        return True
    for (owner, name), original in _CPU_ORIGINALS.items():
        setattr(owner, name, original)
    _CPU_ORIGINALS.clear()
    if dispatcher.cuda_dtoh_stream is _NO_STREAM:
        dispatcher.cuda_dtoh_stream = None
    return True


def time_out_megatron_groups(timeout) -> int:
    """Sets ``timeout`` (a ``datetime.timedelta``) on every process group of this rank that
    ``parallel_state.initialize_model_parallel`` made (its list of them; the world group is
    left as it was created). megatron-core 0.16 passes its ``distributed_timeout_minutes`` to
    every group but the expert-data-parallel gloo one, which would wait torch's gloo default
    (30 minutes) for a stalled peer. Local (no collective); returns how many groups it set.

    Example::

        parallel_state.initialize_model_parallel(distributed_timeout_minutes=0.5)
        patches.time_out_megatron_groups(datetime.timedelta(minutes=0.5))
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    groups = [g for g in parallel_state._global_process_group_list or () if g is not None]  # None: the world
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    return len(groups)


def step_with_fused_adamw(optimizer) -> int:
    """Steps every torch Adam / AdamW inside ``optimizer`` with etp's fused AdamW ([Note: etp
    AdamW step]). Returns how many links it took; logs once per link it left to torch, and why."""
    from etp.megatron import fused_adamw
    from etp.megatron.fast_fallbacks import inner_optimizers

    taken = 0
    for link in inner_optimizers(optimizer):
        adam = getattr(link, "optimizer", None)
        if adam is None or getattr(link, "is_stub_optimizer", False):
            continue
        reason = fused_adamw.unsupported_reason(adam)
        if reason is not None:
            log.warning("etp: torch's AdamW kept for one optimizer link: %s", reason)
            continue
        weights = fused_adamw.model_weights(link)
        adam.step = types.MethodType(functools.partial(fused_adamw.step, weights=weights, link=link), adam)
        adam.etp_fused_step = True  # honours grad_scale: see sync_free_optimizer._fused_torch_adam
        if weights:
            link._copy_main_params_to_model_params = fused_adamw.copy_unless_written(
                link, link._copy_main_params_to_model_params)
        taken += 1
    return taken


def read_bf16_grads_in_place(optimizer) -> int:
    """Lets etp's AdamW read bf16 gradient buffers in place instead of megatron's fp32 copies of
    them ([Note: bf16 gradients, read in place]), on every link that etp's AdamW steps, that
    writes bf16 model weights and whose gradient statistics stay on this rank. Call it after
    ``step_with_fused_adamw`` and a successful ``step_without_host_sync`` (whose norm reads the
    gradients where this puts them). Returns how many links it took."""
    from etp.megatron import fused_adamw
    from etp.megatron.fast_fallbacks import inner_optimizers

    taken = 0
    for link in inner_optimizers(optimizer):
        adam = getattr(link, "optimizer", None)
        if not getattr(adam, "etp_fused_step", False) or not fused_adamw.model_weights(link):
            continue
        if link.get_grad_stats_parallel_group().size() != 1:
            continue  # megatron's norm also drops tensor-parallel duplicates there: its copy stays
        link._copy_model_grads_to_main_grads = fused_adamw.read_grads_in_place(
            link, link._copy_model_grads_to_main_grads)
        taken += 1
    return taken


def step_without_host_sync(optimizer) -> bool:
    """Replaces ``optimizer.step`` with :func:`etp.megatron.sync_free_optimizer.step` ([Note:
    sync-free step]). Returns whether it did; logs once why not."""
    from etp.megatron import sync_free_optimizer

    reason = sync_free_optimizer.unsupported_reason(optimizer)
    if reason is not None:
        log.warning("etp: megatron-core's own optimizer step kept (a host sync per step): %s", reason)
        return False
    optimizer.step = functools.partial(sync_free_optimizer.step, optimizer)
    return True
