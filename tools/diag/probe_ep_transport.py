"""Probe: how fast can the bytes of an expert-parallel move cross NVLink, by transport, before any
layout work? (Run on 2+ GPUs of one host.)

For each workload (every (token, expert) row, equal splits over the ranks) it times, each alone and
as the slowest rank's median:

- ``a2a``: NCCL ``all_to_all_single`` of the rows;
- ``ce``: copy-engine pushes (one ``copy_`` per peer, each peer on its own stream, into the peer's
  symmetric-memory receive rows), the rows for this rank copied locally, then a barrier;
- ``ce_pieces``: the same with each peer's rows cut into ``E / W`` copies (one per local expert of
  the receiver, as a move straight into expert-sorted rows would issue them);
- ``ce_pull``: each rank reads its rows from every peer's send rows (symmetric) instead;
- ``ce_all``: ``ce`` with this rank's own rows copied too (on the main stream, beside the pushes),
  as the all-to-all does;
- ``sm_push``: one Triton launch (``etp.kernels.ep_pack.copy_rows`` over the peers' pointer table,
  the first of ``--num-ctas`` programs; the others as ``sm_push_<n>_ctas``) storing every row, this rank's own included, into its receiver's rows;
- ``p2p_pieces``: NCCL grouped send / receive of each peer's rows in ``E / W`` pieces, each received
  straight into expert-sorted rows (expert, then source), as an ``nccl`` backend without an unpack
  would; its host time to issue the group is reported beside (``host_ms``).

The question it answers: whether copy engines move these bytes faster than NCCL's kernels, which
decides if a copy-engine EP transport could beat the all-to-all of the same bytes.

    torchrun --nproc-per-node 2 tools/diag/probe_ep_transport.py --out probe.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # etp from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: bench_provenance
from bench_provenance import provenance  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/diag/
from bench_overlap import median_call_ms  # noqa: E402 - one timing loop for the diag tools

WORKLOADS = {"sonicmoe": (32768, 4096, 8, 128), "deepseek_v3": (16384, 7168, 8, 256)}  # T, H, K, E


def _median_max_ms(fn, iters):
    """The slowest rank's median ms of one call (ranks lined up by a barrier before each)."""
    for _ in range(3):
        fn()
    t = torch.tensor([median_call_ms(fn, iters, before=dist.barrier)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _probe_workload(T, H, K, E, *, iters, ctas, streams):
    """Times every transport on one workload's rows; returns its JSON entry."""
    import torch.distributed._symmetric_memory as symm_mem

    from etp.kernels.ep_move import table_of
    from etp.kernels.ep_pack import copy_rows

    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = T * K
    chunk = rows // world
    send = symm_mem.empty(rows, H, dtype=torch.bfloat16, device="cuda")
    send.normal_()
    send_h = symm_mem.rendezvous(send, group)
    recv = symm_mem.empty(rows, H, dtype=torch.bfloat16, device="cuda")
    recv.zero_()
    recv_h = symm_mem.rendezvous(recv, group)
    peers_recv = [recv_h.get_buffer(p, (rows, H), torch.bfloat16) for p in range(world)]
    peers_send = [send_h.get_buffer(p, (rows, H), torch.bfloat16) for p in range(world)]
    plain_out = torch.empty_like(send)
    pieces = E // world
    piece = chunk // pieces

    table = table_of(peers_recv, send.device)
    # send row i goes to peer i // chunk, at that peer's row rank * chunk + i % chunk
    i = torch.arange(rows, device="cuda")
    slot = (i // chunk) * rows + rank * chunk + i % chunk

    def sm_push(num_ctas):
        copy_rows(send, slot, table, 0, rows, scatter=True, slot_rows=rows, num_ctas=num_ctas)
        recv_h.barrier(channel=0)

    sm_pushes = tuple(("sm_push" if n == ctas[0] else f"sm_push_{n}_ctas", functools.partial(sm_push, n))
                      for n in ctas)

    def ce_all():
        own = slice(rank * chunk, (rank + 1) * chunk)
        fan_out(lambda p: None if p == rank else peers_recv[p][own].copy_(send[p * chunk:(p + 1) * chunk]),
                local=lambda: recv[own].copy_(send[own]))

    host_ms = []

    def p2p_pieces():
        t0 = time.perf_counter()
        ops = []
        for step in range(1, world):
            to, frm = (rank + step) % world, (rank - step) % world
            for e in range(pieces):
                lo = to * chunk + e * piece
                ops.append(dist.P2POp(dist.isend, send[lo:lo + piece], to))
                at = e * world * piece + frm * piece
                ops.append(dist.P2POp(dist.irecv, plain_out[at:at + piece], frm))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        host_ms.append((time.perf_counter() - t0) * 1e3)

    def a2a():
        dist.all_to_all_single(plain_out, send)

    def fan_out(copy_one, local=None):
        main = torch.cuda.current_stream()
        for p in range(world):
            streams[p].wait_stream(main)
        for step in range(world):
            p = (rank + step) % world
            with torch.cuda.stream(streams[p]):
                copy_one(p)
        if local is not None:
            local()
        for p in range(world):
            main.wait_stream(streams[p])
        recv_h.barrier(channel=0)

    def ce():
        fan_out(lambda p: peers_recv[p][rank * chunk:(rank + 1) * chunk].copy_(
            send[p * chunk:(p + 1) * chunk]))

    def ce_pieces():
        def copy_pieces(p):
            for i in range(pieces):
                lo = p * chunk + i * piece
                peers_recv[p][rank * chunk + i * piece:rank * chunk + (i + 1) * piece].copy_(
                    send[lo:lo + piece])
        fan_out(copy_pieces)

    def ce_pull():
        send_h.barrier(channel=1)  # the peers' send rows are ready
        fan_out(lambda p: recv[p * chunk:(p + 1) * chunk].copy_(
            peers_send[p][rank * chunk:(rank + 1) * chunk]))

    entry = {"T": T, "H": H, "K": K, "E": E, "bytes_per_rank": rows * H * 2,
             "bytes_leaving_rank": (world - 1) * chunk * H * 2}
    for label, fn in (("a2a", a2a), ("ce", ce), ("ce_pieces", ce_pieces), ("ce_pull", ce_pull),
                      ("ce_all", ce_all),
                      ("p2p_pieces", p2p_pieces)) + sm_pushes:
        ms = _median_max_ms(fn, iters)
        entry[label] = {"ms": round(ms, 3),
                        "GB_per_s_leaving": round(entry["bytes_leaving_rank"] / ms / 1e6, 1)}
    entry["p2p_pieces"]["host_ms"] = round(statistics.median(host_ms), 3)
    for label, fn in (("ce_all", ce_all), sm_pushes[0]):  # every row where it belongs
        recv.zero_()
        dist.barrier()
        fn()
        torch.cuda.synchronize()
        entry[label]["rows_correct"] = all(
            torch.equal(recv[p * chunk:(p + 1) * chunk], peers_send[p][rank * chunk:(rank + 1) * chunk])
            for p in range(world))
    return entry


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--num-ctas", default="132", help="comma list: one sm_push row per count")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    streams = [torch.cuda.Stream() for _ in range(world)]
    results = {}
    ctas = [int(n) for n in args.num_ctas.split(",")]
    for name, (T, H, K, E) in WORKLOADS.items():
        entry = _probe_workload(T, H, K, E, iters=args.iters, ctas=ctas, streams=streams)
        results[name] = entry
        if rank == 0:
            print(name, json.dumps(entry), flush=True)
        torch.cuda.empty_cache()
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps({"world": world, "gpu": torch.cuda.get_device_name(),
                                              "results": results, "provenance": provenance()}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
