"""etp.megatron.checkpoint on real megatron-core dist_checkpointing files (2 gloo ranks).

* round trip: two iterations saved and loaded back through ``dist_checkpointing``;
* crash safety: a rank SIGKILLs itself mid-save (rank 1 in the middle of writing its shard;
  rank 0 just before the directory rename; rank 0 just before the ``latest`` update); the
  previous checkpoint still verifies and loads with identical values, ``latest`` still names
  it, and the next save cleans up and publishes;
* verification: truncated, byte-flipped, missing, extra and symlinked files are refused;
* unpickling: ``.metadata``, ``common.pt`` (megatron-core 0.19 writes none but reads one it
  finds) and a ShardedObject replaced by pickles whose ``__reduce__`` creates a marker file
  are refused, by the manifest and, with the manifest rewritten by the attacker, by the
  restricted unpicklers themselves; the marker never appears (and does appear when the same
  file is loaded the unprotected way, which shows the payload is live).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import signal
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed

from etp.megatron.checkpoint import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    find_latest,
    iteration_dir,
    list_checkpoints,
    load_checkpoint,
    safe_unpickling,
    save_checkpoint,
    verify_checkpoint,
)

pytest.importorskip("megatron.core")
# Single-process DCP loads (no_dist) announce that they assume a single process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

WORLD = 2
KILLS = ("rank1_mid_write", "rank0_before_rename", "rank0_before_latest")  # where a rank dies
MARKER_ENV = "ETP_TEST_MARKER"
METADATA = {"recipe": "test_checkpoint_io", "layout": {"etp_size": 2, "tp_size": 1}}


class _Payload:
    """Unpickling this runs code: it creates the file named by $ETP_TEST_MARKER."""

    def __reduce__(self):
        return (exec, (f"import os; open(os.environ[{MARKER_ENV!r}], 'w').close()",))


# --------------------------------------------------------------------------------------
# What the ranks save and load


def _expected_w(iteration: int) -> torch.Tensor:
    """The full (4, 4) tensor "w" of ``iteration``; rank r holds rows 2r, 2r+1."""
    rows = [torch.arange(8, dtype=torch.float32).reshape(2, 4) + 100 * r for r in range(WORLD)]
    return torch.cat(rows) + 1000 * iteration


def _sharded_state(rank: int, iteration: int, payload=None) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    local = _expected_w(iteration)[2 * rank : 2 * rank + 2].clone()
    obj = payload if payload is not None else {"rank": rank, "iteration": iteration}
    return {
        "w": ShardedTensor.from_rank_offsets("w", local, (0, rank, WORLD)),
        "obj": ShardedObject("obj", obj, (WORLD,), (rank,)),
        "iteration": iteration,  # goes to common.pt
    }


def _empty_state(rank: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, rank, WORLD)),
        "obj": ShardedObject("obj", None, (WORLD,), (rank,)),
    }


def _sync_torch_dist_strategy():
    from etp.megatron.checkpoint import sync_save_strategy  # see its docstring

    return sync_save_strategy()


def _megatron_save_fn(rank: int, iteration: int, payload=None):
    from megatron.core import dist_checkpointing

    def save_fn(tmp_dir):
        dist_checkpointing.save(_sharded_state(rank, iteration, payload), tmp_dir,
                                sharded_strategy=_sync_torch_dist_strategy())

    return save_fn


def _megatron_load(rank: int):
    """load_fn for load_checkpoint: megatron's own loader; returns (local w, obj, common)."""
    from megatron.core import dist_checkpointing

    def load_fn(path):
        state = dist_checkpointing.load(_empty_state(rank), path)
        return state["w"], state["obj"], state["iteration"]

    return load_fn


