#!/usr/bin/env bash
# FP8 kernel checks on one GPU (H100 / H200): the kernel tests compiled on CUDA, then the
# kernel benchmark.  Run from the repository root on a fresh machine (torch + triton
# installed, etp not installed):
#
#     OUT=/path/to/results bash tools/gpu_kernels.sh
#
# Writes $OUT/pytest_kernels.txt, $OUT/bench_kernels.json, $OUT/BENCHMARKS_kernels.md and
# prints a short summary table last.  About 2-4 minutes (most of it Triton compiles).
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:${PYTHONPATH:-}
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
OUT=${OUT:-$PWD/gpu_kernels_out}
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(), torch.cuda.get_device_capability())"

echo "== pytest (compiled on CUDA) =="
t0=$SECONDS
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_shapes.py \
    tests/test_swiglu.py tests/test_colwise.py \
    2>&1 | tee "$OUT/pytest_kernels.txt" | tail -25
test_rc=${PIPESTATUS[0]}
echo "pytest rc=$test_rc in $((SECONDS - t0)) s"

echo "== bench_kernels =="
t0=$SECONDS
timeout 150 python3 tools/bench_kernels.py --out "$OUT/bench_kernels.json" \
    --benchmarks-md "$OUT/BENCHMARKS_kernels.md" > "$OUT/bench_kernels.txt" 2>&1
bench_rc=$?
tail -5 "$OUT/bench_kernels.txt"
echo "bench rc=$bench_rc in $((SECONDS - t0)) s"

echo "== summary =="
TEST_RC=$test_rc BENCH_RC=$bench_rc python3 - "$OUT/bench_kernels.json" "$OUT/pytest_kernels.txt" <<'PY'
import json, os, re, sys
tests = open(sys.argv[2]).read().strip().splitlines() if os.path.exists(sys.argv[2]) else []
last = next((l for l in reversed(tests) if re.search(r"passed|failed|error", l)), "no pytest summary")
print(f"pytest (rc {os.environ['TEST_RC']}): {last.strip()}")
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    print(f"bench (rc {os.environ['BENCH_RC']}): no JSON ({e})")
    sys.exit(0)
print(f"bench (rc {os.environ['BENCH_RC']}) on {d['device']}, torch {d['versions']['torch']}, "
      f"triton {d['versions']['triton']}")
rows = [("d2d copy", d["copy"]["median_ms"], 1.0, "")]
rows.append(("amax fused", d["amax"]["fused"]["median_ms"], d["amax"]["fused"]["fraction_of_copy_bw"], ">=0.8"))
for k, tgt in (("plain", ">=0.7"), ("transposed", ">=0.6")):
    f = d["cast"][k]["fused"]
    rows.append((f"cast {k}", f["median_ms"], f["fraction_of_copy_bw"], tgt))
for k, v in d["blockwise"].items():
    rows.append((f"blockwise {k}", v["fused"]["median_ms"], v["fused"]["fraction_of_copy_bw"], ""))
for k, v in d.get("rowwise", {}).items():
    rows.append((f"rowwise {k}", v["fused"]["median_ms"], v["fused"]["fraction_of_copy_bw"], ""))
print(f"{'op':32s} {'ms':>8s} {'frac copy bw':>12s} {'target':>7s}  {'host ms/call':>12s}")
host = {"amax fused": d["amax"]["fused"], "cast plain": d["cast"]["plain"]["fused"],
        "cast transposed": d["cast"]["transposed"]["fused"]}
for name, ms, fr, tgt in rows:
    h = host.get(name, {}).get("host_ms_per_call")
    print(f"{name:32s} {ms:8.4f} {fr:12.2f} {tgt:>7s}  {'' if h is None else f'{h:12.4f}'}")
for k in ("amax", "plain_sweep", "transposed_sweep"):
    sw = d["amax"].get("sweep") if k == "amax" else d["cast"].get(k)
    if sw:
        best = max(sw, key=lambda e: e["fraction_of_copy_bw"])
        print(f"best {k} sweep entry: {best}")
print("correctness:", "exact" if d["correctness"]["all_exact"] else
      {k: v for k, v in d["correctness"].items() if v})
PY
exit $(( test_rc != 0 || bench_rc != 0 ))
