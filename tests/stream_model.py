"""A model of CUDA streams and events for the CPU suite, so that a CPU test sees what the GPU
sees about ordering ([Note: ETP streams] in etp/streams.py).

On CPU, etp's side streams and events are None and every stream operation is a no-op: a
gather issued on the AG stream without waiting for the optimizer's update of its shard still
reads the updated shard, because there is only one order. ``installed()`` replaces the seam of
``etp.streams`` with model streams and events and watches every torch op of the process (a
``TorchDispatchMode``), and raises ``UnorderedAccess`` at the first access the streams do not
order.

What it models
--------------
* Streams. One compute stream (the device's current stream) and the side streams
  ``StreamRegistry.get`` hands out (an AG and an RS stream per chain class and group). Every
  torch op runs on the *current* stream: the compute stream, or the side stream that
  ``CommStreams.use`` made current. Ops of one stream are ordered by program order.
* Events. ``current_stream_event`` records an event on the current stream;
  ``CommStreams.wait(stream, event)`` and ``current_stream(...).wait_event(event)`` make a
  stream wait on it. A work handle of the NCCL / gloo transport (``etp.transport.nccl``)
  counts as an event recorded on the stream that issued its collective, right behind it, and
  its ``wait()`` makes the current stream wait on that event (what NCCL's ``work.wait()``
  does). Nothing else orders two streams; in particular a new side stream has waited for
  nothing (torch's pool streams do not synchronize with the default stream).
* Accesses. An op reads its tensor arguments, writes those its schema marks written
  (``Tensor(a!)``; a c10d collective writes every tensor argument but its input), and writes
  each output that is a new storage. An op that only makes a view (an argument aliased,
  not written: ``detach``, ``view``, slicing) accesses nothing.

Each stream keeps a vector clock: for every stream, the last of its ops this one is ordered
after (its own last op; through events, the ops of the others). An access by stream X to a
storage is *ordered* after an earlier access by stream W at op t when W is X or X's clock
holds W at t or later. A read must be ordered after the storage's last write; a write after
its last write and every read since. Anything else is a race, and the model raises
``UnorderedAccess`` (naming both ops) before the op runs, whatever order the hardware would
have picked: a side stream is taken to run as early as its waits allow (it reads every
tensor as of the last event it waited on, so a tensor changed since then is a read without
a wait), and its results to land as late as allowed (a consumer that reads them before
waiting on the handle reads garbage). No interleaving is more hostile.

What it does not model
----------------------
* Bytes: the unit is a storage, so two tensors in one storage conflict even where their bytes
  do not (a pool of shard homes: the copy-engine transports' gloo fake in
  tests/transport/test_transport_fake.py all-gathers its whole pool on the AG stream, and under
  this model the next staging of any home in it is reported).
* The caching allocator: a freed storage is gone and a new one is new, so a buffer reused
  across streams without ``record_stream`` is not caught.
* The host: reads that are no torch op (``tolist``, ``numpy``, pickling; ``item`` is one and is
  checked as a read on the current stream), device-wide synchronization, and more than one
  host thread (the process has one current stream; the autograd engine runs CPU backward on
  the calling thread).
* Copy engines and stream memory operations (flag waits and writes) of the copy-engine
  transports: tests/transport/test_push_protocol.py models those. ``current_raw_stream`` is
  left alone.
* CUDA graphs, more than one device, and timing: a race is reported whether or not real
  hardware would lose it.
* Writes outside the dispatcher: gloo's worker thread fills a collective's output some time
  after the call; the model stamps that write at the call (where NCCL enqueues its kernel).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ModelEvent", "ModelStream", "StreamModel", "UnorderedAccess", "installed"]

# Modules that bind a seam function of etp.streams by name; ``installed`` imports them so
# that every such binding exists when it patches (and patches any other etp module too).
_SEAM_USERS = ("etp.gather_side", "etp.reduce_side", "etp.transport.base", "etp.transport.nccl",
               "etp.transport.push_reduce", "etp.transport.copy_engine")
_SEAM_FUNCTIONS = ("current_stream_event", "current_stream")


class UnorderedAccess(RuntimeError):
    """Two accesses to one storage from streams that no event orders."""


@dataclass(eq=False)
class ModelStream:
    """A stream of the model: its name and its vector clock (stream -> op index)."""

    name: str
    clock: dict = field(default_factory=dict)
    ops: int = 0  # ops issued on it
    waits: int = 0  # events it waited on

    def wait_event(self, event: ModelEvent | None) -> None:
        """Orders this stream's later ops after everything ``event`` was recorded behind."""
        if event is None:
            return
        self.waits += 1
        for stream, op in event.clock.items():
            if self.clock.get(stream, 0) < op:
                self.clock[stream] = op

    def __repr__(self) -> str:
        return f"ModelStream({self.name!r})"


