"""``Batch``: one micro-batch as a language model's forward and loss read it, and the
per-document attention mask.

[Note: per-document masks]
megatron-core's ``GPTDataset`` marks documents with the tokenizer's end-of-document token (eod):
``reset_attention_mask`` stops a token from attending to any token at or before an eod that
precedes it (the eod belongs to the document it ends), ``reset_position_ids`` restarts the
positions after each eod, ``eod_mask_loss`` gives eod tokens no loss. The dataset itself would
build the attention mask on the host as a float ``[s, s]`` lower triangle per sample (64 MiB at
sequence 4096) and copy it to the device; ``document_attention_mask`` builds the same boolean
mask on the device from the tokens instead: token ``i`` may attend to ``j`` iff ``j <= i`` and
both lie in the same document, a document being the tokens after one eod up to and including
the next. etp-train's batches carry the ``[b, s]`` document ids (``document_ids``) rather than
the mask: FlexAttention reads them as they are, SDPA expands them into this mask.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["Batch", "as_batch", "document_attention_mask", "document_ids", "mask_from_document_ids"]


@dataclass
class Batch:
    """One micro-batch: what the model's forward and the language-model loss read.

    Args:
        tokens: ``[b, s]`` input ids.
        labels: ``[b, s]`` the ids to predict (the next token of each input).
        loss_mask: ``[b, s]`` float weights of each token's loss (1 counts, 0 does not); None:
            every token counts and the loss is the plain mean.
        attention_mask: ``[b, 1, s, s]`` bool, True where a score is masked out (megatron-core's
            convention); or ``[b, s]`` int32 document ids (``document_ids``: a token attends to
            the tokens of its own document up to itself, [Note: document attention] in
            ``etp/megatron/document_attention.py``); None: causal attention over the whole sequence.
        position_ids: ``[b, s]``; None: ``0 .. s - 1`` in every row.

    Example::

        batch = Batch(tokens=ids[:, :-1], labels=ids[:, 1:])
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields that are set, in field order (a CUDA graph's static inputs)."""
        return tuple(t for t in (getattr(self, f.name) for f in fields(self)) if t is not None)

    def with_tensors(self, tensors) -> "Batch":
        """A batch of the same fields set as this one, holding ``tensors`` (``tensors()``'s order)."""
        values = iter(tensors)
        return Batch(**{f.name: None if getattr(self, f.name) is None else next(values) for f in fields(self)})

    def positions(self) -> torch.Tensor:
        """``position_ids``, or ``0 .. s - 1`` for every row when unset."""
        if self.position_ids is not None:
            return self.position_ids
        return torch.arange(self.tokens.shape[1], device=self.tokens.device).expand_as(self.tokens)

    def clone(self) -> "Batch":
        return self.with_tensors(t.clone() for t in self.tensors())


def as_batch(batch) -> Batch:
    """``batch`` as a ``Batch``: a ``Batch`` as it is, a ``[b, s + 1]`` id tensor as its inputs
    ``[:, :-1]`` and labels ``[:, 1:]`` (no masks).

    Example::

        as_batch(torch.randint(0, 256, (4, 65))).tokens.shape   # (4, 64)
    """
    if isinstance(batch, Batch):
        return batch
    return Batch(tokens=batch[:, :-1], labels=batch[:, 1:])


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[b, s]`` int32: each token's document within its row ([Note: per-document masks]), the
    form in which a batch carries per-document attention (``Batch.attention_mask``): the eods
    strictly before a token (the eod itself ends its own document). Never decreases along a row.

    Example::

        document_ids(torch.tensor([[5, 0, 7, 8]]), eod=0)   # tensor([[0, 0, 1, 1]])
    """
    ends = tokens == eod
    return (torch.cumsum(ends, dim=1, dtype=torch.int32) - ends.to(torch.int32)).contiguous()


def mask_from_document_ids(ids: torch.Tensor) -> torch.Tensor:
    """The ``[b, 1, s, s]`` bool mask of ``ids [b, s]``: True where token ``i`` may not attend to
    token ``j`` (``j > i`` or another document), megatron-core's convention.

    Example::

        mask_from_document_ids(torch.tensor([[0, 0, 1, 1]]))[0, 0, 2]   # tensor([True, True, False, True])
    """
    s = ids.shape[1]
    future = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1)
    return (future | (ids[:, :, None] != ids[:, None, :])).unsqueeze(1)


def document_attention_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """The block-diagonal causal mask of [Note: per-document masks] for ``tokens [b, s]``:
    ``[b, 1, s, s]`` bool, True where token ``i`` may not attend to token ``j``. Equal to what
    megatron-core's ``GPTDataset`` builds with ``reset_attention_mask`` (``create_attention_mask``).

    Example::

        document_attention_mask(torch.tensor([[5, 0, 7, 8]]), eod=0)[0, 0]
        # token 2 and 3 see only tokens 2..3: rows 2 and 3 mask columns 0 and 1
    """
    return mask_from_document_ids(document_ids(tokens, eod))
