"""etp-train's data: the global batch of an iteration, micro-batch by micro-batch."""
from __future__ import annotations

import torch

from etp.streams import to_device_async

__all__ = ["Batches"]


class Batches:
    """Random windows of the corpus (bytes), or synthetic tokens. Every sample of the global
    batch depends only on (seed, iteration, its index in the global batch), so a resumed
    run reads what the uninterrupted run would have read, at any data-parallel layout."""

    def __init__(self, recipe, rank: int, device, microbatches: int) -> None:
        path = recipe.resolve_data_path()
        self.data = None if path is None else torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        self.seed, self.rank, self.microbatches = recipe.train.seed, rank, microbatches
        self.rows, self.width = recipe.train.micro_batch_size, recipe.model.seq_length + 1
        self.vocab, self.device = recipe.model.vocab_size, device

    def _sample(self, iteration: int, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((self.seed, iteration, index)) % 2**63)
        if self.data is None:
            return torch.randint(0, self.vocab, (self.width,), generator=gen)
        start = int(torch.randint(0, self.data.numel() - self.width, (1,), generator=gen))
        return self.data[start : start + self.width].long()

    def get(self, iteration: int, micro: int) -> torch.Tensor:
        first = (self.rank * self.microbatches + micro) * self.rows
        batch = torch.stack([self._sample(iteration, first + j) for j in range(self.rows)])
        # Without waiting: a pageable copy would wait for the GPU to finish the previous
        # microbatch before this one's forward could be queued.
        return to_device_async(batch, self.device)
