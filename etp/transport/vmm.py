"""CUDA virtual memory management (cuMemCreate / cuMemMap) for aliased gather buffers.

[Note: aliased own rows]
A copy-engine gather pulls the peers' rows on copy engines, but copying this rank's own rows
into the gathered buffer is a device-local copy, and the driver runs those on the SMs: the
next grouped GEMM waits for it ([Note: the own-rows copy takes the SMs] in
etp/transport/copy_engine.py). An aliased gather buffer does not copy them at all. For each
(weight, ticket) pair it is one virtual address range of the full padded weight, mapped piece
by piece onto physical memory:

* this rank's rows onto the weight's own shard, the slot of the symmetric pool the optimizer
  (or ``etp.quantize_shards``) writes: the GEMM reads the shard where it lives;
* every peer's rows onto the ticket's *backing*, physical memory of ``world - 1`` shards
  shared by every weight with the same ticket key (the cache's sharing rules are unchanged:
  [Note: ETP buffer keys]); the gather's peer copies land there.

Mappings are made once per (weight, ticket) and kept (stable addresses, CUDA graphs). A
ticket's backing holds ``(world - 1) / world`` of a plain ticket buffer's bytes. The pieces
must start on the allocation granularity (2 MiB on H100): shard bytes a multiple of it, and
slots aligned to it inside the symmetric allocation (``SymmetricPool(granularity=...)``);
other weights keep plain buffers and the own-rows copy. Nothing may write into an aliased
buffer: its own rows are the live shard (gathered buffers are only ever read by GEMMs).

Called through ``ctypes`` on the driver library, as ``etp.transport.stream_ops`` is.
"""
from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["Mapping", "allocation_handle", "granularity"]

_PINNED = 0x1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 0x1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 0x3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_MINIMUM = 0x0


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
    lib = ctypes.CDLL("libcuda.so.1")
    u64, size, P = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
    signatures = {
        "cuMemGetAllocationGranularity": [P(size), P(_AllocProp), ctypes.c_int],
        "cuMemCreate": [P(u64), size, P(_AllocProp), u64],
        "cuMemRelease": [u64],
        "cuMemAddressReserve": [P(u64), size, size, u64, u64],
        "cuMemAddressFree": [u64, size],
        "cuMemMap": [u64, size, size, u64, u64],
        "cuMemUnmap": [u64, size],
        "cuMemSetAccess": [u64, size, P(_AccessDesc), size],
        "cuMemRetainAllocationHandle": [P(u64), ctypes.c_void_p],
    }
    ops = {}
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        ops[name] = fn
    return ops


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"etp: {what} failed with CUDA driver error {result} (CUresult)")


def _prop(device: torch.device) -> _AllocProp:
    prop = _AllocProp()
    prop.type = _PINNED
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


def allocation_handle(address: int) -> int:
    """The allocation handle behind a mapped ``address`` (a reference the caller releases with
    ``release``): two addresses in one allocation give the same handle value."""
    handle = ctypes.c_uint64()
    _check(_driver()["cuMemRetainAllocationHandle"](ctypes.byref(handle), ctypes.c_void_p(address)),
           "cuMemRetainAllocationHandle")
    return handle.value


def release(handle: int) -> None:
    _check(_driver()["cuMemRelease"](handle), "cuMemRelease")


class _ArrayInterface:
    """What ``torch.as_tensor`` wraps without a copy; keeps ``owner`` (the mapping) alive as long
    as the tensor (torch holds a reference to this object)."""

    def __init__(self, address: int, nbytes: int, owner) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2, "strides": None}
        self.owner = owner


class Mapping:
    """One reserved virtual range of ``nbytes``, mapped piece by piece: ``pieces`` is a list of
    ``(handle, offset, nbytes)`` (physical allocation, byte offset into it), laid out in order.
    A piece with handle None gets fresh physical memory of its own (``Mapping.create``).

    Example (a 4 MiB buffer whose first half is a new allocation and whose second half is
    ``other``'s first 2 MiB)::

        g = granularity(device)
        fresh = Mapping(device, [(None, 0, 2 * g)])
        both = Mapping(device, [(fresh.handles[0], 0, g), (other_handle, 0, g)])
        t = both.tensor(torch.bfloat16, (2 * g // 2,))
    """

    def __init__(self, device: torch.device, pieces: list[tuple[int | None, int, int]]) -> None:
        self.device, self.nbytes, self.address, self.handles = device, 0, 0, []
        gran = granularity(device)
        for _, offset, nbytes in pieces:
            if offset % gran or nbytes % gran or nbytes <= 0:
                raise ValueError(f"etp vmm: piece offset {offset} / size {nbytes} not a positive multiple "
                                 f"of the {gran}-byte granularity")
        d = _driver()
        total = sum(n for _, _, n in pieces)
        with torch.cuda.device(device):
            address = ctypes.c_uint64()
            _check(d["cuMemAddressReserve"](ctypes.byref(address), total, gran, 0, 0), "cuMemAddressReserve")
            self.address, self.nbytes = address.value, total
            try:
                at = self.address
                for handle, offset, nbytes in pieces:
                    if handle is None:
                        made = ctypes.c_uint64()
                        _check(d["cuMemCreate"](ctypes.byref(made), nbytes, ctypes.byref(_prop(device)), 0),
                               f"cuMemCreate({nbytes} bytes)")
                        handle = made.value
                        self.handles.append(handle)  # ours: released when unmapped
                    _check(d["cuMemMap"](at, nbytes, offset, handle, 0), "cuMemMap")
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
