"""Crash-safe publishing and safe loading of megatron-core ``dist_checkpointing`` checkpoints.

A checkpoint lives in ``<root>/iter_0000020/`` (megatron-core's torch_dist files: ``*.distcp``
shards, torch DCP's pickled ``.metadata``, megatron's ``metadata.json`` and ``common.pt``)
plus ``etp_manifest.json``; ``<root>/latest`` names the iteration to resume from.

Publishing (``save_checkpoint``), collective over ``group``:

1. rank 0 creates ``<root>/.tmp_iter_0000020_<random>`` (a fresh name per attempt, so a
   leftover of a crashed attempt never collides) and holds an ``flock`` on a sibling
   ``.lock`` file for as long as the save runs: that is how a later save tells a leftover
   from a directory still being written by a live job;
2. every rank runs ``save_fn(tmp_dir)`` (the actual ``dist_checkpointing.save``);
3. the ranks agree that every rank succeeded (all-gather of per-rank outcomes): one failing
   rank aborts the publish on all ranks and rank 0 deletes the attempt;
4. rank 0 lists the files; every rank hashes (sha256) and fsyncs a 1/world share of them,
   balanced by size, so hashing a large checkpoint costs about one file read per rank;
5. rank 0 writes the manifest (file list with size and sha256, iteration, etp version, world
   size, the caller's JSON metadata), fsyncs it and the directory, renames the directory to
   ``iter_0000020`` (atomic on POSIX), fsyncs the root, and only then replaces ``latest``
   atomically (write ``.latest.<random>.tmp``, fsync, ``os.replace``, fsync the root);
6. leftovers of earlier crashed saves (unlocked ``.tmp_*`` directories) are removed.

A process killed at any point before step 5's ``os.replace`` leaves ``latest`` and the
checkpoint it names untouched; a kill between the rename and the ``latest`` update leaves a
complete but unreferenced ``iter_*`` directory, which the next save of that iteration moves
aside and replaces.

Loading (``load_checkpoint``) verifies before megatron or torch reads a byte: the manifest is
present and well-formed, every listed file exists with the listed size, there is no
unlisted file (or symlink), and (``verify_hashes=True``, the default; every rank hashes its
share) every sha256 matches. Sizes are always checked: a truncated shard is refused even
with ``verify_hashes=False``. Any problem raises ``CheckpointError`` naming the file, the
problem and the earlier checkpoints that could be loaded instead; nothing falls back
silently.

Then ``load_fn(path)`` runs inside ``safe_unpickling()``. The files of a torch_dist checkpoint
that are unpickled on load (megatron-core 0.16.1, torch 2.13):

* ``.metadata``: ``torch.distributed.checkpoint.FileSystemReader.read_metadata`` calls
  ``pickle.load`` (full pickle: arbitrary code). megatron builds its readers internally
  (``strategies/torch.py``: ``_get_filesystem_reader`` for ``load``,
  ``load_tensors_metadata`` and ``load_sharded_metadata``; ``FileSystemReader`` directly in
  ``remove_sharded_tensors``), so no reader can be passed in; instead the context swaps the module-level name ``pickle`` of ``torch.distributed.checkpoint.filesystem`` for a
  stand-in whose ``load`` is a restricted unpickler that resolves only the DCP metadata
  classes, ``torch.Size``, torch dtypes, the layout helper and ``pathlib`` paths. That one
  swap covers every reader subclass (megatron's ``CachedMetadataFileSystemReader``, fsspec)
  without copying megatron's load strategy.
* ``common.pt`` (and common-strategy sharded-object ``.pt`` files): megatron's
  ``TorchCommonLoadStrategy`` calls ``torch.load(path, map_location='cpu')`` without
  ``weights_only``; torch >= 2.6 then defaults to ``weights_only=True``, but the environment
  variable ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns that into a full unpickle.
* ShardedObjects inside ``*.distcp`` shards (BYTE_IO items, e.g. optimizer param groups,
  RNG states): torch DCP's ``DefaultLoadPlanner.load_bytes`` (inherited by megatron's
  ``MCoreLoadPlanner``) calls ``torch.load(value, weights_only=False)``: a full unpickle of
  bytes read from a shard.
* Tensors inside ``*.distcp``: ``FileSystemReader.read_data`` uses
  ``torch.load(weights_only=True)`` already.

For the ``torch.load`` sites the context replaces ``torch.load`` (and
``torch.serialization.load``) with a wrapper that always passes ``weights_only=True``
(explicitly, so the environment variable cannot undo it, and overriding DCP's explicit
``False``); types beyond torch's weights-only allowlist must be allowed by name, either by
megatron's own ``torch.serialization.add_safe_globals`` registrations (done at import of
``megatron.core``) or by ``safe_globals=`` here. ``metadata.json`` and the manifest are JSON.

Why both the manifest and the restricted unpicklers: the manifest catches corruption and
files modified after the save, but whoever can rewrite a checkpoint can also rewrite its
manifest; the unpicklers make a rewritten checkpoint unable to run code.

Assumptions: all ranks see the same filesystem (rank 0 renames the directory the others
wrote into); ``group`` contains every rank that writes the checkpoint (megatron's
``dist_checkpointing`` itself always uses the default group); ``flock`` works on the
filesystem (local, NFSv4; on Lustre it needs the ``flock`` mount option), otherwise a
concurrent job's in-progress save into the same root could be cleaned as a leftover.
Without ``torch.distributed`` initialized, save and load run as a single process.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import heapq
import importlib
import json
import logging
import os
import pathlib
import pickle
import re
import shutil
import stat
import sys
import time
import types
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "LATEST_NAME",
    "MANIFEST_NAME",
    "CheckpointError",
    "LoadedCheckpoint",
    "find_latest",
    "iteration_dir",
    "list_checkpoints",
    "load_checkpoint",
    "safe_unpickling",
    "save_checkpoint",
    "verify_checkpoint",
]

log = logging.getLogger("etp.checkpoint_io")

MANIFEST_NAME = "etp_manifest.json"
LATEST_NAME = "latest"
_MANIFEST_FORMAT = "etp-checkpoint"
_MANIFEST_VERSION = 1
_TMP_PREFIX = ".tmp_"
_TRASH_PREFIX = ".trash_"
_LOCK_SUFFIX = ".lock"
_LATEST_TMP_PREFIX = ".latest."
_ITER_DIR_RE = re.compile(r"iter_(\d{7,})")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_HASH_CHUNK = 16 << 20
_MAX_LISTED_PROBLEMS = 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be published, or is missing, incomplete, modified or unsafe to load."""


