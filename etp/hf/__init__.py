"""Hugging Face checkpoints in and out: ``import_hf``, ``export_hf``, ``recipe_from_hf`` (the
``etp-convert`` command's library) and one adapter per architecture.

Needs the ``hf`` extra only for what reads or builds transformers models (the tests); the
conversions themselves read and write safetensors files with torch alone. Nothing in the
engine or ``import etp`` loads this package.

[Note: Hugging Face checkpoints]
An architecture is an adapter (``etp/hf/adapter.py``; one file per architecture beside it):
its ``config.json`` as recipe model keys, and its tensors as ``Piece``s, each a row range of
one Hugging Face tensor filling one box of one tensor of etp's megatron-core ``GPTModel``
(state-dict names; e.g. ``q_proj``'s rows of query group g go to rows
``g (q/g + 2) kv_channels ...`` of ``linear_qkv``, megatron-core's per-group interleave; an
expert's ``gate_proj`` and ``up_proj`` to rows ``[0, ffn)`` and ``[ffn, 2 ffn)`` of
``fc1_weight[e]``). No tensor is transposed, so a piece is a contiguous element range on
both sides. Nothing outside the adapters knows a Hugging Face tensor name.

Import builds etp-train's own model for the recipe at one rank on the meta device (no weight
allocated; the face hands the builder in, ``etp.train.convert_command.etp_model``, since the
trainer's room sits above this one) and asks megatron-core where each tensor's elements
lie in the checkpoint's global tensors (its sharded state dict; etp's format, see
[Note: ETP training checkpoints]). Each piece becomes the boxes of its elements; the
checkpoint is written by megatron-core's own torch_dist writer, whose planner makes each
box's data (one ranged read of the safetensors file) when torch DCP writes it, and drops it
once written. Memory is bounded by the largest box, which is at most the largest Hugging
Face tensor (the embedding, or one expert's projection): the format holds each piece as its
own chunk, and loading reshards chunks by box intersection, so the checkpoint loads at any
TP / ETP / EP layout like any etp checkpoint. The checkpoint holds weights only (no
optimizer state; manifest metadata ``kind: weights``) plus the original ``config.json`` and
``generation_config.json`` in its manifest; etp-train starts from it with ``finetune: true``.

Export reads the checkpoint (saved at any layout) back box by box into the Hugging Face
tensors they make up, a batch of about ``batch_bytes`` at a time (at least one tensor), and
writes each safetensors shard header first, then its tensors' bytes in order: memory is one
batch. ``config.json`` is the carried one with every architecture key set from the recipe
(transformers 4.x spelling, which 5.x reads too); without one (a checkpoint etp-train
trained from scratch) ``--model-type`` names the architecture. Nothing in a checkpoint
directory is executed: weights come only from safetensors files (pickled weights are
refused, never opened), and a ``config.json`` pointing at code (``auto_map``,
``trust_remote_code``) is refused.
"""
from __future__ import annotations

__all__ = ["ConversionError", "adapter_for", "export_hf", "import_hf", "recipe_from_hf"]

_HOMES = {"ConversionError": "etp.hf.adapter", "adapter_for": "etp.hf.architectures",
          "export_hf": "etp.hf.convert", "import_hf": "etp.hf.convert", "recipe_from_hf": "etp.hf.convert"}


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'etp.hf' has no attribute {name!r}")