def _read_full(path: Path) -> dict:
    """Single-process load_fn: torch DCP reads the whole tensor and both ShardedObjects."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.zeros(4, 4), **{f"obj/shard_{r}_{WORLD}": io.BytesIO() for r in range(WORLD)}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def _assert_holds_iteration(root: Path, iteration: int) -> None:
    """``iteration`` under ``root`` verifies and loads (single process) with its exact values."""
    verify_checkpoint(iteration_dir(root, iteration))
    loaded = load_checkpoint(root, _read_full, iteration=iteration)
    assert loaded.metadata == METADATA
    assert torch.equal(loaded.result["w"], _expected_w(iteration))
    for r in range(WORLD):
        assert loaded.result[f"obj/shard_{r}_{WORLD}"] == [{"rank": r, "iteration": iteration}]


# --------------------------------------------------------------------------------------
# Distributed bodies (run on 2 spawned gloo ranks)


def _save_and_load(ctx, root, evil_root, marker, killed_roots):
    root, evil_root = Path(root), Path(evil_root)
    if ctx.rank == 0:  # the leftover of a crashed save (no live lock): the next save removes it
        (root / ".tmp_iter_0000005_0123abcd").mkdir(parents=True)
        (root / ".tmp_iter_0000005_0123abcd" / "__0_0.distcp").write_bytes(b"partial")
    dist.barrier()
    out = {}
    out["path10"] = str(save_checkpoint(root, 10, _megatron_save_fn(ctx.rank, 10), METADATA))
    save_checkpoint(root, 20, _megatron_save_fn(ctx.rank, 20), METADATA)
    out["latest"] = load_checkpoint(root, _megatron_load(ctx.rank))
    out["iter10"] = load_checkpoint(root, _megatron_load(ctx.rank), iteration=10)

    # A ShardedObject whose data is a code-running pickle, saved by megatron itself (so the
    # manifest is valid): only the weights-only torch.load of safe_unpickling stands between
    # it and DCP's `torch.load(weights_only=False)`.
    save_checkpoint(evil_root, 30, _megatron_save_fn(ctx.rank, 30, payload=_Payload()), METADATA)
    os.environ[MARKER_ENV] = marker
    try:
        load_checkpoint(evil_root, _megatron_load(ctx.rank))
        out["evil"] = "loaded"
    except CheckpointError as exc:
        out["evil"] = f"{type(exc).__name__}: {exc}"

    # In the same ranks (a spawn costs more than all of this): the next save into copies of
    # the killed roots. A failure here fails its own test only (reported, not raised).
    try:
        out["recover"] = _recover(ctx, killed_roots)
    except Exception:  # noqa: BLE001 - reported to test_the_next_save_after_a_kill_cleans_up_and_publishes
        out["recover"] = traceback.format_exc()
    return out


def _kill_during_save(ctx, root, base_root, where):
    """Saves iteration 10 into ``root`` (rank 0 then copies it to ``base_root``: what the root
    held before the killed save), then iteration 20; one rank SIGKILLs itself at ``where``."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    save_checkpoint(root, 10, _megatron_save_fn(ctx.rank, 10), METADATA)
    if ctx.rank == 0:
        shutil.copytree(root, base_root)
    dist.barrier()

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "rank1_mid_write" and ctx.rank == 1:
        real_write_item = dcp_fs._write_item

        def write_one_item_then_die(transforms, stream, *args, **kwargs):
            result = real_write_item(transforms, stream, *args, **kwargs)
            stream.flush()
            os.fsync(stream.fileno())  # the first item is on disk, the shard is incomplete
            die()
            return result

        dcp_fs._write_item = write_one_item_then_die
    if where == "rank0_before_rename" and ctx.rank == 0:
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            if Path(src).name.startswith(".tmp_iter"):  # the publish rename, not DCP's own
                die()
            return real_rename(src, dst, *args, **kwargs)

        os.rename = rename
    if where == "rank0_before_latest" and ctx.rank == 0:
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if Path(dst).name == LATEST_NAME:
                die()
            return real_replace(src, dst, *args, **kwargs)

        os.replace = replace
    save_checkpoint(root, 20, _megatron_save_fn(ctx.rank, 20), METADATA)
    return "survived"


def _recover(ctx, roots):
    """After a kill: megatron loads iteration 10 unchanged, then iteration 20 saves cleanly."""
    out = []
    for root in map(Path, roots):
        before = load_checkpoint(root, _megatron_load(ctx.rank))
        save_checkpoint(root, 20, _megatron_save_fn(ctx.rank, 20), METADATA)
        after = load_checkpoint(root, _megatron_load(ctx.rank))
        out.append((before, after, sorted(p.name for p in root.iterdir())))
    return out


