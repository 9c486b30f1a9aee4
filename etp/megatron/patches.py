"""Every patch etp makes to megatron-core's internals, in one place, for the megatron-core
versions it supports.

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

Per-optimizer replacements (a megatron-core optimizer, chained or not):

* ``step_with_fused_adamw(optimizer)``: each torch AdamW's ``step`` becomes etp's fused AdamW,
  which also writes the bf16 model weights ([Note: etp AdamW step]).
* ``step_without_host_sync(optimizer)``: ``optimizer.step`` becomes the same step with the
  norm and the clip on the device ([Note: sync-free step]).

Example::

    from etp.megatron import patches
    patches.use_fast_fallbacks(True)            # before building the optimizer
    optimizer = get_megatron_optimizer(config, [ddp_model])
    patches.step_with_fused_adamw(optimizer)
    patches.step_without_host_sync(optimizer)
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import sys
import types

__all__ = ["SUPPORTED_MEGATRON_CORE", "check_megatron_core", "step_with_fused_adamw", "step_without_host_sync",
           "use_fast_fallbacks", "use_fused_rope", "use_te_free_router"]

log = logging.getLogger(__name__)

#: The megatron-core releases these patches were written against and tested on: [lowest, first not).
SUPPORTED_MEGATRON_CORE = ("0.16.1", "0.17")


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

        check_megatron_core("0.19.2")   # ImportError: etp supports megatron-core >=0.16.1,<0.17 ...
    """
    if version is None:
        try:
            version = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            raise ImportError("etp.megatron needs megatron-core: pip install 'megatron-core>=0.16.1,<0.17'") from None
    low, high = SUPPORTED_MEGATRON_CORE
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
