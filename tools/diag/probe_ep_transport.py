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


class _Moves:
    """One workload's rows in symmetric memory, and every way of moving them: one method each,
    all with the same effect (rank ``r``'s rows for peer ``p`` land at ``p``'s rows ``r * chunk``
    on), except ``p2p_pieces``, which lands them sorted by expert, then source."""

    def __init__(self, T, H, K, E, streams):
        import torch.distributed._symmetric_memory as symm_mem

        from etp.kernels.ep_move import table_of

        group = dist.group.WORLD
        self.rank, self.world, self.streams = dist.get_rank(), dist.get_world_size(), streams
        self.rows, self.chunk = T * K, T * K // self.world
        self.send = symm_mem.empty(self.rows, H, dtype=torch.bfloat16, device="cuda")
        self.send.normal_()
        self.send_h = symm_mem.rendezvous(self.send, group)
        self.recv = symm_mem.empty(self.rows, H, dtype=torch.bfloat16, device="cuda")
        self.recv.zero_()
        self.recv_h = symm_mem.rendezvous(self.recv, group)
        shape = (self.rows, H)
        self.peers_recv = [self.recv_h.get_buffer(p, shape, torch.bfloat16) for p in range(self.world)]
        self.peers_send = [self.send_h.get_buffer(p, shape, torch.bfloat16) for p in range(self.world)]
        self.plain_out = torch.empty_like(self.send)
        self.pieces = E // self.world
        self.piece = self.chunk // self.pieces
        self.table = table_of(self.peers_recv, self.send.device)
        # send row i goes to peer i // chunk, at that peer's row rank * chunk + i % chunk
        i = torch.arange(self.rows, device="cuda")
        self.slot = (i // self.chunk) * self.rows + self.rank * self.chunk + i % self.chunk
        self.host_ms = []

    def _to(self, p):
        return slice(p * self.chunk, (p + 1) * self.chunk)

    def _fan_out(self, copy_one, local=None):
        main = torch.cuda.current_stream()
        for p in range(self.world):
            self.streams[p].wait_stream(main)
        for step in range(self.world):
            p = (self.rank + step) % self.world
            with torch.cuda.stream(self.streams[p]):
                copy_one(p)
        if local is not None:
            local()
        for p in range(self.world):
            main.wait_stream(self.streams[p])
        self.recv_h.barrier(channel=0)

    def a2a(self):
        dist.all_to_all_single(self.plain_out, self.send)

    def ce(self):
        own = self._to(self.rank)
        self._fan_out(lambda p: self.peers_recv[p][own].copy_(self.send[self._to(p)]))

    def ce_all(self):
        own = self._to(self.rank)
        self._fan_out(lambda p: None if p == self.rank else self.peers_recv[p][own].copy_(self.send[self._to(p)]),
                      local=lambda: self.recv[own].copy_(self.send[own]))

    def ce_pieces(self):
        def copy_pieces(p):
            for e in range(self.pieces):
                at = e * self.piece
                src, dst = p * self.chunk + at, self.rank * self.chunk + at
                self.peers_recv[p][dst:dst + self.piece].copy_(self.send[src:src + self.piece])
        self._fan_out(copy_pieces)

    def ce_pull(self):
        self.send_h.barrier(channel=1)  # the peers' send rows are ready
        self._fan_out(lambda p: self.recv[self._to(p)].copy_(self.peers_send[p][self._to(self.rank)]))

    def p2p_pieces(self):
        t0 = time.perf_counter()
        ops = []
        for step in range(1, self.world):
            to, frm = (self.rank + step) % self.world, (self.rank - step) % self.world
            for e in range(self.pieces):
                lo = to * self.chunk + e * self.piece
                ops.append(dist.P2POp(dist.isend, self.send[lo:lo + self.piece], to))
                at = (e * self.world + frm) * self.piece
                ops.append(dist.P2POp(dist.irecv, self.plain_out[at:at + self.piece], frm))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.host_ms.append((time.perf_counter() - t0) * 1e3)

    def sm_push(self, num_ctas):
        from etp.kernels.ep_pack import copy_rows

        copy_rows(self.send, self.slot, self.table, 0, self.rows, scatter=True, slot_rows=self.rows,
                  num_ctas=num_ctas)
        self.recv_h.barrier(channel=0)

    def rows_correct(self, move) -> bool:
        """Runs ``move`` into zeroed rows: did every peer's rows for this rank land?"""
        self.recv.zero_()
        dist.barrier()
        move()
        torch.cuda.synchronize()
        return all(torch.equal(self.recv[self._to(p)], self.peers_send[p][self._to(self.rank)])
                   for p in range(self.world))


def _probe_workload(T, H, K, E, *, iters, ctas, streams):
    """Times every transport on one workload's rows; returns its JSON entry."""
    m = _Moves(T, H, K, E, streams)
    sm_pushes = [("sm_push" if n == ctas[0] else f"sm_push_{n}_ctas", functools.partial(m.sm_push, n))
                 for n in ctas]
    moves = [("a2a", m.a2a), ("ce", m.ce), ("ce_pieces", m.ce_pieces), ("ce_pull", m.ce_pull),
             ("ce_all", m.ce_all), ("p2p_pieces", m.p2p_pieces)] + sm_pushes
    entry = {"T": T, "H": H, "K": K, "E": E, "bytes_per_rank": m.rows * H * 2,
             "bytes_leaving_rank": (m.world - 1) * m.chunk * H * 2}
    for label, fn in moves:
        ms = _median_max_ms(fn, iters)
        entry[label] = {"ms": round(ms, 3),
                        "GB_per_s_leaving": round(entry["bytes_leaving_rank"] / ms / 1e6, 1)}
    entry["p2p_pieces"]["host_ms"] = round(statistics.median(m.host_ms), 3)
    for label, fn in (("ce_all", m.ce_all), sm_pushes[0]):
        entry[label]["rows_correct"] = m.rows_correct(fn)
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