# --------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """{where: (root, base)}: a root holding iteration 10 after a save of iteration 20 was
    killed at ``where``, and a copy of that root taken just before the killed save."""
    roots = {}
    for where in KILLS:
        root, base = tmp_path_factory.mktemp(where) / "root", tmp_path_factory.mktemp(where) / "base"
        with pytest.raises(AssertionError) as info:
            run_distributed(_kill_during_save, WORLD, str(root), str(base), where, timeout=60)
        dead_rank = where[4]
        assert f"rank {dead_rank} hung or died (exit code -9)" in str(info.value), str(info.value)
        roots[where] = (root, base)
    return roots


@pytest.fixture(scope="module")
def saved(tmp_path_factory, killed):
    """Runs the 2-rank save/load once (with the next save into copies of the killed roots);
    returns the roots and the per-rank results."""
    base = tmp_path_factory.mktemp("ckpt")
    roots = {name: base / name for name in ("main", "evil")}
    for where in KILLS:  # copies: the kill tests read the killed roots as the kill left them
        roots[f"recover_{where}"] = base / f"recover_{where}"
        shutil.copytree(killed[where][0], roots[f"recover_{where}"])
    marker = base / "marker_byteio"
    results = run_distributed(_save_and_load, WORLD, str(roots["main"]), str(roots["evil"]), str(marker),
                              [str(roots[f"recover_{where}"]) for where in KILLS], timeout=120)
    return roots, results, marker


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy of the root holding iterations 10 and 20 (latest), to tamper with."""
    root = tmp_path / "root"
    shutil.copytree(saved[0]["main"], root)
    return root


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "marker"
    monkeypatch.setenv(MARKER_ENV, str(path))
    return path


def _common_files() -> set[str]:
    """The file megatron-core writes the common (non-tensor) state to: ``common.pt`` up to 0.18;
    none from 0.19 on, which keeps it as a ShardedObject inside the shards."""
    from megatron.core.dist_checkpointing import serialization

    return set() if hasattr(serialization, "_legacy_common_state_exists") else {"common.pt"}


def _rewrite_manifest_entry(directory: Path, rel: str) -> None:
    """What an attacker who can write the checkpoint does: re-list the file he replaced."""
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    data = (directory / rel).read_bytes()
    manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


# --------------------------------------------------------------------------------------
# Round trip


def test_round_trip_through_megatron(saved):
    roots, results, _ = saved
    root = roots["main"]
    assert find_latest(root) == 20 and list_checkpoints(root) == [10, 20]
    for rank, out in enumerate(results):
        assert out["path10"] == str(iteration_dir(root, 10))
        for key, iteration in (("latest", 20), ("iter10", 10)):
            loaded = out[key]
            w, obj, common_iteration = loaded.result
            assert loaded.iteration == iteration and loaded.metadata == METADATA
            assert torch.equal(w, _expected_w(iteration)[2 * rank : 2 * rank + 2])
            assert obj == {"rank": rank, "iteration": iteration}
            assert common_iteration == iteration
    manifest = verify_checkpoint(iteration_dir(root, 20))
    assert manifest["iteration"] == 20 and manifest["world_size"] == WORLD
    assert manifest["metadata"] == METADATA and manifest["etp_version"]
    assert set(manifest["files"]) == {".metadata", "metadata.json", "__0_0.distcp", "__1_0.distcp",
                                      *_common_files()}
    # The crashed save's leftover is gone; nothing but the published checkpoints remains.
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000010", "iter_0000020", LATEST_NAME]


def test_single_process_load_of_a_two_rank_checkpoint(ckpt):
    _assert_holds_iteration(ckpt, 20)


# --------------------------------------------------------------------------------------
# Crash safety: real SIGKILLs


@pytest.mark.parametrize("where", KILLS)
def test_a_killed_save_leaves_the_previous_checkpoint_loadable(killed, where):
    root, base = killed[where]
    assert find_latest(root) == 10
    _assert_holds_iteration(root, 10)
    # Bit for bit what was there before the failed save.
    for rel in verify_checkpoint(iteration_dir(root, 10))["files"]:
        before = (iteration_dir(base, 10) / rel).read_bytes()
        assert (iteration_dir(root, 10) / rel).read_bytes() == before
    leftovers = [p for p in root.iterdir() if p.name.startswith(".tmp_iter_0000020_") and p.is_dir()]
    if where == "rank0_before_latest":
        # Published but never committed: complete, ignored by find_latest / default loads.
        assert not leftovers and list_checkpoints(root) == [10, 20]
        verify_checkpoint(iteration_dir(root, 20))
    else:
        assert len(leftovers) == 1 and list_checkpoints(root) == [10]
        assert not iteration_dir(root, 20).exists()
    if where == "rank1_mid_write":
        # Rank 1 died with its shard half written (its ShardedObject, not its tensor).
        partial = leftovers[0] / "__1_0.distcp"
        full = iteration_dir(root, 10) / "__1_0.distcp"
        assert 0 < partial.stat().st_size < full.stat().st_size
        assert not (leftovers[0] / MANIFEST_NAME).exists()


