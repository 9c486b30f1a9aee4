#!/usr/bin/env bash
# Expert-parallel (etp.ep) GPU checks, from the repository root on a fresh GPU machine
# (etp not installed; torch + triton present; NCCL_NVLS_ENABLE=0 and
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1 preset there and kept):
#   bash tools/gpu_ep.sh          GPU tests on 2 GPUs, then the benchmark on NPROC (default 2) GPUs
# Finishes within 6 minutes (each stage has its own timeout; a hung test rank is killed after
# ETP_TEST_TIMEOUT seconds). Full logs, JSON and the markdown table go to $OUT; stdout gets
# each stage's summary and, per failing test, the head of its first traceback.
set -uo pipefail
OUT=${OUT:-/tmp/etp_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 ETP_TEST_TIMEOUT=${ETP_TEST_TIMEOUT:-60}
START=$SECONDS

# Prints, for every failing test of a pytest log, its header and the first lines of its
# traceback (up to the first "E " block and a few lines past it), then the summary lines.
failures() {
  python3 - "$1" <<'PY'
import re, sys
text = open(sys.argv[1], errors="replace").read()
if "= FAILURES =" not in text and "= ERRORS =" not in text:
    sys.exit(0)
body = re.split(r"^=+ (?:FAILURES|ERRORS) =+$", text, flags=re.M)[-1]
body = re.split(r"^=+ (?:short test summary info|warnings summary|.* in [0-9.]+s.*) =+$", body, flags=re.M)[0]
for block in re.split(r"^(?=_{3,} .* _{3,}$)", body, flags=re.M):
    lines = [l for l in block.splitlines() if not l.startswith("frame #")]
    if not lines:
        continue
    first_e = next((i for i, l in enumerate(lines) if l.startswith("E ")), None)
    if first_e is None:
        head = lines[:40]
    else:
        end = first_e
        while end < len(lines) and lines[end].startswith("E "):
            end += 1
        head = lines[: min(end + 3, first_e + 60)]
        head = head[:1] + ["    ..."] + head[max(1, first_e - 12):] if first_e > 25 else head
    print("\n".join(head[:90]))
PY
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"

echo "=== move kernels compiled on 1 GPU (W ranks simulated with local pointer tables)"
timeout 80 python3 -m pytest -q --tb=long -rfE tests/test_ep_kernels.py > "$OUT/ep_kernels_gpu.log" 2>&1
echo "exit $? after $((SECONDS - START))s; full log: $OUT/ep_kernels_gpu.log"
failures "$OUT/ep_kernels_gpu.log"; grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/ep_kernels_gpu.log" | tail -8

echo "=== NCCL, 2 GPUs: every backend vs reference, CUDA-graph replay, allocation-free moves"
ETP_TEST_BACKEND=nccl timeout 150 python3 -m pytest -q --tb=long -rfE -p no:cacheprovider tests/test_ep_gpu.py \
  > "$OUT/ep_gpu.log" 2>&1
echo "exit $? after $((SECONDS - START))s; full log: $OUT/ep_gpu.log"
failures "$OUT/ep_gpu.log"; grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/ep_gpu.log" | tail -10

echo "=== benchmark, ${NPROC:-2} GPUs"
timeout $((350 - (SECONDS - START) > 30 ? 350 - (SECONDS - START) : 30)) torchrun --nproc-per-node=${NPROC:-2} \
  tools/bench_ep.py --out "$OUT/bench_ep.json" --benchmarks-md "$OUT/BENCHMARKS_ep.md" > "$OUT/bench_ep.log" 2>&1
echo "exit $? after $((SECONDS - START))s; full log: $OUT/bench_ep.log"
grep -v "^W[0-9]\|OMP_NUM_THREADS\|\*\*\*\*\|^frame #" "$OUT/bench_ep.log" | tail -25
