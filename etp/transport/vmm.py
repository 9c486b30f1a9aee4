"""CUDA virtual memory management (cuMemCreate / cuMemMap) for aliased gather buffers.

[Note: aliased own rows]
A copy-engine gather pulls the peers' rows on copy engines, but copying this rank's own rows
into the gathered buffer is a device-local copy, and the driver runs those on the SMs: the
next grouped GEMM waits for it ([Note: the own-rows copy takes the SMs] in
etp/transport/copy_engine.py). An aliased gather buffer does not copy them at all. For each
(weight, ticket) pair it is one virtual address range of the full padded weight, mapped piece
by piece onto physical memory:

* this rank's rows onto the weight's own shard (the memory the optimizer, or
  ``etp.quantize_shards``, writes): the GEMM reads the shard where it lives;
* every peer's rows onto the ticket's *backing*, ``world - 1`` allocations of one shard each,
  shared by every weight with the same ticket key (the cache's sharing rules are unchanged:
  [Note: ETP buffer keys]); the gather's peer copies land there.

The driver maps only whole allocations (a piece of one, or one at an offset, is refused with
CUDA_ERROR_NOT_SUPPORTED), so such a shard cannot be a slot of
torch's symmetric pool. It is an allocation of its own, exported to the peers as a file
descriptor (taken from this process with ``pidfd_getfd``, as torch's symmetric memory does)
and mapped there for their pulls (``SymmetricPool`` with ``granularity``: shards whose size is
a multiple of the 2 MiB mapping granularity; other weights keep pool slots, plain buffers and
the own-rows copy). Mappings are made once per (weight, ticket) and kept (stable addresses,
CUDA graphs). A backing holds ``(world - 1) / world`` of a plain ticket buffer's bytes.
Nothing may write into an aliased buffer: its own rows are the live shard (gathered buffers
are only ever read by GEMMs).

Called through ``ctypes`` on the driver library, as ``etp.transport.stream_ops`` is.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from .driver import bind
from .driver import check as _check

__all__ = ["Mapping", "exchange", "granularity", "handle_sharing_status", "release"]

_PINNED = 0x1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 0x1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 0x3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_MINIMUM = 0x0
_POSIX_FD = 0x1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_SYS_PIDFD_OPEN, _SYS_PIDFD_GETFD = 434, 438  # x86_64 / aarch64 Linux syscall numbers


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


@functools.lru_cache(maxsize=1)
def _driver():
    u64, size, P = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
    return bind({
        "cuMemGetAllocationGranularity": [P(size), P(_AllocProp), ctypes.c_int],
        "cuMemCreate": [P(u64), size, P(_AllocProp), u64],
        "cuMemRelease": [u64],
        "cuMemAddressReserve": [P(u64), size, size, u64, u64],
        "cuMemAddressFree": [u64, size],
        "cuMemMap": [u64, size, size, u64, u64],
        "cuMemUnmap": [u64, size],
        "cuMemSetAccess": [u64, size, P(_AccessDesc), size],
        "cuMemExportToShareableHandle": [ctypes.c_void_p, u64, ctypes.c_int, u64],
        "cuMemImportFromShareableHandle": [P(u64), ctypes.c_void_p, ctypes.c_int],
    })


def _prop(device: torch.device, exportable: bool = False) -> _AllocProp:
    prop = _AllocProp()
    prop.type = _PINNED
    prop.requestedHandleTypes = _POSIX_FD if exportable else 0
    prop.location = _MemLocation(_LOCATION_DEVICE, device.index or 0)
    return prop


@functools.lru_cache(maxsize=None)
def granularity(device: torch.device) -> int:
    """The minimum mapping granularity of ``device`` in bytes (2 MiB on Hopper)."""
    value = ctypes.c_size_t()
    with torch.cuda.device(device):
        _check(_driver()["cuMemGetAllocationGranularity"](ctypes.byref(value), ctypes.byref(_prop(device)),
                                                          _GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
    return value.value


def release(handle: int) -> None:
    _check(_driver()["cuMemRelease"](handle), "cuMemRelease")


def handle_sharing_status(process_group) -> tuple[bool, str]:
    """Whether every rank of ``process_group`` can take the peers' file descriptors with
    ``pidfd_getfd`` (what ``exchange`` needs), and why not. A collective over the group: each
    rank tries to take one descriptor (its standard error) from every peer."""
    import os

    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, os.getpid(), group=process_group)
    libc = ctypes.CDLL(None, use_errno=True)
    failure = ""
    for pid in everyone:
        if pid == os.getpid():
            continue
        pidfd = libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
        if pidfd < 0:
            failure = f"pidfd_open failed (errno {ctypes.get_errno()}: Linux < 5.6?)"
            break
        taken = libc.syscall(_SYS_PIDFD_GETFD, pidfd, 2, 0)
        if taken < 0:
            failure = f"pidfd_getfd failed (errno {ctypes.get_errno()}: no ptrace permission between the ranks?)"
        else:
            os.close(taken)
        os.close(pidfd)
        if failure:
            break
    failures: list = [None] * len(everyone)
    dist.all_gather_object(failures, failure, group=process_group)
    failed = next((f for f in failures if f), "")
    return (not failed, failed or "the ranks share allocations through pidfd_getfd")


def exchange(process_group, handles: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``handles`` (exportable allocations, see ``Mapping(exportable=True)``), as
    handles this process can map: ``result[rank][i]``; this rank's own entry is ``handles``
    itself, the others are imports the caller releases once mapped. A collective over
    ``process_group`` (ranks of one host: file descriptors are taken with ``pidfd_getfd``)."""
    import os

    import torch.distributed as dist

    d = _driver()
    fds = []
    for handle in handles:
        fd = ctypes.c_int(-1)
        _check(d["cuMemExportToShareableHandle"](ctypes.byref(fd), handle, _POSIX_FD, 0),
               "cuMemExportToShareableHandle")
        fds.append(fd.value)
    everyone: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, (os.getpid(), fds), group=process_group)
    libc = ctypes.CDLL(None, use_errno=True)
    me = dist.get_rank(process_group)
    result = []
    for rank, (pid, their_fds) in enumerate(everyone):
        if rank == me:
            result.append(list(handles))
            continue
        pidfd = libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
        if pidfd < 0:
            raise RuntimeError(f"etp: pidfd_open({pid}) failed (errno {ctypes.get_errno()}): aliased gather "
                               "buffers need the ranks' processes on one Linux >= 5.6 host (an etp bug: "
                               "handle_sharing_status said they could)")
        imported = []
        try:
            for fd in their_fds:
                mine = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
                if mine < 0:
                    raise RuntimeError(f"etp: pidfd_getfd(pid {pid}, fd {fd}) failed (errno {ctypes.get_errno()}: "
                                       "ptrace permission between the ranks' processes?; an etp bug: "
                                       "handle_sharing_status said it worked)")
                handle = ctypes.c_uint64()
                try:
                    with torch.cuda.device(device):
                        _check(d["cuMemImportFromShareableHandle"](ctypes.byref(handle), ctypes.c_void_p(mine),
                                                                   _POSIX_FD), "cuMemImportFromShareableHandle")
                finally:
                    os.close(mine)
                imported.append(handle.value)
        finally:
            os.close(pidfd)
        result.append(imported)
    dist.barrier(group=process_group)  # every peer has its copies of our descriptors
    for fd in fds:
        os.close(fd)
    return result


