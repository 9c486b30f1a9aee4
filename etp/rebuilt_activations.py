"""Activations that backward rebuilds instead of keeping.

[Note: rebuilt activations]
A routed expert layer's largest saved tensors are ones that are cheap to make again from
tensors the layer keeps anyway: fc1's input is K row copies of the layer's input (the router
keeps that input; ``etp.megatron.local_dispatcher.regathered_rows`` gathers the rows again),
and fc2's input is the SwiGLU of fc1's output (the SwiGLU keeps that output for its own
backward; ``etp.modules`` runs the SwiGLU's forward kernel again). ``rebuilt_in_backward``
is the one mechanism behind both: a ``saved_tensors_hooks`` context under which autograd
saves one given tensor as a function that remakes it, bit for bit (a gather, an elementwise
kernel), when backward unpacks it. (The rows' amax that the forward's FP8 GEMM found rides on
that GEMM's ctx, ``etp.autograd``, so the FP8 weight gradient still makes its per-expert scales
from it.) The inputs the function reads must not change in place after the forward:
unpacking checks their versions and raises instead of rebuilding something else. Works under
CUDA-graph capture like any other kernel of the backward. Contexts of its own nest (the experts'
SwiGLU output inside the dispatcher's re-gathered input): the inner one hands every tensor that
is not its own to the outer one. Under another saved-tensor policy (an outer
``saved_tensors_hooks``: torch's non-reentrant checkpoint, offloading) it steps aside: that
policy already decides what is kept, and a rebuild would keep its inputs alive behind its back.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

__all__ = ["rebuilt_in_backward"]


class _Rebuilt:
    """What autograd holds instead of the tensor: how to make it again, and the versions of
    what that reads."""

    __slots__ = ("rebuild", "inputs", "versions", "what")

    def __init__(self, rebuild, inputs, versions, what):
        self.rebuild, self.inputs, self.versions, self.what = rebuild, inputs, versions, what


def _outer_hooks():
    """The saved-tensor hooks active here already, ``(pack, unpack)`` or None (see the module
    note). torch keeps the stack in C++; a torch without the query is taken to have none."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


def _unpack(saved):
    """The one unpack of every context of this module: rebuilds what they packed."""
    if not isinstance(saved, _Rebuilt):
        return saved
    if tuple(t._version for t in saved.inputs) != saved.versions:
        raise RuntimeError(f"{saved.what}: an input it is rebuilt from was modified in place after the "
                           f"forward; backward cannot make it again")
    with torch.no_grad():
        return saved.rebuild()


def rebuilt_in_backward(tensor: torch.Tensor | None, rebuild: Callable[[], torch.Tensor],
                        inputs: Sequence[torch.Tensor], what: str):
    """A ``torch.autograd.graph.saved_tensors_hooks`` context under which autograd saves
    ``tensor`` as ``rebuild`` (which must return the same values from ``inputs``) and calls it
    when backward needs the tensor; see [Note: rebuilt activations]. Every other saved tensor
    is kept as usual (or as an enclosing context of this function keeps it). A no-op context for
    ``tensor=None`` and under another saved-tensor policy (the module note). ``what`` names the tensor in the
    error raised when an input was modified in place after the forward.

    Example::

        h = torch.relu(a)
        with rebuilt_in_backward(h, lambda: torch.relu(a), [a], "relu(a)"):
            y = h @ w                        # h is not kept for backward
    """
    outer = _outer_hooks()
    if tensor is None or (outer is not None and outer[1] is not _unpack):
        return contextlib.nullcontext()
    outer_pack = outer[0] if outer is not None else (lambda t: t)
    ptr, shape, dtype = tensor.data_ptr(), tensor.shape, tensor.dtype
    inputs = tuple(t for t in inputs if t is not None)
    versions = tuple(t._version for t in inputs)

    def pack(t):
        if t.data_ptr() == ptr and t.shape == shape and t.dtype == dtype:
            return _Rebuilt(rebuild, inputs, versions, what)
        return outer_pack(t)

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
