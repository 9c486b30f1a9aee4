"""Safe unpickling of torch_dist checkpoints (see the module docstring of ``publish.py`` for every
file that is unpickled on load and how each is restricted)."""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pathlib
import pickle
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .manifest import CheckpointError, _is_safe_relpath

__all__ = ["safe_unpickling"]


# --------------------------------------------------------------------------------------
# Safe unpickling


def _metadata_globals(extra: Sequence[Any]) -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` that a torch DCP ``.metadata`` pickle may reference.

    Found by recording the globals of ``.metadata`` files that megatron-core 0.16.1 writes
    with torch 2.13 (tensors and ShardedObjects). Each resolves to a dataclass, enum or pure
    lookup; none can run code when called with attacker-chosen arguments.
    """
    from torch.distributed.checkpoint import filesystem as dcp_fs
    from torch.distributed.checkpoint import metadata as dcp_md

    objects = [
        dcp_md.Metadata, dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata,
        dcp_md.ChunkStorageMetadata, dcp_md.TensorProperties, dcp_md.MetadataIndex,
        dcp_md.StorageMeta, dcp_md._MEM_FORMAT_ENCODING, dcp_fs._StorageInfo,
        torch.Size, torch.serialization._get_layout, pathlib.PosixPath, pathlib.PurePosixPath,
        *extra,
    ]
    for obj in extra:
        if not (isinstance(getattr(obj, "__module__", None), str)
                and isinstance(getattr(obj, "__qualname__", None), str)):
            raise TypeError(f"safe_globals entries must be classes or functions, got {obj!r}")
    allowed = {(obj.__module__, obj.__qualname__): obj for obj in objects}
    # StorageMeta.checkpoint_id holds the save path. Python 3.13 moved the path classes to
    # pathlib._local (registered above when running there); accept both module names so a
    # checkpoint written under one Python version loads under the other.
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    allowed.update({("torch", name): value for name, value in vars(torch).items()
                    if isinstance(value, torch.dtype)})
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only allowlisted globals; refuses persistent ids."""

    def __init__(self, file, allowed: dict[tuple[str, str], Any], source: str, **kwargs):
        super().__init__(file, **kwargs)
        self._allowed = allowed
        self._source = source

    def find_class(self, module: str, name: str):
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise CheckpointError(
                f"{self._source}: refusing to unpickle global {module}.{name}: not a torch DCP "
                "metadata type (if it is a legitimate one of a newer torch, pass it in "
                "safe_globals=)"
            ) from None

    def persistent_load(self, pid):
        raise CheckpointError(f"{self._source}: refusing a pickle persistent id in DCP metadata")


def _check_metadata(obj: Any, source: str) -> Any:
    """The unpickled object must be DCP ``Metadata`` whose storage paths stay inside the dir."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(obj, Metadata):
        raise CheckpointError(f"{source}: unpickled a {type(obj).__name__}, expected DCP Metadata")
    for info in (obj.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not _is_safe_relpath(rel):
            raise CheckpointError(f"{source}: storage path {rel!r} leaves the checkpoint directory")
    return obj


def _restricted_pickle_module(allowed: dict[tuple[str, str], Any]) -> types.SimpleNamespace:
    """Stands in for ``pickle`` inside ``torch.distributed.checkpoint.filesystem``.

    Only what that module uses is provided (``load`` restricted, ``dump`` unchanged for a save
    that would run inside the context); any other attribute raises AttributeError instead of
    silently unpickling without restriction.
    """
    def load(file, **kwargs):
        source = str(getattr(file, "name", "<DCP metadata stream>"))
        return _check_metadata(_MetadataUnpickler(file, allowed, source, **kwargs).load(), source)

    def loads(data, **kwargs):
        import io

        return load(io.BytesIO(data), **kwargs)

    return types.SimpleNamespace(
        load=load, loads=loads, dump=pickle.dump, dumps=pickle.dumps,
        HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL, DEFAULT_PROTOCOL=pickle.DEFAULT_PROTOCOL,
        PickleError=pickle.PickleError, PicklingError=pickle.PicklingError,
        UnpicklingError=pickle.UnpicklingError,
    )


def _describe(f: Any) -> str:
    if isinstance(f, (str, os.PathLike)):
        return str(f)
    name = getattr(f, "name", None)
    if isinstance(name, str):
        return name
    return f"<in-memory {type(f).__name__}: a ShardedObject stored in a .distcp shard>"


def _weights_only_reason(exc: pickle.UnpicklingError) -> str:
    """The line of torch's long weights-only message that names the refused global."""
    for line in str(exc).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.strip()
    return str(exc)


def _weights_only(real_load: Callable) -> Callable:
    """``torch.load`` that always unpickles with ``weights_only=True``."""

    @functools.wraps(real_load)
    def load(f, map_location=None, pickle_module=None, *, weights_only=None, **kwargs):
        del weights_only  # overridden on purpose: DCP's load_bytes asks for False
        if pickle_module is not None:
            raise CheckpointError(f"torch.load({_describe(f)}) with a custom pickle_module "
                                  "is refused inside safe_unpickling()")
        try:
            return real_load(f, map_location, weights_only=True, **kwargs)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{_describe(f)}: torch.load(weights_only=True) refused it: "
                                  f"{_weights_only_reason(exc)}") from exc

    return load


def _refuse_multistorage_client() -> None:
    """megatron's MSC readers use their own loaders, which the swaps below do not cover."""
    msc_utils = sys.modules.get("megatron.core.msc_utils")
    if msc_utils is not None and msc_utils.MultiStorageClientFeature.is_enabled():
        raise CheckpointError("megatron's MultiStorageClient feature is enabled: its readers "
                              "bypass safe_unpickling(); disable it to load through etp")


_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_active = False


@contextlib.contextmanager
def safe_unpickling(safe_globals: Sequence[Any] = ()):
    """Context in which loading a torch_dist checkpoint cannot run code from its files.

    While active (process-wide, not thread-local; not reentrant):

    * torch DCP reads ``.metadata`` through a restricted unpickler (DCP metadata classes,
      ``torch.Size``, dtypes, the layout helper, ``pathlib`` paths, and ``safe_globals``);
    * ``torch.load`` / ``torch.serialization.load`` always use ``weights_only=True``, with
      ``safe_globals`` added to torch's allowlist (megatron-core registers its own types,
      e.g. ``argparse.Namespace``, at import).

    Refusals raise ``CheckpointError``; torch DCP wraps those raised inside its read steps in
    its ``CheckpointException`` (a BaseException), which ``load_checkpoint`` unwraps.

    >>> from megatron.core import dist_checkpointing                    # doctest: +SKIP
    >>> with safe_unpickling():                                         # doctest: +SKIP
    ...     state = dist_checkpointing.load(model.sharded_state_dict(), "/ckpt/iter_0000020")
    """
    global _active
    if _active:
        raise RuntimeError("safe_unpickling() is already active (it is not reentrant)")
    _refuse_multistorage_client()
    dcp_fs = importlib.import_module(_DCP_FILESYSTEM)
    if getattr(dcp_fs, "pickle", None) is not pickle:
        raise CheckpointError(f"{_DCP_FILESYSTEM} of torch {torch.__version__} no longer reads "
                              "'.metadata' through its module-level 'pickle'; etp.megatron.checkpoint "
                              "cannot restrict it and must be updated")
    real_torch_load, real_serialization_load = torch.load, torch.serialization.load
    guarded = _weights_only(real_serialization_load)
    _active = True
    dcp_fs.pickle = _restricted_pickle_module(_metadata_globals(safe_globals))
    torch.load = torch.serialization.load = guarded
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            yield
    finally:
        dcp_fs.pickle = pickle
        torch.load, torch.serialization.load = real_torch_load, real_serialization_load
        _active = False