class LoadedCheckpoint(NamedTuple):
    """What ``load_checkpoint`` returns: the iteration loaded, the metadata dict given to
    ``save_checkpoint``, and whatever ``load_fn`` returned (e.g. megatron's state dict)."""

    iteration: int
    metadata: dict
    result: Any


# --------------------------------------------------------------------------------------
# Layout


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """The published directory of ``iteration``: ``<root>/iter_0000020`` (megatron's naming).

    >>> iteration_dir("/ckpt", 20)
    PosixPath('/ckpt/iter_0000020')
    """
    _check_iteration(iteration)
    return Path(root) / f"iter_{iteration:07d}"


def find_latest(root: str | os.PathLike) -> int | None:
    """The iteration named by ``<root>/latest``, or None when there is no marker yet.

    ``latest`` is the commit point of a save: an ``iter_*`` directory it does not name (a save
    killed between the directory rename and the marker update) is not resumed from. A marker
    that does not hold an iteration number raises ``CheckpointError``.

    >>> find_latest("/nonexistent")  # no checkpoint yet: start from scratch
    """
    marker = Path(root) / LATEST_NAME
    try:
        text = marker.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, OSError) as exc:
        raise CheckpointError(f"{marker}: cannot read the latest-iteration marker: {exc}") from exc
    if not re.fullmatch(r"\d+\n?", text):
        raise CheckpointError(
            f"{marker}: expected an iteration number, found {text[:40]!r}; "
            f"published checkpoints under {root}: {list_checkpoints(root) or 'none'}"
        )
    return int(text)


