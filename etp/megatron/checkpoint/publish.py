"""[Note: crash-safe checkpoints]
Crash-safe publishing and safe loading of megatron-core ``dist_checkpointing`` checkpoints.

A checkpoint lives in ``<root>/iter_0000020/`` (megatron-core's torch_dist files: ``*.distcp``
shards, torch DCP's pickled ``.metadata``, megatron's ``metadata.json`` and, before
megatron-core 0.19, ``common.pt``) plus ``etp_manifest.json``; ``<root>/latest`` names the
iteration to resume from.

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

``begin_checkpoint`` splits the same publish around a background writer ([Note: async saves]
in ``background.py``): steps 1 and the synchronous part of 2 happen at once, the writers run
in the background (each hashing and fsyncing the files it wrote), and
``PendingCheckpoint.publish`` does the rest of 2 (the files that need every rank's results)
and steps 3-6 later, every rank at the same point. The lock is held throughout.

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
that are unpickled on load (megatron-core 0.16.1 and 0.19.2, torch 2.11 and 2.13):

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
  megatron-core 0.19 writes the common state as a ShardedObject in the shards instead (next
  item) but still reads a ``common.pt`` it finds the same way.
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

import errno
import fcntl
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from .manifest import (
    _ITER_DIR_RE,
    _LATEST_TMP_PREFIX,
    _LOCK_SUFFIX,
    _TMP_PREFIX,
    _TRASH_PREFIX,
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    LoadedCheckpoint,
    _agree,
    _attempt,
    _build_manifest,
    _check_iteration,
    _Comm,
    _fsync_dir,
    _hash_and_sync,
    _hash_problems,
    _list_files,
    _listing_problems,
    _on_rank0,
    _read_manifest,
    _shares,
    _verification_error,
    _write_durably,
    find_latest,
    iteration_dir,
    list_checkpoints,
)
from .unpickle import safe_unpickling

__all__ = ["PendingCheckpoint", "begin_checkpoint", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)


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
    latest = find_latest(root)
    if final.exists() and latest == iteration:
        raise CheckpointError(f"{final} exists and {root / LATEST_NAME} points at it; refusing to "
                              "overwrite the checkpoint a restart would load (delete it first)")
    if latest is not None and iteration < latest:
        # latest never moves backwards: a restart must never load an older state than the
        # newest one published (etp-train refuses such a run before it starts).
        raise CheckpointError(f"{root / LATEST_NAME} names iteration {latest}; saving iteration {iteration} "
                              "would move it backwards: save into another directory")
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


class PendingCheckpoint:
    """A checkpoint whose files this rank's background writer is still writing
    (``begin_checkpoint``); nothing names it until ``publish``.

    ``written()`` says whether this rank's writer is done (local, no communication);
    ``publish()`` (collective) waits for every rank's writer, has the files that need every
    rank's results written (``finalize_fn``: torch DCP's ``.metadata``, megatron's
    ``metadata.json``), hashes what the writers did not, and publishes as ``save_checkpoint``
    does: manifest, rename, ``latest`` last. A writer that failed on any rank fails the
    publish on every rank (``CheckpointError``; the attempt is deleted, ``latest`` unchanged).
    A process that dies before ``publish`` leaves ``latest`` where it was.

    Example (every rank)::

        pending = begin_checkpoint("/ckpt", 20, start_fn, metadata={"recipe": "tiny_moe_cpu"})
        ...                               # training goes on while the files are written
        if pending.written(): ...         # poll at an iteration boundary (agree across ranks first)
        path = pending.publish()          # /ckpt/iter_0000020, now latest
    """

    def __init__(self, comm: _Comm, root: Path, iteration: int, tmp: Path, metadata: dict, lock: _StagingLock,
                 written, finalize_fn: Callable[[], Any]) -> None:
        self.iteration, self.tmp = iteration, tmp
        self._comm, self._root, self._metadata, self._lock = comm, root, metadata, lock
        self._written, self._finalize_fn = written, finalize_fn

    def written(self) -> bool:
        """Whether this rank's background writer has finished (successfully or not)."""
        return self._written.done()

    def publish(self) -> Path:
        """Collective: waits for every rank's writer, then publishes; the published directory."""
        comm, tmp = self._comm, self.tmp
        try:
            shares = _agree(comm, _attempt(comm, self._written.result), f"writing {tmp} in the background")
            written = {rel: entry for share in shares for rel, entry in share.items()}
            _agree(comm, _attempt(comm, self._finalize_fn), f"finishing {tmp}")
            files = _on_rank0(comm, "listing the written files", _list_files, tmp)
            mismatched = [rel for rel, size in files if rel in written and written[rel][0] != size]
            if mismatched or not set(written) <= {rel for rel, _ in files}:
                raise CheckpointError(f"{tmp}: files changed after their writers hashed them: "
                                      f"{mismatched or sorted(set(written) - {rel for rel, _ in files})}")
            rest = [(rel, size) for rel, size in files if rel not in written]  # written at the start or the finish
            my_share = _shares(rest, comm.world_size)[comm.rank]
            hashed = _agree(comm, _attempt(comm, _hash_and_sync, tmp, my_share), "hashing the files")
            digests = {rel: digest for rel, (_, digest) in written.items()}
            digests.update({rel: digest for share in hashed for rel, digest in share.items()})
            final = _on_rank0(comm, f"publishing {tmp}", _publish, self._root, self.iteration, tmp, files,
                              digests, self._metadata, comm.world_size)
        except CheckpointError:
            if comm.rank == 0:
                _discard(tmp)
            raise
        finally:
            self._lock.release()
        return Path(final)


def begin_checkpoint(root: str | os.PathLike, iteration: int, start_fn: Callable[[Path], tuple[Any, Callable]],
                     metadata: dict | None = None, group=None) -> PendingCheckpoint:
    """Collective: starts a checkpoint whose files are written in the background; publish it
    later with ``PendingCheckpoint.publish`` (every rank, at the same point of its program).

    ``start_fn(tmp_dir)`` runs on every rank and does what must happen before training goes
    on (planning, copying tensors to host); it returns ``(written, finalize_fn)``: ``written``
    a ``concurrent.futures.Future`` whose result is ``{relative path: (size, sha256)}`` of the
    files this rank's background writer wrote and fsynced, ``finalize_fn`` a collective that
    writes the files that need every rank's results. ``metadata`` as in ``save_checkpoint``.

    Example (every rank)::

        pending = begin_checkpoint("/ckpt", 20, start_fn, metadata={"recipe": "tiny_moe_cpu"})
        path = pending.publish()
    """
    _check_iteration(iteration)
    comm = _Comm(group)
    root = Path(root)
    metadata = {} if metadata is None else metadata
    lock = _StagingLock()  # only rank 0's is ever acquired; held until the publish
    started = []
    try:
        tmp = Path(_on_rank0(comm, "preparing the save", _create_staging, root, iteration, metadata, lock))
        try:
            # start_fn's value stays local: a Future is not picklable for the all-gather
            _agree(comm, _attempt(comm, lambda: started.append(start_fn(tmp))), f"starting the save into {tmp}")
        except CheckpointError:
            if comm.rank == 0:
                _discard(tmp)
            raise
    except BaseException:
        lock.release()
        raise
    written, finalize_fn = started[0]
    return PendingCheckpoint(comm, root, iteration, tmp, metadata, lock, written, finalize_fn)


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
