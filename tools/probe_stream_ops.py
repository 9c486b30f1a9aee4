"""Host cost of etp's stream memory operations next to what they replace (2 GPUs).

Times, per call on rank 0: ``torch.cuda.current_stream()``, ``etp.transport.stream_ops``'
``write_value`` / ``wait_value_geq`` (local and peer flags), the raw driver calls with the
stream handle looked up once, a one-element kernel launch and a symmetric-memory barrier
kernel launch (``handle.barrier``). What a flag fence costs the host against a barrier kernel.

Run::

    torchrun --standalone --nproc-per-node 2 tools/probe_stream_ops.py
"""
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

from etp.transport.stream_ops import _driver, wait_value_geq, write_value  # noqa: E402
from etp.transport.symm_pool import rendezvous_offset, symm_mem_module  # noqa: E402

CALLS = 2000


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    group = dist.group.WORLD
    pad = symm_mem_module(group).empty(64, dtype=torch.int32, device="cuda")
    pad.zero_()
    handle, offset = rendezvous_offset(pad, group)
    addresses = [ptr + offset for ptr in handle.buffer_ptrs]
    peer = (rank + 1) % dist.get_world_size()
    torch.cuda.synchronize()
    dist.barrier()
    raw_write, raw_wait = _driver()["cuStreamWriteValue32"], _driver()["cuStreamWaitValue32"]
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.zeros(16, device="cuda")
    probes = {
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "write_value, own flag": lambda: write_value(addresses[rank], 1),
        "write_value, peer flag": lambda: write_value(addresses[peer] + 8, 1),
        "wait_value_geq, satisfied": lambda: wait_value_geq(addresses[rank], 0),
        "raw cuStreamWriteValue32, peer flag": lambda: raw_write(stream, addresses[peer] + 8, 1, 0),
        "raw cuStreamWaitValue32, satisfied": lambda: raw_wait(stream, addresses[rank], 0, 0),
        "kernel launch (x.add_(1))": lambda: x.add_(1),
        "symmetric-memory barrier kernel": lambda: handle.barrier(channel=0),
    }
    for name, fn in probes.items():
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        per_call = (time.perf_counter() - start) / CALLS * 1e6
        torch.cuda.synchronize()
        if rank == 0:
            print(f"{name:40s} {per_call:7.2f} us per call", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