def list_checkpoints(root: str | os.PathLike) -> list[int]:
    """Iterations with a published directory (one holding a manifest) under ``root``, sorted.

    Cheap (no verification); leftover ``.tmp_*`` directories of crashed saves are not listed.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _ITER_DIR_RE.fullmatch(entry.name)
        if match and (entry / MANIFEST_NAME).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def _check_iteration(iteration: int) -> None:
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")


# --------------------------------------------------------------------------------------
# Collectives (single process when torch.distributed is not initialized)


class _Comm:
    """The few collectives save/load need, over ``group``."""

    def __init__(self, group):
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed and group is not None:
            raise ValueError("group given but torch.distributed is not initialized")
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        if self.rank < 0:
            raise ValueError("this rank is not a member of the given group")

    def broadcast_from_0(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def all_gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _attempt(comm: _Comm, fn: Callable, *args) -> tuple[Any, str | None]:
    """Runs ``fn(*args)`` on this rank; returns ``(value, None)`` or ``(None, error line)``.

    Errors are caught (and their traceback logged here) so that every rank still reaches the
    next collective and all ranks take the same decision.
    """
    try:
        return fn(*args), None
    # torch DCP raises CheckpointException, a BaseException, for failures on any rank.
    except (Exception, CheckpointException) as exc:
        log.exception("rank %d: %s failed", comm.rank, getattr(fn, "__name__", fn))
        detail = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        return None, f"rank {comm.rank}: {detail}"


def _agree(comm: _Comm, outcome: tuple[Any, str | None], what: str) -> list:
    """All-gathers one ``_attempt`` outcome per rank; raises on every rank if any failed."""
    gathered = comm.all_gather(outcome)
    errors = [error for _, error in gathered if error is not None]
    if errors:
        raise CheckpointError(f"{what} failed:\n  " + "\n  ".join(errors))
    return [value for value, _ in gathered]


def _on_rank0(comm: _Comm, what: str, fn: Callable, *args):
    """Runs ``fn`` on rank 0 only and broadcasts its value (or its error) to every rank."""
    outcome = _attempt(comm, fn, *args) if comm.rank == 0 else (None, None)
    value, error = comm.broadcast_from_0(outcome)
    if error is not None:
        raise CheckpointError(f"{what} failed: {error}")
    return value


# --------------------------------------------------------------------------------------
# Files: listing, hashing, durability


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _list_files(directory: Path) -> list[tuple[str, int]]:
    """``(relative posix path, size)`` of every file under ``directory``, sorted.

    Symlinks and special files raise: a checkpoint holds regular files only, and a link
    could make a load read (and a hash vouch for) something outside the checkpoint.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            if stat.S_ISDIR(info.st_mode):
                continue  # os.walk descends into it (symlinked directories are S_ISLNK)
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{path}: not a regular file (symlink or special file)")
            found.append((path.relative_to(directory).as_posix(), info.st_size))
    return sorted(found)


def _hash_file(path: Path, fsync: bool) -> tuple[int, str]:
    """``(bytes read, sha256 hex)`` of ``path``; optionally fsyncs it while it is open."""
    digest = hashlib.sha256()
    size = 0
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            size += n
        if fsync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def _shares(entries: Sequence[tuple[str, int]], world_size: int) -> list[list[tuple[str, int]]]:
    """Splits ``(path, size)`` entries into ``world_size`` shares of about equal bytes.

    Greedy largest-first onto the least loaded rank; deterministic, so every rank computes
    the same split from the same list without communicating.
    """
    shares: list[list[tuple[str, int]]] = [[] for _ in range(world_size)]
    least_loaded = [(0, rank) for rank in range(world_size)]  # already a heap
    for path, size in sorted(entries, key=lambda e: (-e[1], e[0])):
        load, rank = heapq.heappop(least_loaded)
        shares[rank].append((path, size))
        heapq.heappush(least_loaded, (load + size, rank))
    return shares


def _hash_and_sync(directory: Path, share: Sequence[tuple[str, int]]) -> dict[str, str]:
    """sha256 of this rank's share of the freshly written files, each fsynced on the way."""
    digests = {}
    for rel, size in share:
        read, digest = _hash_file(directory / rel, fsync=True)
        if read != size:
            raise CheckpointError(f"{directory / rel}: size changed from {size} to {read} bytes "
                                  "while the checkpoint was being published")
        digests[rel] = digest
    return digests


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------
# Manifest


def _build_manifest(iteration: int, files: list[tuple[str, int]], digests: dict[str, str],
                    metadata: dict, world_size: int) -> dict:
    import etp  # at call time: etp/__init__ may import this module

    return {
        "format": _MANIFEST_FORMAT,
        "format_version": _MANIFEST_VERSION,
        "iteration": iteration,
        "etp_version": etp.__version__,
        "torch_version": torch.__version__,
        "world_size": world_size,
        "created_unix": time.time(),
        "metadata": metadata,
        "files": {rel: {"size": size, "sha256": digests[rel]} for rel, size in files},
    }


