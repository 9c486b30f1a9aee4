"""Checkpoint directories, manifests and verification. See [Note: crash-safe checkpoints] in
``publish.py``.

A checkpoint lives in ``<root>/iter_0000020/`` plus ``etp_manifest.json`` (file list with size and
sha256); ``<root>/latest`` names the iteration to resume from. ``verify_checkpoint`` checks a
directory against its manifest before anything reads a byte of it.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
import pathlib
import re
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

log = logging.getLogger(__name__)

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
                   "was not written by etp.megatron.checkpoint)")
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


