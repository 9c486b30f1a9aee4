"""wrap_module_params_etp: shard the large weights of an already-built model.

Wrapped module types and what is sharded:

=========================================  =====================  ==========================
module                                     sharded                plug point
=========================================  =====================  ==========================
``torch.nn.Linear`` (exact type)           ``weight``             instance ``forward``
``etp.GroupedSwiGLUExperts``               ``fc1/fc2_weight``     dispatch on param type
megatron ``ColumnParallelLinear``          ``weight`` (TP-local)  instance ``_forward_impl``
megatron ``RowParallelLinear``             ``weight`` (TP-local)  instance ``_forward_impl``
=========================================  =====================  ==========================

Integrations add their layer types with ``register_layer_types`` (``etp.megatron`` adds
megatron-core's TP linears when it is imported); this module imports none of them. A
megatron-core TP linear met while ``etp.megatron`` was never imported is an error, not a layer
silently left replicated.

Biases, norms, routers and embeddings stay replicated; ``etp.finalize_grads`` completes their
gradients over the ETP group. Expert weights (``is_expert`` or ``allreduce == False``, the
megatron-core flags) shard over the expert group, all others over the dense group.
Only the exact ``nn.Linear`` type is wrapped: subclasses such as MultiheadAttention's
``out_proj`` are read directly by their parents, which a sharded weight would break.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .autograd import etp_linear
from .config import ETPConfig
from .groups import ETPGroups, ShardGroup, build_etp_groups
from .layout import ShardLayout
from .modules import GroupedSwiGLUExperts
from .param import ETPShardedParam
from .runtime import ETPRuntime

__all__ = ["WrapSummary", "wrap_module_params_etp", "is_expert_param", "prefetch_after_step",
           "register_layer_types", "runtime_of", "shard_parameter"]

_WRAPPED_MARKER = "_etp_wrapped"


@dataclass
class WrapSummary:
    """What ``wrap_module_params_etp`` did.

    ``bytes_before`` / ``bytes_after`` count every parameter of the model held by this rank
    (padding of shards included in ``bytes_after``: it is allocated).
    """

    wrapped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    #: expert weights left replicated because ``expert_etp_size`` is 1 while dense weights shard
    replicated_experts: list[str] = field(default_factory=list)

    @property
    def params_wrapped(self) -> int:
        return len(self.wrapped)

    def __str__(self) -> str:
        gib = 1024**3
        text = (
            f"etp: wrapped {self.params_wrapped} weights; parameter bytes per rank "
            f"{self.bytes_before / gib:.3f} GiB -> {self.bytes_after / gib:.3f} GiB"
        )
        if self.replicated_experts:
            text += (f"; {len(self.replicated_experts)} expert weights stay replicated (expert_etp_size=1: "
                     "set it to shard them too)")
        return text


def is_expert_param(param: torch.Tensor) -> bool:
    """True for routed-expert weights (megatron-core marks them ``allreduce=False``)."""
    return bool(getattr(param, "is_expert", False)) or getattr(param, "allreduce", True) is False


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _linear_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return etp_linear(input, module.weight, module.bias)


def _install_linear_forward(module: nn.Linear) -> None:
    module.forward = functools.partial(_linear_forward, module)


@dataclass(frozen=True)
class _LayerTypes:
    types: Callable[[], tuple[type, ...]]  # resolved at wrap time (an integration imports lazily)
    weights: tuple[str, ...]
    install: Callable[[nn.Module], None] | None  # installs the ETP forward on an instance


_LAYER_TYPES: list[_LayerTypes] = [_LayerTypes(lambda: (GroupedSwiGLUExperts,), ("fc1_weight", "fc2_weight"), None)]
# Layers of integrations that shard them only once imported (module prefix, class names, what to import).
_NEEDS_INTEGRATION = (("megatron.core.", ("ColumnParallelLinear", "RowParallelLinear"), "etp.megatron"),)


def register_layer_types(types: Callable[[], tuple[type, ...]], weights: tuple[str, ...],
                         install: Callable[[nn.Module], None] | None) -> None:
    """Makes ``wrap_module_params_etp`` shard the ``weights`` of instances of ``types()`` and
    call ``install(module)`` on each (it points the module's GEMM at ETP's). ``types`` is
    called at wrap time, so an integration need not import its framework before a model of it
    exists. Registering the same ``types`` callable twice changes nothing.

    Example::

        register_layer_types(lambda: (MyLinear,), ("weight",), lambda m: setattr(m, "forward", ...))
    """
    if not any(entry.types is types for entry in _LAYER_TYPES):
        _LAYER_TYPES.append(_LayerTypes(types, tuple(weights), install))


def _targets(model: nn.Module) -> list[tuple[str, nn.Module, list[str], Callable[[nn.Module], None] | None]]:
    """(module name, module, weight attribute names, installer of the ETP forward)."""
    registered = [(entry.types(), entry) for entry in _LAYER_TYPES]
    found = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            found.append((name, module, ["weight"], _install_linear_forward))
            continue
        entry = next((e for types, e in registered if types and isinstance(module, types)), None)
        if entry is not None:
            weights = [w for w in entry.weights if getattr(module, w, None) is not None]
            if weights:
                found.append((name, module, weights, entry.install))
            continue
        for prefix, class_names, integration in _NEEDS_INTEGRATION:
            if type(module).__module__.startswith(prefix) and type(module).__name__ in class_names:
                raise ValueError(
                    f"module '{name}' is a {type(module).__name__}, which etp shards through {integration}: "
                    f"import {integration} before wrapping (or use etp.megatron.model.apply_etp)"
                )
    return found


def _runtime_of(model: nn.Module) -> ETPRuntime | None:
    for param in model.parameters():
        if isinstance(param, ETPShardedParam):
            return param.etp_runtime
    return None


def runtime_of(model: nn.Module) -> ETPRuntime:
    """The ``ETPRuntime`` of a wrapped model (its stats, buffers, ``reset()``).

    Raises:
        ValueError: the model holds no ETP weights.

    Example::

        print(runtime_of(model).stats, runtime_of(model).nbytes())
    """
    runtime = _runtime_of(model)
    if runtime is None:
        raise ValueError("the model holds no ETP weights: wrap it with wrap_module_params_etp first")
    return runtime


def wrap_module_params_etp(
    model: nn.Module,
    config: ETPConfig,
    groups: ETPGroups | None = None,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
) -> WrapSummary:
    """Replaces the large weights of ``model`` by ETP shards, in place.

    Every rank of the ETP groups must call it with the same model (same full weights):
    each keeps its own rows. Calling it again on a wrapped model changes nothing
    (idempotent). With both group sizes 1 the model is left untouched, byte for byte.

    Args:
        model: a built model (plain torch, megatron-core, or etp modules).
        config: the ETP settings (padding, reduction, gather dtype).
        groups: from ``build_etp_groups`` or ``ETPGroups.from_process_groups``; None builds
            the default groups of ``config`` over the world (``build_etp_groups(config)``).
            megatron-core models should use ``etp.megatron.apply_etp``, whose default groups
            follow megatron's parallel state.
        filter_fn: optional ``(module_name, module) -> bool``; False keeps a module replicated.

    Returns:
        a ``WrapSummary`` (weights wrapped, parameter bytes per rank before / after).

    Raises:
        ValueError: a weight is shared with a module etp does not wrap (it would read the
            shard as if it were the full weight), or is already sharded by other means.

    Example::

        summary = wrap_module_params_etp(model, ETPConfig(etp_size=4))  # default groups
        print(summary)   # etp: wrapped 24 weights; parameter bytes per rank ...
    """
    summary = WrapSummary(bytes_before=_param_bytes(model))
    if groups is None:
        if config.etp_size == 1 and config.expert_etp_size == 1:
            summary.bytes_after = summary.bytes_before  # ETP off: no process group needed
            return summary
        groups = build_etp_groups(config)
    elif not isinstance(groups, ETPGroups):
        raise TypeError(
            f"groups must be an ETPGroups (from build_etp_groups) or None, got {type(groups).__name__}"
        )
    if groups.dense.size == 1 and groups.expert.size == 1:
        summary.bytes_after = summary.bytes_before
        return summary

    targets = [
        t for t in _targets(model)
        if not getattr(t[1], _WRAPPED_MARKER, False) and (filter_fn is None or filter_fn(t[0], t[1]))
    ]
    _refuse_shared_weights(model, targets)
    if config.debug_checks:
        check_replicas_agree(model, groups)
    runtime = _runtime_of(model) or ETPRuntime(config)
    runtime.groups = groups
    _shard_targets(targets, groups, config, runtime, summary)
    # Transports are chosen once, now: on CUDA this may rendezvous symmetric memory and move
    # the new shards into it (every rank wraps the same model, so all take part).
    runtime.setup_transports()
    summary.bytes_after = _param_bytes(model)
    return summary


def _refuse_shared_weights(model: nn.Module, targets) -> None:
    """A weight shared with a module etp does not wrap would be read there as if it were full."""
    sharded_ids = {id(getattr(m, attr)) for _, m, attrs, _ in targets for attr in attrs}
    wrapped_modules = {id(m) for _, m, _, _ in targets}
    for owner_name, owner in model.named_modules():
        if id(owner) in wrapped_modules:
            continue
        for pname, param in owner.named_parameters(recurse=False):
            if id(param) in sharded_ids:
                raise ValueError(
                    f"parameter '{owner_name}.{pname}' is shared with a layer etp shards, but "
                    f"{type(owner).__name__} reads it directly; exclude that layer with filter_fn "
                    "or untie the weights"
                )


def _shard_targets(targets, groups: ETPGroups, config: ETPConfig, runtime: ETPRuntime, summary: WrapSummary) -> None:
    new_params: dict[int, ETPShardedParam] = {}  # tied weights share one shard
    for name, module, attrs, install in targets:
        for attr in attrs:
            param = getattr(module, attr)
            if id(param) not in new_params:
                expert = is_expert_param(param)
                group: ShardGroup = groups.expert if expert else groups.dense
                full_name = f"{name}.{attr}" if name else attr
                if group.size == 1:
                    if expert:
                        summary.replicated_experts.append(full_name)
                    continue
                # Each expert role (fc1 of every MoE block, fc2 of every block) is a chain of
                # its own: one block of prefetch runway. See [Note: ETP chains].
                role = attr if attr != "weight" else name.rsplit(".", 1)[-1]
                kind = f"expert:{role}" if expert else "dense"
                new_params[id(param)] = shard_parameter(param, group, config, runtime, full_name, kind)
                summary.wrapped.append(full_name)
            module._parameters[attr] = new_params[id(param)]
        if any(isinstance(getattr(module, a), ETPShardedParam) for a in attrs):
            if install is not None:
                install(module)
            setattr(module, _WRAPPED_MARKER, True)


def _bits(tensor: torch.Tensor) -> int:
    """Every element's bit pattern summed in int64: equal tensors give equal sums, and nearly
    any difference changes it."""
    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return int(tensor.detach().contiguous().view(views[tensor.element_size()]).sum(dtype=torch.int64))


def check_replicas_agree(model: nn.Module, groups: ETPGroups) -> None:
    """Raises ValueError naming the first parameter whose value, shape or dtype differs between
    the ranks of an ETP group (each rank must wrap the same model: a rank seeded differently
    would shard, and keep replicated, weights that silently disagree). Dense parameters are
    compared over the dense group, expert parameters over the expert group. A collective.

    Example::

        check_replicas_agree(model, etp.build_etp_groups(config))   # ETPConfig(debug_checks=True) does it
    """
    import torch.distributed as dist

    for expert, group in ((False, groups.dense), (True, groups.expert)):
        if group.size == 1 or group.ag_group is None:
            continue
        mine = [(name, tuple(p.shape), str(p.dtype), _bits(p)) for name, p in model.named_parameters()
                if is_expert_param(p) == expert and not isinstance(p, ETPShardedParam)]
        everyone: list = [None] * group.size
        dist.all_gather_object(everyone, mine, group=group.ag_group)
        for index, entry in enumerate(mine):
            differs = [r for r, theirs in enumerate(everyone) if index >= len(theirs) or theirs[index] != entry]
            if differs:
                raise ValueError(
                    f"parameter '{entry[0]}' differs between the ranks of its ETP group {group.ranks} (group ranks "
                    f"{differs} disagree with rank {group.rank}): every rank must build the same model, e.g. seed "
                    "torch identically before building it")
        if any(len(theirs) != len(mine) for theirs in everyone):
            raise ValueError(f"the ranks of ETP group {group.ranks} hold different parameter lists: every rank "
                             "must build the same model")


def prefetch_after_step(model: nn.Module) -> int:
    """Issues the first forward gather of every ETP chain of ``model`` now, on the AG side
    stream: call it right after the optimizer step (and ``etp.quantize_shards``, when called
    explicitly), so the next forward starts with its weights already arriving instead of
    a synchronous gather. A no-op (returns 0) for models without ETP weights. A collective
    over the ETP groups: every rank calls it.

    Example::

        optimizer.step()
        etp.prefetch_after_step(model)
    """
    runtime = _runtime_of(model)
    return 0 if runtime is None else runtime.prefetch_after_step()

def shard_parameter(
    param: torch.Tensor,
    group: ShardGroup,
    config: ETPConfig,
    runtime=None,
    name: str = "weight",
    kind: str = "dense",
) -> ETPShardedParam:
    """Returns an ``ETPShardedParam`` holding this rank's shard of ``param``.

    ``param`` must hold the same full value on every rank of ``group``. Attributes the
    original parameter carried (``allreduce``, ``tensor_model_parallel``, ``is_expert``, ...)
    are kept.

    Args:
        runtime: the ``ETPRuntime`` that will gather it (a new one when None); weights of one
            model share one runtime so that they form prefetch chains.
        name: used in error messages. kind: its chain kind, see [Note: ETP chains].

    Raises:
        ValueError: ``param`` is already an ``ETPShardedParam`` or has fewer than 2 dims.

    Example::

        layer.weight = shard_parameter(layer.weight, groups.dense, config, name="layer.weight")
    """
    if isinstance(param, ETPShardedParam):
        raise ValueError(
            f"parameter {param!r} is already ETP-sharded; shard each parameter once "
            "(wrap_module_params_etp skips modules it already wrapped)"
        )
    layout = ShardLayout(tuple(param.shape), group.size, group.rank, config.pad_for_alignment)
    with torch.no_grad():
        shard = layout.shard_of(param.detach())
    new = ETPShardedParam(shard, requires_grad=param.requires_grad)
    for key, value in vars(param).items():
        setattr(new, key, value)
    new.etp_layout = layout
    new.etp_group = group
    new.etp_config = config
    if runtime is None:
        runtime = ETPRuntime(config)
    runtime.register(new, name, kind)
    return new