def _is_safe_relpath(rel: str) -> bool:
    parts = pathlib.PurePosixPath(rel).parts
    return bool(parts) and not rel.startswith("/") and ".." not in parts and rel != MANIFEST_NAME


def _manifest_problems(manifest: Any) -> list[str]:
    """Structural problems of a parsed manifest (an attacker-controlled JSON document)."""
    if not isinstance(manifest, dict):
        return ["manifest: not a JSON object"]
    problems = []
    if manifest.get("format") != _MANIFEST_FORMAT or manifest.get("format_version") != _MANIFEST_VERSION:
        problems.append(f"manifest: unknown format {manifest.get('format')!r} "
                        f"version {manifest.get('format_version')!r}")
    if not isinstance(manifest.get("iteration"), int) or not isinstance(manifest.get("metadata"), dict):
        problems.append("manifest: 'iteration' must be an int and 'metadata' an object")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return problems + ["manifest: 'files' must be a non-empty object"]
    for rel, entry in files.items():
        if not _is_safe_relpath(rel):
            problems.append(f"manifest: unsafe file name {rel!r}")
        elif (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
              or not isinstance(entry.get("sha256"), str) or not _SHA256_RE.fullmatch(entry["sha256"])):
            problems.append(f"manifest: malformed entry for {rel!r}: {entry!r}")
    return problems


def _read_manifest(directory: Path) -> tuple[dict | None, list[str]]:
    """The parsed manifest of ``directory`` and its problems (manifest is None if unusable)."""
    if not directory.is_dir():
        return None, [f"{directory}: no such checkpoint directory"]
    path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        missing = (f"{MANIFEST_NAME}: missing (the save did not complete, or this directory "
                   "was not written by etp.checkpoint_io)")
        return None, [missing]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, [f"{MANIFEST_NAME}: unreadable: {exc}"]
    problems = _manifest_problems(manifest)
    return (None if problems else manifest), problems


def _listing_problems(directory: Path, manifest: dict) -> list[str]:
    """Missing files, size mismatches and unlisted files (or symlinks) of ``directory``."""
    try:
        present = dict(_list_files(directory))
    except CheckpointError as exc:
        return [str(exc)]
    present.pop(MANIFEST_NAME, None)
    problems = []
    for rel, entry in manifest["files"].items():
        if rel not in present:
            problems.append(f"{rel}: missing")
        elif present[rel] != entry["size"]:
            problems.append(f"{rel}: size {present[rel]} bytes, manifest says {entry['size']} "
                            "(truncated or modified after the save)")
    problems += [f"{rel}: not listed in the manifest (added after the save)"
                 for rel in sorted(set(present) - set(manifest["files"]))]
    return problems


def _hash_problems(directory: Path, share: Sequence[tuple[str, str]]) -> list[str]:
    """sha256 mismatches among ``(relative path, expected sha256)`` pairs."""
    problems = []
    for rel, expected in share:
        try:
            _, actual = _hash_file(directory / rel, fsync=False)
        except OSError as exc:
            problems.append(f"{rel}: unreadable: {exc}")
            continue
        if actual != expected:
            problems.append(f"{rel}: sha256 mismatch (modified after the save, or corrupted)")
    return problems


def _suggestion(root: Path, iteration: int | None) -> str:
    others = [i for i in list_checkpoints(root) if i != iteration]
    earlier = [i for i in others if iteration is None or i < iteration]
    if earlier:
        return (f"Earlier checkpoints under {root}: iterations {earlier}; load one with "
                f"load_checkpoint(root, load_fn, iteration={earlier[-1]}) after checking it.")
    if others:
        return f"Other checkpoints under {root}: iterations {others}."
    return f"No other checkpoint under {root}."


def _verification_error(directory: Path, problems: list[str]) -> CheckpointError:
    match = _ITER_DIR_RE.fullmatch(directory.name)
    shown = problems[:_MAX_LISTED_PROBLEMS]
    more = len(problems) - len(shown)
    lines = "\n  ".join(shown + ([f"... and {more} more"] if more else []))
    return CheckpointError(
        f"checkpoint {directory} failed verification, refusing to load it:\n  {lines}\n"
        + _suggestion(directory.parent, int(match.group(1)) if match else None)
    )


