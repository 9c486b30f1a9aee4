"""``ExpertDispatcher``: one MoE layer's token exchange over an expert-parallel group.

[Note: static outputs]
Every tensor a step returns is a view of a buffer allocated at construction:

* ``recv_x`` is ``[capacity, H]`` and ``recv_w`` ``[capacity]``, sorted by local expert (see
  [Note: receive layout]); ``tokens_per_expert`` (on device) says how many rows each local
  expert has, starting at row 0. Rows past ``tokens_per_expert.sum()`` are zero. Nothing
  on the host knows the valid length: consume it with device-side counts (a grouped GEMM
  reading ``tokens_per_expert``), or run the experts over all ``capacity`` rows.
  ``dispatch(..., trim=True)`` instead reads the counts on the host (one sync) and returns
  ``recv_x[:rows]`` / ``recv_w[:rows]``; ``combine`` then takes ``[rows, H]`` and the
  gradients flow as ``[rows, ...]`` too (no padding back to the capacity, no zero-filled
  ``[capacity, H]`` gradient from slicing outside autograd).
* ``combine`` returns ``[T, H]``; backward returns views of gradient buffers.

They stay valid until the same call of the next step overwrites them (``dispatch``
overwrites ``recv_x``, ``combine`` its output, each backward its gradients). A step that
keeps two micro-batches in flight through one layer needs one dispatcher per micro-batch.
Overwriting a buffer bumps its autograd version, so a stale ``recv_x`` saved for backward
fails loudly instead of computing with the new rows.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from etp.ep.autograd import CombineFunction, DispatchFunction
from etp.ep.backends import EPContext, backend_class
from etp.ep.config import EPConfig
from etp.ep.handle import EPHandle, HandleState
from etp.ep.profiler import choose, pick_fastest
from etp.ep.routing_layout import META_COLUMNS, count_pairs, pair_rows

__all__ = ["ExpertDispatcher"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _resolve_backends(cfg: EPConfig, group, dispatcher_cls, agree_group=None) -> dict:
    """``{"dispatch": name, "combine": name, "source": ...}``: the profiler's cached choice for
    ``auto`` (with every candidate's times; with ``cfg.capturable`` the fastest capturable
    backend of each side from those times), else the configured names."""
    def reads_host_splits(name: str) -> bool:
        return backend_class(name, group, cfg.ranks_per_host).needs_host_layout

    if cfg.backend == "auto":
        entry = choose(cfg, group, dispatcher_cls, agree_group=agree_group)
        if cfg.capturable and any(reads_host_splits(entry[side]) for side in ("dispatch", "combine")):
            ms = {n: t for n, t in entry.get("ms", {}).items() if not reads_host_splits(n)}
            if not ms:
                raise ValueError(f"EPConfig.capturable: none of the profiled backends {sorted(entry.get('ms', {}))} "
                                 "moves tokens without reading split sizes on the host; use symm_* or nccl_padded")
            entry = {**entry, **pick_fastest(ms), "source": f"{entry['source']}, capturable"}
        return entry
    names = cfg.backend.split("+")
    if len(names) > 2:
        raise ValueError(f"EPConfig.backend={cfg.backend!r}: at most '<dispatch>+<combine>'")
    if cfg.capturable:
        hosted = [n for n in names if reads_host_splits(n)]
        if hosted:
            raise ValueError(f"EPConfig.backend={cfg.backend!r} with capturable=True: {hosted[0]} reads split "
                             "sizes on the host, which a CUDA graph cannot; use auto, symm_* or nccl_padded")
    return {"dispatch": names[0], "combine": names[-1], "source": "config"}


class ExpertDispatcher:
    """Moves tokens to the ranks holding their experts and sums the results back.

    Rank ``r`` of ``group`` holds experts ``[r * E / W, (r + 1) * E / W)``. One dispatcher
    per MoE layer; it owns every buffer it will use (see [Note: static outputs]).

    Args:
        cfg: the layer's :class:`EPConfig`.
        group: the expert-parallel process group (default: the world).
        name: the layer's name in error messages.
        device: where buffers live (default: the current CUDA device for NCCL groups,
            else CPU).
        agree_group: for ``backend="auto"``, a group holding ``group`` whose ranks all build
            this dispatcher together, each with its own EP group (the world, for a model
            whose every rank has the same MoE layers): all EP groups then use the same
            backends. Needed where EP groups coexist with other groups that use symmetric
            memory; see [Note: one choice for every EP group] in ``etp.ep.profiler``.

    Example::

        disp = ExpertDispatcher(cfg, group)
        handle = disp.prepare(topk_idx)                       # [T, K] int64
        recv_x, recv_w, tokens_per_expert = disp.dispatch(x, topk_weights, handle)
        expert_out = experts(recv_x, recv_w, tokens_per_expert)   # [capacity, H]
        out = disp.combine(expert_out, handle)                # [T, H]
        disp.check()                                          # at a host sync point
    """

    def __init__(self, cfg: EPConfig, group: Optional[dist.ProcessGroup] = None, *, name: str = "moe",
                 device: Optional[torch.device] = None, agree_group: Optional[dist.ProcessGroup] = None):
        if not isinstance(cfg, EPConfig):
            raise TypeError(f"cfg={cfg!r}: expected an EPConfig")
        group = group or dist.group.WORLD
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local = cfg.experts_per_rank(world)
        if device is None:
            is_nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if is_nccl else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" means this rank's GPU; tensors say cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        self.cfg, self.group, self.name, self.device = cfg, group, name, device
        self.capacity = cfg.capacity(world)
        self.ctx = EPContext(cfg, group, rank, world, local, self.capacity, self.device)
        #: How the backends were chosen: ``{"dispatch", "combine", "source"}`` and, for
        #: ``backend="auto"``, every candidate's times (``"ms"``, see ``etp.ep.profile``).
        self.backend_report = _resolve_backends(cfg, group, type(self), agree_group)
        self.backend_names = (self.backend_report["dispatch"], self.backend_report["combine"])
        dispatch_cls, combine_cls = (backend_class(n, group, cfg.ranks_per_host) for n in self.backend_names)
        self.dispatch_backend = dispatch_cls(self.ctx)
        self.combine_backend = (self.dispatch_backend if combine_cls is dispatch_cls else combine_cls(self.ctx))
        self.validate = cfg.validate if cfg.validate is not None else self.device.type == "cpu"
        E, H, T, K = cfg.num_experts, cfg.hidden_size, cfg.max_tokens_per_rank, cfg.topk
        ints = dict(dtype=torch.int64, device=self.device)
        self._meta = torch.zeros(E + META_COLUMNS, **ints)
        self._meta_all = torch.zeros(world, E + META_COLUMNS, **ints)
        # Sticky until check(): [0] largest rows each rank needed, [1] bad indices per rank.
        self._status = torch.zeros(2, world, **ints)
        self._recv_x = self.dispatch_backend.alloc_rows(self.capacity, H)
        self._recv_w = self.dispatch_backend.alloc_rows(self.capacity, None, cfg.weight_dtype)
        self._grad_recv_x = self.dispatch_backend.alloc_rows(self.capacity, H)
        self._out = torch.zeros(T, H, dtype=cfg.dtype, device=self.device)
        self._grad_x = torch.zeros(T, H, dtype=cfg.dtype, device=self.device)
        self._grad_w = torch.zeros(T, K, dtype=cfg.weight_dtype, device=self.device)
        # dispatch(trim=True)'s host copy of tokens_per_expert: pinned, so the copy is queued
        # on the stream and the host waits for it only after queuing the move (see dispatch).
        cuda = self.device.type == "cuda"
        self._counts_host = torch.zeros(local, dtype=torch.int64, pin_memory=cuda)
        self._counts_copied = torch.cuda.Event() if cuda else None
        # References to the gradient views last returned: autograd's AccumulateGrad then
        # copies them instead of stealing a buffer the next step overwrites.
        self._grad_views: tuple = ()
        self._generation = 0

    # ---------------------------------------------------------------- public API
    def prepare(self, topk_idx: torch.Tensor) -> EPHandle:
        """Exchanges per-expert counts and lays out this step's routing on device.

        One small all-gather (``E + 2`` ints per rank), prefix sums on device, no host sync
        unless ``validate`` (on for CPU by default) checks the indices on the host.

        Args:
            topk_idx: [T, K] int64 expert indices on the dispatcher's device,
                ``T <= max_tokens_per_rank``; any T (also 0) per rank.

        Returns:
            The :class:`EPHandle` that ``dispatch`` and ``combine`` take.

        Example::

            handle = disp.prepare(router_logits.topk(cfg.topk, dim=-1).indices)
        """
        self._check_topk_idx(topk_idx)
        cfg, ctx = self.cfg, self.ctx
        with record_function("etp::ep_prepare"):
            _, blocks = count_pairs(topk_idx, cfg.num_experts, out=self._meta, return_blocks=True)
            with record_function("etp::ep_count_all_gather"):
                _all_gather(self._meta_all.view(-1), self._meta, group=self.group)
            layout = pair_rows(topk_idx, self._meta_all, ctx.rank, self.capacity,
                               cfg.expert_capacity(ctx.world_size), blocks=blocks)
            torch.maximum(self._status[0], layout.needed, out=self._status[0])
            self._status[1].add_(self._meta_all[:, cfg.num_experts + 1])
        self._generation += 1
        handle = EPHandle(topk_idx, layout, self._generation)
        for backend in {id(b): b for b in (self.dispatch_backend, self.combine_backend)}.values():
            backend.on_prepare(handle)
        return handle

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, handle: EPHandle, *, trim: bool = False):
        """Sends every token row to its K experts' ranks. Differentiable in x and weights.

        Args:
            x: [T, H] token rows of ``cfg.dtype``, T as in ``prepare``.
            topk_weights: [T, K] routing weights (floating).
            handle: from this dispatcher's latest ``prepare``.
            trim: return only the valid rows, ``rows = tokens_per_expert.sum()`` of them, and
                ``tokens_per_expert`` on the host (one host sync; not capturable). ``combine``
                then takes ``[rows, H]``. For experts that need host counts (megatron's).

        Returns:
            ``(recv_x [capacity, H], recv_w [capacity], tokens_per_expert [E_local])``; see
            [Note: static outputs] for the valid rows. With ``trim``: ``[rows, H]``,
            ``[rows]`` and host counts.

        Example::

            recv_x, recv_w, tokens_per_expert = disp.dispatch(x, topk_weights, handle)
            recv_x, recv_w, counts = disp.dispatch(x, topk_weights, handle, trim=True)
        """
        self._check_handle(handle, "dispatch")
        T, K, H = handle.tokens, handle.topk, self.cfg.hidden_size
        _check_tensor("x", x, (T, H), self.cfg.dtype, self.device)
        _check_tensor("topk_weights", topk_weights, (T, K), None, self.device)
        handle._to(HandleState.PREPARED, HandleState.DISPATCHED, HandleState.COMBINED,
                   new=HandleState.DISPATCHED, op="dispatch")
        counts = handle.layout.tokens_per_expert
        handle.rows, handle.trim = None, trim
        if trim:
            # The one host sync of trim, split: the copy of the counts is queued here, the
            # move after it, and only then does the host wait (_move_dispatch), for the copy
            # alone. The GPU then has the move queued while the host waits and resumes,
            # instead of idling until the host has launched it.
            self._counts_host.copy_(counts, non_blocking=True)
            if self._counts_copied is not None:
                self._counts_copied.record()
        recv_x, recv_w = DispatchFunction.apply(x, topk_weights, self, handle)
        if trim:
            counts = self._counts_host.clone()  # the next prepare overwrites the pinned copy
        return recv_x, recv_w, counts

    def combine(self, expert_out: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        """Sums each token's K expert rows back on its rank. Differentiable in expert_out.

        Args:
            expert_out: [capacity, H] rows in ``recv_x``'s order (routing weights already
                applied by the experts if wanted); rows past the valid ones are ignored.
                After ``dispatch(..., trim=True)``: [rows, H], the valid rows only.
            handle: the handle ``dispatch`` used.

        Returns:
            [T, H]: ``out[t] = sum_k expert_out_of(t, k)`` (fp32 accumulation, k order).

        Example::

            out = disp.combine(expert_out, handle)
        """
        self._check_handle(handle, "combine")
        rows = self.capacity if handle.rows is None else handle.rows
        _check_tensor("expert_out", expert_out, (rows, self.cfg.hidden_size), self.cfg.dtype, self.device)
        handle._to(HandleState.DISPATCHED, HandleState.COMBINED, new=HandleState.COMBINED, op="combine")
        return CombineFunction.apply(expert_out, self, handle)

    def check(self) -> None:
        """Raises what the device saw since the last ``check`` (a host sync; call it where
        the step synchronizes anyway, e.g. with the loss).

        Raises:
            ValueError: expert indices outside ``[0, num_experts)`` reached ``prepare`` (they
                were left out of the exchange).
            RuntimeError: a rank's receive buffer overflowed (the rows past the capacity
                were not exchanged and contribute nothing to ``combine``), or a backend's own
                capacity did (``nccl_padded``'s rows per peer).

        Example::

            loss.item(); disp.check()
        """
        needed, bad = self._status.tolist()
        self._status.zero_()
        if any(bad):
            ranks = {r: n for r, n in enumerate(bad) if n}
            raise ValueError(
                f"layer {self.name!r}: topk_idx held expert indices outside [0, {self.cfg.num_experts}) "
                f"(rank: count {ranks}); those pairs were not exchanged"
            )
        over = {r: n for r, n in enumerate(needed) if n > self.capacity}
        if over:
            raise RuntimeError(
                f"layer {self.name!r}: receive buffer overflow on rank(s) {sorted(over)}: needed "
                f"{over} rows, capacity {self.capacity} (capacity_factor={self.cfg.capacity_factor}); "
                "the rows past the capacity were not exchanged. Raise capacity_factor, set it to None "
                "(never overflows), or set drop_tokens=True"
            )
        for backend in {id(b): b for b in (self.dispatch_backend, self.combine_backend)}.values():
            backend.check(self.name)

    @property
    def backend(self) -> str:
        """``"<dispatch>+<combine>"`` backend names in use."""
        return "+".join(dict.fromkeys(self.backend_names))

    # ---------------------------------------------------------------- backward moves
    def dispatch_backward(self, grad_recv_x: torch.Tensor, grad_recv_w: torch.Tensor, handle: EPHandle):
        """Dispatch's backward, the move ``dispatch``'s autograd node runs: a combine on the
        combine backend, of the rows and of the routing weights.

        Autograd calls it; call it directly to run (or time) the move without a graph.

        Args:
            grad_recv_x: [capacity, H] gradients of ``recv_x`` (``[rows, H]`` after
                ``dispatch(..., trim=True)``).
            grad_recv_w: [capacity] (``[rows]``) gradients of ``recv_w``.
            handle: the handle ``dispatch`` used.

        Returns:
            ``(grad_x [T, H], grad_w [T, K])`` in the dispatcher's dtypes, views of gradient
            buffers the next call overwrites (see [Note: static outputs]):
            ``grad_x[t] = sum_k grad_recv_x_of(t, k)``, ``grad_w[t, k] = grad_recv_w_of(t, k)``.

        Example::

            grad_x, grad_w = disp.dispatch_backward(grad_recv_x, grad_recv_w, handle)
        """
        rows = self.capacity if handle.rows is None else handle.rows
        _check_tensor("grad_recv_x", grad_recv_x, (rows, self.cfg.hidden_size), None, self.device)
        _check_tensor("grad_recv_w", grad_recv_w, (rows,), None, self.device)
        grad_x = self._move_combine(grad_recv_x, handle, backward=True)
        grad_w = self._move_combine_pairs(grad_recv_w, handle)
        return grad_x, grad_w

    def combine_backward(self, grad_out: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        """Combine's backward, the move ``combine``'s autograd node runs: a dispatch of each
        token's gradient row to its K expert rows, on the dispatch backend.

        Autograd calls it; call it directly to run (or time) the move without a graph.

        Args:
            grad_out: [T, H] gradients of ``combine``'s output.
            handle: the handle ``combine`` used.

        Returns:
            [capacity, H] (``[rows, H]`` after ``dispatch(..., trim=True)``) in ``recv_x``'s
            order, a view of a gradient buffer the next call overwrites; rows past the valid
            ones are zero.

        Example::

            grad_expert_out = disp.combine_backward(grad_out, handle)
        """
        _check_tensor("grad_out", grad_out, (handle.tokens, self.cfg.hidden_size), None, self.device)
        grad_expert_out, _ = self._move_dispatch(grad_out.contiguous(), None, handle, backward=True)
        return grad_expert_out

    # ---------------------------------------------------------------- moves (autograd and the backward moves)
    def _move_dispatch(self, x, w, handle, *, backward: bool):
        out_x = self._grad_recv_x if backward else self._recv_x
        out_w = None if backward else self._recv_w
        with record_function("etp::ep_dispatch_backward" if backward else "etp::ep_dispatch"):
            self.dispatch_backend.dispatch(x, w, handle, out_x, out_w)
        _bump(out_x, out_w)
        if handle.trim and handle.rows is None:  # forward with trim: the move is queued, wait for the counts
            if self._counts_copied is not None:
                self._counts_copied.synchronize()
            handle.rows = int(self._counts_host.sum())
        # trim: every backend reads and writes only the valid rows, so the trimmed views
        # carry all of them (combine's inputs and the gradients included).
        rows = out_x.shape[0] if handle.rows is None else handle.rows
        if backward:
            view = out_x[:rows]
            self._grad_views = (view,)
            return view, None
        return out_x[:rows], out_w[:rows]

    def _move_combine(self, y, handle, *, backward: bool):
        out = (self._grad_x if backward else self._out)[: handle.tokens]
        with record_function("etp::ep_combine_backward" if backward else "etp::ep_combine"):
            self.combine_backend.combine(y.contiguous(), handle, out)
        _bump(out)
        if backward:
            self._grad_views = (out,)
        return out

    def _move_combine_pairs(self, v, handle):
        out = self._grad_w[: handle.tokens]
        with record_function("etp::ep_combine_weights_backward"):
            self.combine_backend.combine_pairs(v.contiguous(), handle, out)
        _bump(out)
        self._grad_views = (*self._grad_views, out)
        return out

    # ---------------------------------------------------------------- checks
    def _check_topk_idx(self, topk_idx):
        cfg = self.cfg
        if not isinstance(topk_idx, torch.Tensor):
            raise ValueError(f"topk_idx: expected a tensor, got {type(topk_idx).__name__}")
        if topk_idx.dtype != torch.int64:
            raise ValueError(f"topk_idx: dtype {topk_idx.dtype}, expected torch.int64")
        if topk_idx.dim() != 2 or topk_idx.shape[1] != cfg.topk:
            raise ValueError(f"topk_idx: shape {tuple(topk_idx.shape)}, expected [T, topk={cfg.topk}]")
        if topk_idx.shape[0] > cfg.max_tokens_per_rank:
            raise ValueError(f"topk_idx: {topk_idx.shape[0]} tokens, more than max_tokens_per_rank="
                             f"{cfg.max_tokens_per_rank}")
        if topk_idx.device != self.device:
            raise ValueError(f"topk_idx: on {topk_idx.device}, the dispatcher's buffers are on {self.device}")
        if self.validate and topk_idx.numel():
            low, high = int(topk_idx.min()), int(topk_idx.max())
            if low < 0 or high >= cfg.num_experts:
                raise ValueError(f"topk_idx: expert indices must lie in [0, {cfg.num_experts}), "
                                 f"got min {low} max {high}")

    def _check_handle(self, handle, op):
        if not isinstance(handle, EPHandle):
            raise ValueError(f"handle: expected the EPHandle of prepare(), got {type(handle).__name__}")
        if handle.generation != self._generation:
            raise RuntimeError(f"{op}: stale handle (prepare #{handle.generation}; the dispatcher's "
                               f"buffers now hold prepare #{self._generation})")


def _check_tensor(name, t, shape, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype}, expected {dtype} (EPConfig.dtype)")
    if dtype is None and not t.is_floating_point():
        raise ValueError(f"{name}: dtype {t.dtype}, expected a floating dtype")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")


def _bump(*buffers):
    # Kernels and collectives write without autograd seeing it: bump the version so a view
    # saved for an older step's backward fails instead of reading the new rows.
    for buf in buffers:
        if buf is not None:
            torch.autograd.graph.increment_version(buf)