def test_the_next_save_after_a_kill_cleans_up_and_publishes(saved):
    # _recover ran on copies of the killed roots in the fixture's ranks.
    for rank, out in enumerate(saved[1]):
        assert not isinstance(out["recover"], str), f"rank {rank} raised:\n{out['recover']}"
        for where, (before, after, names) in zip(KILLS, out["recover"], strict=True):
            assert before.iteration == 10 and after.iteration == 20, where
            assert torch.equal(before.result[0], _expected_w(10)[2 * rank : 2 * rank + 2])
            assert torch.equal(after.result[0], _expected_w(20)[2 * rank : 2 * rank + 2])
            assert names == ["iter_0000010", "iter_0000020", LATEST_NAME], (where, names)


# --------------------------------------------------------------------------------------
# Verification


def test_truncated_shard_is_refused_even_without_hashing(ckpt):
    shard = iteration_dir(ckpt, 20) / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    for verify_hashes in (True, False):
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(ckpt, _read_full, verify_hashes=verify_hashes)
        message = str(info.value)
        assert "__1_0.distcp: size" in message and "truncated" in message
        assert "iteration=10" in message  # points at the previous checkpoint


def test_byte_flipped_shard_is_refused(ckpt):
    shard = iteration_dir(ckpt, 20) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: sha256 mismatch") as info:
        load_checkpoint(ckpt, _read_full)
    assert "iteration=10" in str(info.value)
    # Documented trade-off: without hashing only sizes are checked.
    assert load_checkpoint(ckpt, lambda path: "read", verify_hashes=False).result == "read"


@pytest.mark.parametrize("damage", ["missing_file", "extra_file", "symlink", "no_manifest",
                                    "bad_manifest", "unsafe_name"])
def test_incomplete_or_altered_directory_is_refused(ckpt, damage):
    directory = iteration_dir(ckpt, 20)
    expected = {
        "missing_file": "metadata.json: missing",
        "extra_file": "evil.py: not listed in the manifest",
        "symlink": "not a regular file",
        "no_manifest": f"{MANIFEST_NAME}: missing",
        "bad_manifest": f"{MANIFEST_NAME}: unreadable",
        "unsafe_name": "unsafe file name '../iter_0000010/metadata.json'",
    }[damage]
    if damage == "missing_file":
        (directory / "metadata.json").unlink()
    elif damage == "extra_file":
        (directory / "evil.py").write_text("print('hi')")
    elif damage == "symlink":
        (directory / "metadata.json").unlink()
        (directory / "metadata.json").symlink_to(iteration_dir(ckpt, 10) / "metadata.json")
    elif damage == "no_manifest":
        (directory / MANIFEST_NAME).unlink()
    elif damage == "bad_manifest":
        (directory / MANIFEST_NAME).write_text("{not json")
    else:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
        manifest["files"]["../iter_0000010/metadata.json"] = manifest["files"]["metadata.json"]
        (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(directory)
    assert expected in str(info.value)
    assert "iteration=10" in str(info.value)


def test_latest_marker_problems(ckpt):
    (ckpt / LATEST_NAME).write_text("twenty\n")
    with pytest.raises(CheckpointError, match="expected an iteration number"):
        find_latest(ckpt)
    (ckpt / LATEST_NAME).write_text("30\n")  # names a directory that does not exist
    with pytest.raises(CheckpointError, match=r"no such checkpoint directory[\s\S]*iteration=20"):
        load_checkpoint(ckpt, _read_full)
    (ckpt / LATEST_NAME).unlink()
    assert find_latest(ckpt) is None
    with pytest.raises(CheckpointError, match="no checkpoint to load"):
        load_checkpoint(ckpt, _read_full)


def test_refuses_to_overwrite_the_latest_checkpoint(ckpt):
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        save_checkpoint(ckpt, 20, lambda tmp: None)
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp_")]


def test_latest_never_moves_backwards(ckpt):
    with pytest.raises(CheckpointError, match="would move it backwards"):
        save_checkpoint(ckpt, 15, lambda tmp: None, METADATA)
    assert find_latest(ckpt) == 20 and list_checkpoints(ckpt) == [10, 20]
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp_")]


def test_failing_save_fn_publishes_nothing(ckpt):
    def half_save(tmp_dir):
        (tmp_dir / "__0_0.distcp").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(ckpt, 30, half_save, METADATA)
    assert find_latest(ckpt) == 20 and list_checkpoints(ckpt) == [10, 20]
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000010", "iter_0000020", LATEST_NAME]


# --------------------------------------------------------------------------------------
# Unpickling attacks


def _megatron_read_metadata(path):
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
    )

    return TorchDistLoadShardedStrategy().load_tensors_metadata(path)


