"""[Note: async saves]
``async_save`` (Megatron-LM's key): a checkpoint the training step does not wait for.

megatron-core's own machinery splits a torch_dist save in three, and etp keeps its split and
its objects: ``dist_checkpointing.save(..., async_sharded_save=True)`` returns an
``AsyncRequest`` (``preload_fn``: copy the tensors to host; ``async_fn``: write them;
``finalize_fns``: once every rank wrote, the coordinator's ``.metadata`` and
``metadata.json``), planned by megatron's ``save_state_dict_async_plan`` through a
``FileSystemWriterAsync``. What etp does not take is how megatron-core 0.16 *runs* the
request: its callers call ``torch.cuda.synchronize()`` and all-reduce CUDA tensors (CPU torch
raises), and its writer forks worker processes and spawns a multiprocessing Manager, which
etp-train's daemonic CPU ranks may not. So here:

1. synchronously, on every rank (a short stall): the plan (a gather of every rank's plan to
   rank 0) and ``preload_fn``: every tensor this rank writes copied to host memory (pinned,
   from GPU; cloned, on CPU), so the training step may change the parameters right after;
2. in a thread of this process: the file ``__<rank>_0.distcp`` written from those copies
   (torch DCP's own item writer, the bytes the synchronous save writes), then read back
   for its sha256 and fsynced. No collective runs in the thread: the training step owns
   the process groups;
3. at ``PendingCheckpoint.publish`` (``publish.py``, collective, at an iteration boundary
   once every rank's thread is done, or at the next save or the run's exit): the write
   results gathered, rank 0 writes ``.metadata`` and ``metadata.json``, then the manifest,
   the rename and ``latest``, as a synchronous save does. A save in flight when the
   process dies never becomes ``latest``.

``ETP_CHECKPOINT_WRITE_DELAY_S`` makes the background writer sleep that long before it
writes: how the tests hold a save in flight (a slow disk, or a kill mid-write).
"""
from __future__ import annotations

import inspect
import os
import threading
import time
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from .manifest import CheckpointError, _hash_file

__all__ = ["WRITE_DELAY_ENV", "host_staged_strategy", "start_in_background"]

#: seconds the background writer sleeps before it writes (a test hook: a save held in flight)
WRITE_DELAY_ENV = "ETP_CHECKPOINT_WRITE_DELAY_S"


def _write_delay_s() -> float:
    value = os.environ.get(WRITE_DELAY_ENV, "")
    try:
        return float(value) if value else 0.0
    except ValueError:
        raise ValueError(f"{WRITE_DELAY_ENV}={value!r}: expected seconds, e.g. 5") from None


