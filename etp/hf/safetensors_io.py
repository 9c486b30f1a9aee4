"""Safetensors files read and written a tensor at a time, with nothing unpickled.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte range) and the tensors' bytes. ``SafetensorsDir`` reads a checkpoint directory's
headers (through ``model.safetensors.index.json`` when there is one), checks every byte range
against the file's size before anything is read (a truncated download is refused by name),
and reads a tensor, or a range of its rows, with one ``readinto`` into a fresh tensor: memory
holds what was asked for, nothing mapped. ``write_safetensors`` writes the header from the
tensors' specs first and then each tensor's bytes as it arrives, so an export holds one
tensor (or one batch) at a time. The files are the format ``safetensors.torch`` reads and
writes (the header padded with spaces to 8 bytes).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from etp.hf.adapter import ConversionError

__all__ = ["INDEX_NAME", "SafetensorsDir", "TensorSpec", "dtype_name", "write_safetensors"]

INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}
#: files that hold weights as pickles: never opened
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_MAX_HEADER = 100 * 2**20


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``BF16``)."""
    if dtype not in _NAMES:
        raise ConversionError(f"safetensors has no dtype for {dtype}")
    return _NAMES[dtype]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors file: where its bytes are and what they are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    path: Path | None = None
    begin: int = 0  # absolute byte offset in ``path``

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _read_header(path: Path) -> tuple[dict, int]:
    """(the header's tensors, the byte offset of their data) of one file; every byte range
    checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or length > min(_MAX_HEADER, size - 8):
            raise ConversionError(f"{path} is not a safetensors file or is truncated ({size} bytes, header length "
                                  f"{length}): download it again")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ConversionError(f"{path}: its safetensors header is not JSON ({error}): download it again") from None
    data = 8 + length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            why = "quantized weights" if str(info.get("dtype", "")).startswith("F8") else "an unknown dtype"
            raise ConversionError(f"{path}: {name} is {info.get('dtype')} ({why}): etp-convert reads F32, F16, BF16 "
                                  "and integer tensors; convert the checkpoint to bf16 first")
        shape, (begin, end) = tuple(info["shape"]), info["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ConversionError(f"{path}: {name}'s byte range [{begin}, {end}) does not hold a {list(shape)} "
                                  f"{info['dtype']} tensor: the file is damaged, download it again")
        if data + end > size:
            raise ConversionError(f"{path} is truncated: {name} ends at byte {data + end}, the file has {size}: "
                                  "download it again")
        tensors[name] = TensorSpec(name, dtype, shape, path, data + begin)
    return tensors, data


class SafetensorsDir:
    """The tensors of a Hugging Face checkpoint directory's safetensors files.

    Raises ``ConversionError`` (one line) for a directory without safetensors (pickled weights
    are refused, never opened), an index naming a missing file or tensor, a tensor in two
    files, a damaged or truncated file.

    Example::

        weights = SafetensorsDir("Qwen3-30B-A3B")
        weights.specs["model.embed_tokens.weight"].shape
        rows = weights.read("model.layers.0.self_attn.q_proj.weight", (0, 512))
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise ConversionError(f"{index} is not a safetensors index ({error}): download it again") from None
            files = sorted(set(weight_map.values()))
        else:
            weight_map, files = None, sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for pattern in _PICKLES for p in self.directory.glob(pattern))
            if pickles:
                raise ConversionError(f"{self.directory} holds {', '.join(pickles)} (pickled weights) and no "
                                      "*.safetensors: etp-convert reads safetensors only (unpickling can run code); "
                                      "convert the checkpoint to safetensors first")
            raise ConversionError(f"{self.directory} holds no *.safetensors file: point --hf at a Hugging Face "
                                  "checkpoint directory")
        self.specs: dict[str, TensorSpec] = {}
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise ConversionError(f"{index} names {name}, which {self.directory} does not hold: download it")
            for tensor, spec in _read_header(path)[0].items():
                if tensor in self.specs:
                    raise ConversionError(f"{tensor} is in both {self.specs[tensor].path.name} and {name}: one "
                                          "checkpoint per directory")
                self.specs[tensor] = spec
        for tensor, name in (weight_map or {}).items():
            if tensor not in self.specs or self.specs[tensor].path.name != name:
                raise ConversionError(f"{index} puts {tensor} in {name}, whose header does not list it: the "
                                      "checkpoint is incomplete, download it again")

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name``, or its rows ``[start, stop)``: one read of just those bytes."""
        spec = self.specs[name]
        start, stop = rows if rows is not None else (0, spec.shape[0] if spec.shape else 1)
        row_bytes = spec.nbytes // spec.shape[0] if spec.shape else spec.nbytes
        buffer = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        with open(spec.path, "rb") as f:
            f.seek(spec.begin + start * row_bytes)
            if f.readinto(buffer.numpy()) != buffer.numel():
                raise ConversionError(f"{spec.path} ended while reading {name}: the file is truncated, download it "
                                      "again")
        shape = (stop - start, *spec.shape[1:]) if spec.shape else ()
        return buffer.view(spec.dtype).reshape(shape)


def write_safetensors(path: Path, specs: list[TensorSpec], tensors: Iterable[torch.Tensor],
                      metadata: dict[str, str] | None = None) -> int:
    """Writes ``specs``' tensors to ``path`` as one safetensors file: the header first, then
    each tensor of ``tensors`` (in ``specs``' order, each checked against its spec) as it
    comes. Returns the bytes of tensor data written.

    Example::

        specs = [TensorSpec("w", torch.bfloat16, (4, 8))]
        write_safetensors(Path("model.safetensors"), specs, iter([torch.zeros(4, 8, dtype=torch.bfloat16)]))
    """
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    stream: Iterator[torch.Tensor] = iter(tensors)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for spec in specs:
            tensor = next(stream)
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{spec.name}: got a {list(tensor.shape)} {tensor.dtype} tensor for a "
                                 f"{list(spec.shape)} {spec.dtype} entry")
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return offset