def verify_checkpoint(path: str | os.PathLike, *, verify_hashes: bool = True) -> dict:
    """Verifies a published checkpoint directory in this process; returns its manifest.

    Checks, without unpickling anything: the manifest is present and well-formed, every
    listed file exists with its listed size, no file or symlink is unlisted, and (with
    ``verify_hashes``) every sha256 matches. Raises ``CheckpointError`` listing each problem
    and the earlier checkpoints under the same root.

    >>> manifest = verify_checkpoint("/ckpt/iter_0000020")        # doctest: +SKIP
    >>> manifest["iteration"], manifest["metadata"]["recipe"]     # doctest: +SKIP
    (20, 'tiny_moe_cpu')
    """
    directory = Path(path)
    manifest, problems = _read_manifest(directory)
    if manifest is not None:
        problems = _listing_problems(directory, manifest)
    if manifest is not None and not problems and verify_hashes:
        problems = _hash_problems(directory, [(r, e["sha256"]) for r, e in manifest["files"].items()])
    if problems:
        raise _verification_error(directory, problems)
    return manifest


# --------------------------------------------------------------------------------------
# Publishing


class _StagingLock:
    """The flock rank 0 holds on ``<tmp dir>.lock`` while its save is in progress.

    The kernel drops the lock when the process dies, so an unlocked (or missing) lock file
    means the temp directory is a leftover that no live process is writing.
    """

    def __init__(self):
        self.path: Path | None = None
        self.fd: int | None = None

    def acquire(self, path: Path) -> None:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fresh file: nobody else holds it
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
            self.path = self.fd = None


def _in_use(tmp_dir: Path) -> bool:
    lock_path = tmp_dir.with_name(tmp_dir.name + _LOCK_SUFFIX)
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)
    return False


def _create_staging(root: Path, iteration: int, metadata: dict, lock: _StagingLock) -> str:
    """Rank 0: checks the request and creates a fresh, locked temp directory for it."""
    if not isinstance(metadata, dict):
        raise CheckpointError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"metadata must be a JSON-serializable dict: {exc}") from exc
    final = iteration_dir(root, iteration)
    root.mkdir(parents=True, exist_ok=True)
    if final.exists() and find_latest(root) == iteration:
        raise CheckpointError(f"{final} exists and {root / LATEST_NAME} points at it; refusing to "
                              "overwrite the checkpoint a restart would load (delete it first)")
    tmp = root / f"{_TMP_PREFIX}{final.name}_{uuid.uuid4().hex}"
    lock.acquire(tmp.with_name(tmp.name + _LOCK_SUFFIX))
    tmp.mkdir()
    return str(tmp)


def _write_latest(root: Path, iteration: int) -> None:
    tmp = root / f"{_LATEST_TMP_PREFIX}{uuid.uuid4().hex}.tmp"
    _write_durably(tmp, f"{iteration}\n".encode("ascii"))
    os.replace(tmp, root / LATEST_NAME)
    _fsync_dir(root)


def _move_aside_stale(root: Path, final: Path) -> Path | None:
    """Renames an existing, unreferenced ``final`` out of the way; returns its new path.

    It is the complete checkpoint of a save killed between its rename and its ``latest``
    update (or of a run restarted from an earlier iteration): nothing resumes from it.
    """
    if not final.exists():
        return None
    if find_latest(root) == int(_ITER_DIR_RE.fullmatch(final.name).group(1)):
        raise CheckpointError(f"{final} became the latest checkpoint during this save; not replacing it")
    trash = root / f"{_TRASH_PREFIX}{final.name}_{uuid.uuid4().hex}"
    log.warning("replacing %s, which %s does not name, with the new save", final, LATEST_NAME)
    os.rename(final, trash)
    return trash