def host_staged_strategy():
    """megatron-core's torch_dist save strategy whose ``async_save`` request runs in this
    process ([Note: async saves]): the same files as ``sync_save_strategy``'s.

    Example::

        request = dist_checkpointing.save(state, tmp_dir, sharded_strategy=host_staged_strategy(),
                                          async_sharded_save=True)
        written, finalize_fn = start_in_background(request)
    """
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType

    class HostStagedWriter(FileSystemWriterAsync):
        """``FileSystemWriterAsync`` with its three process-bound steps done in this process:
        one file per rank, tensors copied to host by ``stage_to_host``, written by ``write``."""

        def __init__(self, path):
            super().__init__(path, thread_count=1)
            # megatron's decentralized plan stores every rank's SavePlan in .metadata (for its
            # metadata cache), objects etp's restricted unpickling refuses to load; the central
            # plan writes the .metadata a synchronous save writes.
            self.can_run_decentralized_global_plan = False
            self.results = None

        def prepare_write_data(self, plan, planner) -> None:
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            bytes_data = [(item, planner.resolve_data(item)) for item in plan.items
                          if item.type == WriteItemType.BYTE_IO]  # already serialized: a snapshot
            tensor_data = [(item, planner.resolve_data(item).detach()) for item in plan.items
                           if item.type != WriteItemType.BYTE_IO]  # views of live tensors until staged
            self.write_buckets = ([(os.path.join(self.checkpoint_dir, name), name, (bytes_data, tensor_data))]
                                  if plan.items else [])
            self.results_queue = None

        def get_save_function_and_args(self):
            if not self.write_buckets:
                return None, None, []
            # megatron's protocol: async_fn_args[1] (the buckets) is replaced by preload_fn()'s value
            return self.write, partial(self.stage_to_host, self.write_buckets), [None, self.write_buckets, None]

        @staticmethod
        def stage_to_host(buckets):
            """Every tensor copied to host memory; returns the buckets holding the copies."""
            staged, cuda = [], False
            for path, name, (bytes_data, tensor_data) in buckets:
                copies = []
                for item, tensor in tensor_data:
                    if tensor.is_cuda:
                        cuda = True
                        copies.append((item, tensor.to("cpu", non_blocking=True)))  # into pinned memory
                    else:
                        copies.append((item, tensor.clone(memory_format=torch.contiguous_format)))
                staged.append((path, name, (bytes_data, copies)))
            if cuda:
                torch.cuda.current_stream().synchronize()  # the copies are complete before the step goes on
            return staged

        def write(self, _rank, buckets, _queue, delay_s: float = 0.0) -> dict:
            """Background: writes the staged buckets, each file fsynced; ``{name: (size, sha256)}``."""
            if delay_s:
                time.sleep(delay_s)
            extra = {}
            if "serialization_format" in inspect.signature(_write_item).parameters:  # torch >= 2.7
                from torch.distributed.checkpoint.filesystem import SerializationFormat

                extra["serialization_format"] = getattr(self, "serialization_format", SerializationFormat.TORCH_SAVE)
            transforms = [self.transforms] if hasattr(self, "transforms") else []
            results, written = [], {}
            for path, name, (bytes_data, tensor_data) in buckets:
                with open(path, "wb") as stream:
                    for item, data in (*bytes_data, *tensor_data):
                        results.append(_write_item(*transforms, stream, data, item, name, **extra))
                written[name] = _hash_file(Path(path), fsync=True)
            self.results = results
            return written

        def retrieve_write_results(self):
            return [] if self.results is None else self.results

    class HostStagedSave(TorchDistSaveShardedStrategy):
        def async_save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            writer = HostStagedWriter(checkpoint_dir)
            planned = save_state_dict_async_plan(
                mcore_to_pyt_state_dict(state, False), writer, None, 0,
                planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                         flatten_state_dict=False))
            save_fn, preload_fn, save_args = writer.get_save_function_and_args()
            return AsyncRequest(save_fn, save_args, [partial(_finalize, *planned[0])], preload_fn=preload_fn)

    return HostStagedSave("torch_dist", 1, thread_count=1)


def _finalize(writer, global_metadata, dist_wrapper) -> None:
    """megatron's ``save_state_dict_async_finalize`` without its CUDA tensor: every rank's write
    results to rank 0, which writes torch DCP's ``.metadata``; its outcome to every rank."""
    from torch.distributed.checkpoint.utils import _get_failure_dict

    results = dist_wrapper.gather_object(writer.retrieve_write_results())
    outcome = None
    if dist_wrapper.is_coordinator:
        failures = _get_failure_dict(results)
        if failures:
            outcome = f"ranks {sorted(failures)} failed to write their files"
        else:
            try:
                writer.finish(global_metadata, results)
            except OSError as exc:
                outcome = f"writing .metadata failed: {exc}"
    outcome = dist_wrapper.broadcast_object(outcome)
    if outcome is not None:
        raise CheckpointError(outcome)


def start_in_background(request) -> tuple[Future, Callable[[], None]]:
    """Runs megatron-core's ``AsyncRequest`` the way its ``AsyncCallsQueue`` would, in this
    process ([Note: async saves]): ``preload_fn`` now (the host copies), ``async_fn`` in a
    daemon thread. Returns ``(written, finalize_fn)`` for ``begin_checkpoint``: a Future of
    ``{file: (size, sha256)}`` of what the thread wrote, and the request's finalize functions.

    Example::

        written, finalize_fn = start_in_background(request)
        written.result(); finalize_fn()      # every rank, at the same point
    """
    args = list(request.async_fn_args)
    if request.preload_fn is not None:
        args[1] = request.preload_fn()
    delay_s = _write_delay_s()
    written: Future = Future()

    def write() -> None:
        try:
            result = {} if request.async_fn is None else request.async_fn(*args, delay_s=delay_s)
            written.set_result(result)
        except BaseException as exc:  # noqa: BLE001 - handed to publish, which every rank agrees on
            written.set_exception(exc)

    threading.Thread(target=write, name="etp-checkpoint-writer", daemon=True).start()

    def finalize_fn() -> None:
        for fn in request.finalize_fns:
            fn()

    return written, finalize_fn