@dataclass(eq=False)
class ModelEvent:
    """An event: the clock of the stream it was recorded on, at the recording."""

    stream: ModelStream
    clock: dict


@dataclass
class _Storage:
    """What the model knows of one storage: its last write and the reads since, as
    (stream, op index, op name)."""

    ref: StorageWeakRef  # keeps the StorageImpl's address (the key) from being reused
    write: tuple | None
    reads: dict = field(default_factory=dict)  # stream -> (op index, op name)


_READ, _WRITE, _VIEW = "read", "write", "view"


def _argument_kinds(func) -> dict[str, str]:
    """How ``func`` accesses each argument, by name in schema order (see the module doc)."""
    collective = func.namespace == "c10d"
    kinds = {}
    for argument in func._schema.arguments:
        alias = argument.alias_info
        if alias is not None:
            kinds[argument.name] = _WRITE if alias.is_write else _VIEW
        elif collective and not argument.name.startswith("input"):
            kinds[argument.name] = _WRITE
        else:
            kinds[argument.name] = _READ
    return kinds


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


class StreamModel(TorchDispatchMode):
    """The model (see the module doc); enter it through ``installed()``.

    Args:
        drop_waits_on: names prefixes of side streams whose ``CommStreams.wait`` calls are
            ignored, as if the line were deleted (negative controls: e.g. ``("ag",)``).
    """

    def __init__(self, drop_waits_on: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.drop_waits_on = drop_waits_on
        self.compute = ModelStream("compute")
        self.current = self.compute
        self.side_streams: list[ModelStream] = []
        self._ops = 0  # global op index: every op is one step of its stream
        self._storages: dict[int, _Storage] = {}
        self._kinds: dict = {}
        self._created_since_prune = 0

    # ------------------------------------------------------------------ streams and events
    def new_stream(self, name: str) -> ModelStream:
        stream = ModelStream(name)
        self.side_streams.append(stream)
        return stream

    @contextlib.contextmanager
    def use(self, stream: ModelStream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def record_event(self) -> ModelEvent:
        return ModelEvent(self.current, dict(self.current.clock))

    def stream_wait(self, stream: ModelStream, event: ModelEvent | None) -> None:
        """``CommStreams.wait``: unless ``drop_waits_on`` names the stream."""
        if not stream.name.startswith(self.drop_waits_on):
            stream.wait_event(event)

    # ------------------------------------------------------------------ accesses
    def _storage(self, tensor: torch.Tensor) -> _Storage | None:
        """The record of ``tensor``'s storage; None when the model has not seen it written
        (it existed before the model was installed: every stream may read it)."""
        record = self._storages.get(tensor.untyped_storage()._cdata)
        if record is not None and record.ref.expired():
            return None
        return record

    def _ordered(self, stream: ModelStream, writer: ModelStream, op: int) -> bool:
        return writer is stream or stream.clock.get(writer, 0) >= op

    def _race(self, stream: ModelStream, verb: str, tensor: torch.Tensor, op_name: str,
              other: ModelStream, other_verb: str, other_op: int, other_name: str) -> UnorderedAccess:
        waited = stream.clock.get(other, 0)
        what = "a read without a wait" if verb == "reads" else "a write without a wait"
        return UnorderedAccess(
            f"stream model: {what}: stream '{stream.name}' {verb} a {tuple(tensor.shape)} "
            f"{str(tensor.dtype).removeprefix('torch.')} tensor in op #{self._ops} ({op_name}) that "
            f"stream '{other.name}' {other_verb} in op #{other_op} ({other_name}), after the last op of "
            f"'{other.name}' that '{stream.name}' has waited for (#{waited}); on a GPU '{stream.name}' may "
            f"run before it (record an event on '{other.name}' and make '{stream.name}' wait on it)"
        )

    def _check(self, stream: ModelStream, kind: str, tensor: torch.Tensor, op_name: str) -> None:
        record = self._storage(tensor)
        if record is None:
            return
        verb = "reads" if kind == _READ else "writes"
        if record.write is not None:
            writer, op, name = record.write
            if not self._ordered(stream, writer, op):
                raise self._race(stream, verb, tensor, op_name, writer, "wrote", op, name)
        if kind == _WRITE:
            for reader, (op, name) in record.reads.items():
                if not self._ordered(stream, reader, op):
                    raise self._race(stream, verb, tensor, op_name, reader, "read", op, name)

    def _note(self, stream: ModelStream, kind: str, tensor: torch.Tensor, op_name: str) -> None:
        storage = tensor.untyped_storage()
        record = self._storages.get(storage._cdata)
        if record is None or record.ref.expired():
            record = self._storages[storage._cdata] = _Storage(StorageWeakRef(storage), None)
            self._created()
        if kind == _WRITE:
            record.write, record.reads = (stream, self._ops, op_name), {}
        else:
            record.reads[stream] = (self._ops, op_name)

    def _created(self) -> None:
        # Records of freed storages pin only their (empty) StorageImpl; drop them now and then.
        self._created_since_prune += 1
        if self._created_since_prune >= 4096:
            self._created_since_prune = 0
            self._storages = {k: r for k, r in self._storages.items() if not r.ref.expired()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kinds = self._kinds.get(func)
        if kinds is None:
            kinds = self._kinds[func] = _argument_kinds(func)
        stream, op_name = self.current, str(func)
        self._ops += 1
        stream.ops += 1
        stream.clock[stream] = self._ops
        accesses = []
        for name, value in [*zip(kinds, args), *kwargs.items()]:  # positional: schema order
            kind = kinds.get(name, _READ)
            if kind != _VIEW:
                accesses.extend((kind, t) for t in _tensors(value))
        accesses.sort(key=lambda access: access[0] != _READ)  # a stale read is the likelier report
        for kind, tensor in accesses:
            self._check(stream, kind, tensor, op_name)
        for kind, tensor in accesses:
            self._note(stream, kind, tensor, op_name)
        out = func(*args, **kwargs)
        for result, value in zip(func._schema.returns, out if isinstance(out, tuple) else (out,)):
            if result.alias_info is None:
                for tensor in _tensors(value):
                    # A new storage is written by its op; one the model knows already was
                    # handed back (a collective returns its output), accessed above.
                    if self._storage(tensor) is None:
                        self._note(stream, _WRITE, tensor, op_name)
        return out


class _Patches:
    """setattr with undo."""

    def __init__(self) -> None:
        self._undo: list = []

    def set(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._undo:
            owner, name, value = self._undo.pop()
            setattr(owner, name, value)


@contextlib.contextmanager
def installed(model: StreamModel | None = None):
    """Yields ``model`` (a new one by default) with the seam of ``etp.streams`` patched to it
    and its dispatch mode entered; restores everything on exit.

    Example::

        with installed() as model:
            train_parity(ctx, config)
        assert all(s.ops for s in model.side_streams)
    """
    import importlib

    for name in _SEAM_USERS:
        importlib.import_module(name)
    import etp.streams as streams
    import etp.transport.nccl as nccl

    model = model or StreamModel()
    patches = _Patches()
    original = {name: getattr(streams, name) for name in _SEAM_FUNCTIONS}
    replacement = {
        "current_stream_event": lambda device=None: model.record_event(),
        "current_stream": lambda device=None: model.current,
    }
    # Every binding of a seam function in etp: the module's own and each `from ..streams import`.
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "etp" or module_name.startswith("etp.")):
            continue
        for name in _SEAM_FUNCTIONS:
            if module.__dict__.get(name) is original[name]:
                patches.set(module, name, replacement[name])

    original_get = streams.StreamRegistry.get
    made_in: list = []  # (registry, key) of every model CommStreams, forgotten on exit
    original_use = streams.CommStreams.use
    original_wait = streams.CommStreams.wait

    def get(registry, chain_class, ranks, device):
        found = original_get(registry, chain_class, ranks, device)
        if found.ag is not None:
            return found
        label = f"{chain_class}{list(ranks)}"
        made = streams.CommStreams(model.new_stream(f"ag:{label}"), model.new_stream(f"rs:{label}"))
        registry._streams[(chain_class, ranks, device)] = made
        made_in.append((registry, (chain_class, ranks, device)))
        return made

    def use(self, stream):
        return model.use(stream) if isinstance(stream, ModelStream) else original_use(self, stream)

    def wait(stream, event):
        if isinstance(stream, ModelStream):
            model.stream_wait(stream, event)
        else:
            original_wait(stream, event)

    patches.set(streams.StreamRegistry, "get", get)
    patches.set(streams.CommStreams, "use", use)
    patches.set(streams.CommStreams, "wait", staticmethod(wait))

    # NCCL's work.wait() makes the current stream wait for the collective's stream.
    work_init, work_wait = nccl._WorkHandle.__init__, nccl._WorkHandle.wait

    def init(handle, *args, **kwargs):
        work_init(handle, *args, **kwargs)
        handle.model_event = model.record_event()  # behind the collective, on its stream

    def wait_work(handle):
        model.current.wait_event(getattr(handle, "model_event", None))
        return work_wait(handle)

    patches.set(nccl._WorkHandle, "__init__", init)
    patches.set(nccl._WorkHandle, "wait", wait_work)
    try:
        with model:
            yield model
    finally:
        patches.undo()
        for registry, key in made_in:  # a runtime made inside gets its CPU streams back
            registry._streams.pop(key, None)