def _remove_leftovers(root: Path) -> None:
    """Removes what crashed saves left behind: unlocked temp dirs, trash, marker temps.

    Runs after a successful publish; a failure here is logged, not raised: the checkpoint is
    already published and a leftover is harmless (loads ignore it).
    """
    for entry in sorted(root.iterdir()):
        name = entry.name
        try:
            if name.startswith(_TMP_PREFIX) and not name.endswith(_LOCK_SUFFIX) and entry.is_dir():
                if _in_use(entry):
                    continue
                shutil.rmtree(entry)
                entry.with_name(name + _LOCK_SUFFIX).unlink(missing_ok=True)
            elif name.startswith(_TMP_PREFIX) and name.endswith(_LOCK_SUFFIX):
                owner = root / name[: -len(_LOCK_SUFFIX)]  # a crash between lock and mkdir
                if owner.exists() or _in_use(owner):
                    continue
                entry.unlink(missing_ok=True)
            elif name.startswith(_TRASH_PREFIX):
                shutil.rmtree(entry)
            elif name.startswith(_LATEST_TMP_PREFIX) and name.endswith(".tmp"):
                entry.unlink(missing_ok=True)
            else:
                continue
            log.info("removed leftover %s", entry)
        except OSError as exc:
            log.warning("could not remove leftover %s: %s", entry, exc)


def _publish(root: Path, iteration: int, tmp: Path, files: list[tuple[str, int]],
             digests: dict[str, str], metadata: dict, world_size: int) -> str:
    """Rank 0, once every rank's files are written, hashed and fsynced: manifest, rename,
    ``latest``; in this order, each step durable before the next."""
    manifest = _build_manifest(iteration, files, digests, metadata, world_size)
    _write_durably(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True).encode())
    for dirpath, _, _ in os.walk(tmp, topdown=False):
        _fsync_dir(Path(dirpath))
    final = iteration_dir(root, iteration)
    stale = _move_aside_stale(root, final)
    try:
        os.rename(tmp, final)  # atomic; fails rather than merge if `final` reappeared
    except OSError:
        if stale is not None:
            os.rename(stale, final)
        raise
    _fsync_dir(root)
    _write_latest(root, iteration)
    _remove_leftovers(root)  # including `stale`: from here on, failures are only logged
    return str(final)


def _discard(tmp: Path) -> None:
    """Rank 0, after every rank has agreed that the attempt failed: nobody writes it anymore.

    A failure to delete is logged, not raised, so that it does not hide the save's error;
    the next successful save removes the leftover.
    """
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
    except OSError as exc:
        log.warning("could not remove the failed attempt %s: %s", tmp, exc)


def _run_save_fn(save_fn: Callable[[Path], Any], tmp: Path) -> None:
    save_fn(tmp)  # its return value stays local: it may not be picklable for the all-gather


def save_checkpoint(root: str | os.PathLike, iteration: int, save_fn: Callable[[Path], Any],
                    metadata: dict | None = None, group=None) -> Path:
    """Collective: writes a checkpoint through ``save_fn`` and publishes it atomically.

    Every rank of ``group`` calls this with the same ``root`` and ``iteration``.
    ``save_fn(tmp_dir)`` runs on every rank and writes the checkpoint into the (empty,
    existing) temporary directory ``tmp_dir``, normally through
    ``megatron.core.dist_checkpointing.save``; every file must be complete when it returns
    (with ``async_sharded_save=True``, run the returned request before returning).
    ``metadata`` (rank 0's is used) must be a JSON-serializable dict; it is stored in the
    manifest and returned by ``load_checkpoint``.

    Returns the published directory ``<root>/iter_<iteration:07d>``. If ``save_fn`` raises on
    any rank, or listing, hashing or publishing fails, every rank raises ``CheckpointError``
    and neither ``latest`` nor any published checkpoint changes. If a rank dies, the others
    fail in their next collective (backend error or timeout) and the same holds.

    Example (every rank)::

        from megatron.core import dist_checkpointing

        def save_fn(tmp_dir):
            dist_checkpointing.save(model.sharded_state_dict(), tmp_dir)

        save_checkpoint("/ckpt", 20, save_fn, metadata={"recipe": "tiny_moe_cpu", "etp_size": 2})
    """
    _check_iteration(iteration)
    comm = _Comm(group)
    root = Path(root)
    metadata = {} if metadata is None else metadata
    lock = _StagingLock()  # only rank 0's is ever acquired
    try:
        tmp = Path(_on_rank0(comm, "preparing the save", _create_staging, root, iteration,
                             metadata, lock))
        try:
            _agree(comm, _attempt(comm, _run_save_fn, save_fn, tmp), f"save_fn into {tmp}")
            files = _on_rank0(comm, "listing the written files", _list_files, tmp)
            my_share = _shares(files, comm.world_size)[comm.rank]
            shares = _agree(comm, _attempt(comm, _hash_and_sync, tmp, my_share), "hashing the files")
            digests = {rel: digest for share in shares for rel, digest in share.items()}
            final = _on_rank0(comm, f"publishing {tmp}", _publish, root, iteration, tmp, files,
                              digests, metadata, comm.world_size)
        except CheckpointError:
            # Every rank raised the same agreed error, so no rank writes into `tmp` anymore.
            if comm.rank == 0:
                _discard(tmp)
            raise
    finally:
        lock.release()
    return Path(final)


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
                              "'.metadata' through its module-level 'pickle'; etp.checkpoint_io "
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


