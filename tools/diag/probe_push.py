"""Why the nccl backends' pack (``push_rows``, X_ROWS into a two-buffer table) is slower on
rows of 7168 than of 4096 (1 GPU, no communication).

``tools/bench_ep.py --trace`` showed ``_push_kernel`` taking several times longer per byte on
the DeepSeek-V3-like workload (H 7168, a row in 1024-wide column blocks) than on SonicMoE's
(H 4096, one block per row). This probe times the same launch on both shapes over the tile
(``ROWS`` x ``BLOCK_H``), the warps and the pipeline depth, and reports GB/s written: which
tiling, if any, brings the wide rows to the narrow rows' bandwidth.

    python3 tools/diag/probe_push.py [out.json]
"""
import functools
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # etp from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/diag/
from bench_overlap import back_to_back_ms  # noqa: E402 - one timing loop for the diag tools
from bench_provenance import provenance  # noqa: E402

from etp.kernels import ep_move as km  # noqa: E402
from etp.kernels.ep_tiles import row_block, tile_rows  # noqa: E402
from etp.kernels.launch import launch  # noqa: E402

SHAPES = {"sonicmoe": (32768, 4096, 8), "deepseek_v3": (16384, 7168, 8)}  # T, H, K


def _time(fn, iters=10):
    fn()  # compiles
    torch.cuda.synchronize()
    return back_to_back_ms(fn, iters) / 1e3


def _torch_pack(exchange, pair_row, x, k):
    exchange.index_copy_(0, pair_row, x.repeat_interleave(k, 0))


def main(out=None):
    torch.manual_seed(0)
    rows_out = []
    for name, (T, H, K) in SHAPES.items():
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        exchange, recv = (torch.empty(T * K, H, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        pair_row = torch.randperm(T * K, device="cuda")
        pair_where = (torch.rand(T * K, device="cuda") < 0.25).long()  # a quarter to local experts
        table = km.table_of([exchange, recv], x.device)
        written = T * K * H * 2
        copy_s = _time(functools.partial(_torch_pack, exchange, pair_row, x, K))
        rows_out.append(dict(shape=name, way="torch index_copy_ (repeat_interleave + scatter)", ms=copy_s * 1e3,
                             GBps=written / copy_s / 1e9))
        print(f"{name}: torch index_copy_ {copy_s * 1e3:.3f} ms", flush=True)
        blocks = sorted({row_block(H), 1024, 2048, 4096, triton.next_power_of_2(H)})
        for block_h, rows, warps, stages in itertools.product(blocks, (1, 2, 4, 8, 16, 32), (4, 8), (3,)):
            if rows * block_h > 32768:
                continue
            fn = functools.partial(launch, km._push_kernel, (132,), x, x, pair_row, pair_where, table, table, x, T, H, 0,
                                   0, K=K, X_MODE=km.X_ROWS, HAS_W=False, OWN=False, ROWS=rows,
                                   BLOCK_H=block_h, ALIGN=16, STAGES=stages, num_warps=warps)
            try:
                seconds = _time(fn)
            except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is reported
                print(f"{name}: BLOCK_H {block_h} ROWS {rows}: {type(exc).__name__}", flush=True)
                continue
            row = dict(shape=name, way="push_rows", block_h=block_h, rows=rows, warps=warps, stages=stages,
                       ms=seconds * 1e3, GBps=written / seconds / 1e9,
                       default=(block_h, rows, warps, stages) == (row_block(H), tile_rows(None, H), 8, 3))
            rows_out.append(row)
            print(f"{name}: BLOCK_H {block_h:5d} ROWS {rows:2d} warps {warps} stages {stages}: {seconds * 1e3:7.3f} ms "
                  f"{row['GBps']:6.0f} GB/s{'  (default)' if row['default'] else ''}", flush=True)
    if out:
        Path(out).write_text(json.dumps({"provenance": provenance(), "device": torch.cuda.get_device_name(),
                                         "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
