"""Triton launches with a small host cost: the compiled launcher, called directly.

[Note: cached launches]
``kernel[grid](...)`` costs the host a few times what the compiled launcher itself takes:
the rest is Triton binding the arguments, computing and looking up the specialization key,
and reading the current device and stream. An eager FP8 step issues hundreds of Triton
launches and is bound by its host's issue rate.

``launch(kernel, grid, *args, **meta)`` keeps each kernel's compiled kernels under a key
that is at least as fine as Triton's specialization: the device, the launch options
(``num_warps`` ...), every constexpr's value, and for every other argument its dtype and
16-byte alignment (tensors), its 32 / 64-bit range, ``== 1`` and divisibility by 16 (ints),
its value (bools, None) or its type (floats). A key's first launch goes through Triton,
which compiles or finds the kernel and returns it; later ones call that kernel's launcher
with the arguments in parameter order and the current raw stream. A key finer than
Triton's only costs an extra lookup in Triton's own cache; a coarser one would launch a
kernel specialized for other arguments, which ``tests/kernels/test_launch.py`` checks (on a GPU) does not
happen, against the kernel Triton itself picks, on every argument pattern etp uses.
Runtime arguments go positionally: keywords are keyed by value, so a tensor passed by keyword
would make a key per call (and keep the tensor alive in it); ``launch`` refuses one.

Every launch goes through Triton (the slow path) under the Triton interpreter, while a
Triton launch hook is installed (a profiler such as proton), for a wrapped kernel, and for
good on a Triton whose launcher this was not checked against (the order of the compiled
launcher's leading arguments is Triton's internal business: checked on 3.6, the GPU
machine's, by ``tests/kernels/test_launch.py``; another minor version is logged once and served by
Triton's own launch until checked and added to ``_CHECKED``).

What this saves per launch is measured by ``tools/diag/bench_host_ops.py`` (BENCHMARKS.md,
'Host cost per launch and per stream lookup'); most of what is left over the launcher alone is
building the key.

Example::

    launch(_transpose_kernel, (rows // 64, cols // 64, 1), x, y, rows, cols, TILE=64, num_warps=4)
"""
from __future__ import annotations

import inspect
import logging

import torch
import triton
from triton.runtime.jit import JITFunction

from etp.streams import current_raw_stream

__all__ = ["launch", "launch_stats"]

log = logging.getLogger(__name__)

_INT32 = (-(2**31), 2**31)
_INT64 = (-(2**63), 2**63)
_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)
_stats = {"fast": 0, "triton": 0}
# Triton minor versions whose compiled launcher takes (grid x, y, z, stream, function,
# packed metadata, launch metadata, enter hook, exit hook, *arguments), checked on a GPU.
_CHECKED = {(3, 6)}
_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
# A compiled kernel without the attributes used here, or an unchecked Triton: always Triton's path.
_broken = _VERSION not in _CHECKED


class _Kernel:
    """What ``launch`` knows of one ``@triton.jit`` function: which parameters are constexprs,
    their defaults, and per key the compiled kernel with the values of the parameters the call
    did not pass positionally (constant per key: the keywords' values are part of it)."""

    __slots__ = ("names", "constexpr", "defaults", "runtime", "keywords_checked", "compiled")

    def __init__(self, kernel) -> None:
        params = list(kernel.params)
        self.names = [p.name for p in params]
        self.constexpr = tuple(bool(p.is_constexpr) for p in params)
        signature = inspect.signature(kernel.fn)
        self.defaults = [signature.parameters[name].default for name in self.names]
        self.runtime = {p.name for p in params if not p.is_constexpr}
        self.keywords_checked: set = set()  # keyword-name tuples seen to hold no runtime parameter
        self.compiled: dict = {}

    def check_keywords(self, keywords: tuple) -> None:
        """Keywords are keyed by value, so a runtime argument (a tensor, a size) passed by
        keyword would make a key per call and keep its tensors alive: refused."""
        if keywords in self.keywords_checked:
            return
        runtime = [k for k in keywords if k in self.runtime]
        if runtime:
            raise ValueError(f"launch: runtime parameter(s) {runtime} passed by keyword; pass them "
                             "positionally (keywords are for constexprs and launch options)")
        self.keywords_checked.add(keywords)

    def tail(self, positional: int, meta: dict) -> tuple:
        """The values of the parameters after the first ``positional``, in order: a keyword's
        or the default. Raises TypeError for a parameter with neither."""
        values = []
        for name, default in zip(self.names[positional:], self.defaults[positional:]):
            if name in meta:
                values.append(meta[name])
            elif default is inspect.Parameter.empty:
                raise TypeError(f"launch: parameter {name!r} has no value")
            else:
                values.append(default)
        return tuple(values)


_unchecked_logged = False
_KERNELS: dict = {}  # jit function -> _Kernel, or None for one launched through Triton always


def _spec(value, constexpr: bool):
    """The part of a positional argument's value a Triton specialization can depend on (or
    finer)."""
    if constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return (value == 1, value % 16 == 0, _INT32[0] <= value < _INT32[1], _INT64[0] <= value < _INT64[1])
    if isinstance(value, float):
        return float
    return value


def _hook_installed() -> bool:
    if _RUNTIME is None:
        return False
    hook = getattr(_RUNTIME, "launch_enter_hook", None)
    # Triton 3.6 keeps None when unset; later ones an empty HookChain (always truthy).
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_stats() -> dict:
    """How many launches took the cached path (``fast``) and Triton's (``triton``)."""
    return dict(_stats)


def _kernel_info(kernel):
    # An interpreted function (TRITON_INTERPRET=1 set before triton.jit ran), or a wrapper
    # around a kernel (tests count launches that way): always Triton's own launch.
    info = _Kernel(kernel) if isinstance(kernel, JITFunction) else None
    _KERNELS[kernel] = info
    return info


def launch(kernel, grid: tuple, *args, **meta):
    """``kernel[grid](*args, **meta)`` with the host cost of the compiled launcher alone once
    the arguments' specialization was seen (see [Note: cached launches]). ``grid`` is a
    tuple of up to three ints; returns the compiled kernel, as Triton does."""
    global _broken, _unchecked_logged
    info = _KERNELS.get(kernel, False)
    if info is False:
        info = _kernel_info(kernel)
    if info is None or _broken or _hook_installed():
        if _broken and info is not None and not _unchecked_logged:
            _unchecked_logged = True
            log.info("etp kernels: Triton %s: launches go through Triton's own path (etp.kernels.launch "
                     "was checked on %s)", triton.__version__, ", ".join(f"{a}.{b}" for a, b in sorted(_CHECKED)))
        _stats["triton"] += 1
        return kernel[grid](*args, **meta)
    info.check_keywords(tuple(meta))
    device = torch._C._cuda_getDevice()
    try:
        # Keywords (constexprs and launch options) by value, in the call site's order.
        key = (device, *meta.items(), *map(_spec, args, info.constexpr))
        found = info.compiled.get(key)
    except TypeError:  # an unhashable value: nothing to key on
        key, found = None, None
    if found is None:
        compiled = kernel[grid](*args, **meta)
        _stats["triton"] += 1
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            _broken = True
            log.warning("etp kernels: this Triton's compiled kernels lack run / function / packed_metadata; "
                        "every launch goes through Triton's own path")
        elif key is not None and len(args) <= len(info.names):
            info.compiled[key] = (compiled, info.tail(len(args), meta))
        return compiled
    compiled, tail = found
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 current_raw_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *tail)
    _stats["fast"] += 1
    return compiled