# --------------------------------------------------------------------------------------
# Loading


def _resolve_iteration(root: Path, iteration: int | None) -> int:
    if iteration is not None:
        _check_iteration(iteration)
        return iteration
    latest = find_latest(root)
    if latest is None:
        raise CheckpointError(f"no checkpoint to load under {root}: no '{LATEST_NAME}' marker "
                              f"(published directories: {list_checkpoints(root) or 'none'})")
    return latest


def _check_before_hashing(directory: Path) -> tuple[dict | None, list[str]]:
    """Rank 0: the manifest and everything but the hashes."""
    manifest, problems = _read_manifest(directory)
    if manifest is not None:
        problems = _listing_problems(directory, manifest)
    return (manifest if not problems else None), problems


def load_checkpoint(root: str | os.PathLike, load_fn: Callable[[Path], Any],
                    iteration: int | None = None, group=None, *, verify_hashes: bool = True,
                    safe_globals: Sequence[Any] = ()) -> LoadedCheckpoint:
    """Collective: verifies a checkpoint, then calls ``load_fn(path)`` under safe unpickling.

    ``iteration`` None loads the one ``<root>/latest`` names (rank 0 decides). Verification
    (``verify_checkpoint``'s checks, each rank hashing a 1/world share of the files) must
    pass on every rank before any rank calls ``load_fn``; otherwise every rank raises the
    same ``CheckpointError``. ``load_fn`` runs inside ``safe_unpickling(safe_globals)``.

    Returns ``LoadedCheckpoint(iteration, metadata, result)``.

    Example (every rank)::

        from megatron.core import dist_checkpointing

        loaded = load_checkpoint(
            "/ckpt", lambda path: dist_checkpointing.load(model.sharded_state_dict(), path))
        model.load_state_dict(loaded.result)
        start_iteration = loaded.iteration + 1
    """
    comm = _Comm(group)
    root = Path(root)
    iteration = _on_rank0(comm, "finding the checkpoint", _resolve_iteration, root, iteration)
    directory = iteration_dir(root, iteration)
    manifest, problems = _on_rank0(comm, f"verifying {directory}", _check_before_hashing,
                                   directory)
    if not problems and verify_hashes:
        entries = [(rel, entry["size"]) for rel, entry in manifest["files"].items()]
        mine = [(rel, manifest["files"][rel]["sha256"])
                for rel, _ in _shares(entries, comm.world_size)[comm.rank]]
        for found, error in comm.all_gather(_attempt(comm, _hash_problems, directory, mine)):
            problems += found if error is None else [error]
    if problems:
        raise _verification_error(directory, problems)
    with safe_unpickling(safe_globals):
        try:
            result = load_fn(directory)
        except CheckpointException as exc:
            raise _unwrap_refusal(exc) from exc
    return LoadedCheckpoint(iteration, manifest["metadata"], result)


def _unwrap_refusal(exc: CheckpointException) -> BaseException:
    """torch DCP wraps the refusals of ``safe_unpickling`` (raised inside its read steps) into
    a CheckpointException (a BaseException) carrying every rank's failure; surface them as
    the CheckpointError they are. Other DCP failures are returned unchanged."""
    refusals = [(rank, failure) for rank, (failure, _) in sorted(exc.failures.items())
                if isinstance(failure, CheckpointError)]
    if not refusals:
        return exc
    lines = "\n  ".join(f"rank {rank}: {failure}" for rank, failure in refusals)
    return CheckpointError(f"refused to load (torch DCP failed on ranks {sorted(exc.failures)}):"
                           f"\n  {lines}")
