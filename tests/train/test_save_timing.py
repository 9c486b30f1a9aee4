"""A save's seconds, which etp-train keeps out of the step time, exclude the step the device is
still running when the save begins (the host queues a step ahead of the GPU; the save's first
device-to-host copy would otherwise wait for it, and that wait would vanish from the step)."""
from __future__ import annotations

import time

import torch

from etp.recipe import Recipe
from etp.train.checkpointing import Checkpointing
from etp.train.options import RunOptions

STEP_S = 0.3


class _Device:
    """A device with one step still queued: a synchronize waits for it once."""

    def __init__(self) -> None:
        self.busy_until = time.perf_counter() + STEP_S

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.busy_until - time.perf_counter()))


def test_a_synchronous_save_does_not_count_the_step_still_on_the_device(tmp_path, monkeypatch):
    import etp.megatron.checkpoint as ckpt

    device = _Device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", device.synchronize)

    def save_training_checkpoint(root, iteration, model, optimizer, metadata):
        device.synchronize()  # the first copy of a device tensor to host
        return root / f"iter_{iteration:07d}"

    monkeypatch.setattr(ckpt, "save_training_checkpoint", save_training_checkpoint)
    recipe = Recipe.from_yaml("recipes/tiny_moe_cpu.yaml", save=str(tmp_path / "saves"))
    checkpoints = Checkpointing(recipe, RunOptions(), rank=0, world=1)
    stepper = type("Stepper", (), {"model": None, "optimizer": None})()
    device.busy_until = time.perf_counter() + STEP_S  # the step just queued
    seconds = checkpoints.save(stepper, 3)
    assert seconds < STEP_S / 3, f"the save counted {seconds:.2f} s, the device's step included"