def _megatron_read_common(path):
    from megatron.core.dist_checkpointing import load_common_state_dict

    return load_common_state_dict(str(path))


def _plant_metadata(directory: Path) -> None:
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(_Payload(), f)


def _plant_common(directory: Path) -> None:
    torch.save({"iteration": _Payload()}, directory / "common.pt")


ATTACKS = {
    ".metadata": (_plant_metadata, _megatron_read_metadata, "refusing to unpickle global builtins.exec"),
    "common.pt": (_plant_common, _megatron_read_common, r"torch\.load\(weights_only=True\) refused"),
}


@pytest.mark.parametrize("target", sorted(ATTACKS))
def test_code_running_pickle_is_refused_by_the_manifest(ckpt, marker, target):
    plant, megatron_reader, _ = ATTACKS[target]
    plant(iteration_dir(ckpt, 20))
    # a replaced file (megatron-core 0.16: common.pt is one) or an added one (0.19 still reads a
    # common.pt it finds, but writes the common state into the shards)
    with pytest.raises(CheckpointError, match=rf"{target}: (size|sha256|not listed)"):
        load_checkpoint(ckpt, megatron_reader)
    assert not marker.exists()


@pytest.mark.parametrize("target", sorted(ATTACKS))
def test_code_running_pickle_is_refused_by_the_unpickler(ckpt, marker, target, monkeypatch):
    plant, megatron_reader, refusal = ATTACKS[target]
    directory = iteration_dir(ckpt, 20)
    plant(directory)
    _rewrite_manifest_entry(directory, target)
    verify_checkpoint(directory)  # the manifest check is bypassed
    # torch >= 2.6 defaults torch.load to weights_only=True; this variable (honoured when the
    # caller passes nothing, as megatron's load_common does) undoes that. It must not matter.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError, match=refusal) as info:
        load_checkpoint(ckpt, megatron_reader)
    assert target in str(info.value)
    assert not marker.exists()
    # Positive control: megatron's reader without etp runs the payload (and then may choke
    # on what it got back: exec returns None).
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")
        megatron_reader(directory)
    assert marker.exists()


def test_code_running_sharded_object_is_refused(saved, marker):
    roots, results, byteio_marker = saved
    for out in results:  # megatron's dist_checkpointing.load on 2 ranks, in the fixture
        assert "torch.load(weights_only=True) refused" in out["evil"], out["evil"]
        assert "Unsupported global: GLOBAL exec" in out["evil"]
        assert out["evil"].startswith("CheckpointError: refused to load")
    assert not byteio_marker.exists()
    with pytest.raises(CheckpointError, match=r"weights_only=True\) refused") as info:
        load_checkpoint(roots["evil"], _read_full)
    assert "Unsupported global: GLOBAL exec" in str(info.value)
    assert not marker.exists()
    # Positive control: torch DCP's own load_bytes is torch.load(weights_only=False).
    _read_full(iteration_dir(roots["evil"], 30))
    assert marker.exists()


def test_safe_unpickling_restores_the_loaders():
    import torch.distributed.checkpoint.filesystem as dcp_fs

    real_load = torch.load
    with safe_unpickling():
        assert torch.load is not real_load and dcp_fs.pickle is not pickle
        with pytest.raises(RuntimeError, match="not reentrant"), safe_unpickling():
            pass
    assert torch.load is real_load and torch.serialization.load is real_load
    assert dcp_fs.pickle is pickle