class _ArrayInterface:
    """What ``torch.as_tensor`` wraps without a copy; keeps ``owner`` (the mapping) alive as long
    as the tensor (torch holds a reference to this object)."""

    def __init__(self, address: int, nbytes: int, owner) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2, "strides": None}
        self.owner = owner


class Mapping:
    """One reserved virtual range, mapped piece by piece: ``pieces`` is a list of ``(handle,
    nbytes)`` laid out in order, each a whole allocation of ``nbytes`` (the driver maps nothing
    less: [Note: aliased own rows]). A piece with handle None gets a fresh allocation of its own
    (``handles``, released with the mapping; ``exportable`` ones can go to ``exchange``).

    Example (a 4 MiB view of two 2 MiB allocations)::

        g = granularity(device)
        a, b = Mapping(device, [(None, g)]), Mapping(device, [(None, g)])
        both = Mapping(device, [(a.handles[0], g), (b.handles[0], g)])
        t = both.tensor(torch.bfloat16, (g,))  # its halves are a's and b's memory
    """

    def __init__(self, device: torch.device, pieces: list[tuple[int | None, int]], exportable: bool = False) -> None:
        self.device, self.nbytes, self.address, self.handles = device, 0, 0, []
        gran = granularity(device)
        if any(nbytes % gran or nbytes <= 0 for _, nbytes in pieces):
            raise ValueError(f"etp vmm: piece sizes {[n for _, n in pieces]} are not positive multiples of the "
                             f"{gran}-byte mapping granularity")
        d = _driver()
        total = sum(n for _, n in pieces)
        with torch.cuda.device(device):
            address = ctypes.c_uint64()
            _check(d["cuMemAddressReserve"](ctypes.byref(address), total, gran, 0, 0), "cuMemAddressReserve")
            self.address, self.nbytes = address.value, total
            try:
                at = self.address
                for handle, nbytes in pieces:
                    if handle is None:
                        made = ctypes.c_uint64()
                        _check(d["cuMemCreate"](ctypes.byref(made), nbytes,
                                                ctypes.byref(_prop(device, exportable)), 0),
                               f"cuMemCreate({nbytes} bytes)")
                        handle = made.value
                        self.handles.append(handle)  # ours: released when unmapped
                    _check(d["cuMemMap"](at, nbytes, 0, handle, 0), "cuMemMap")
                    at += nbytes
                access = _AccessDesc(_MemLocation(_LOCATION_DEVICE, device.index or 0), _READ_WRITE)
                _check(d["cuMemSetAccess"](self.address, total, ctypes.byref(access), 1), "cuMemSetAccess")
            except Exception:
                self.free()
                raise

    def tensor(self, dtype: torch.dtype, shape) -> torch.Tensor:
        """The whole range as a tensor of ``dtype`` and ``shape`` (no copy; it keeps this alive)."""
        raw = torch.as_tensor(_ArrayInterface(self.address, self.nbytes, self), device=self.device)
        count = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        return raw[:count].view(dtype).view(shape)

    def free(self) -> None:
        if not self.address:
            return
        d = _driver()
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # no queued kernel may still read the range
            d["cuMemUnmap"](self.address, self.nbytes)
            d["cuMemAddressFree"](self.address, self.nbytes)
            for handle in self.handles:
                d["cuMemRelease"](handle)
        self.address, self.handles = 0, []

    def __del__(self) -> None:  # pragma: no cover - GPU only
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass
