#!/usr/bin/env bash
# GPU verification on the device machine (8×H200), from the repository root:
#   bash tools/gpu_checks.sh tests   -> GPU unit tests, NCCL parity / async tests on 2 and 8 GPUs
#   bash tools/gpu_checks.sh bench   -> kernel benchmark (1 GPU) and expert-stack benchmark (8 GPUs)
# Logs and JSON go to $OUT (the device tool's output folder). Needs the wheels of
# ../shared/device/wheels.sh in .whl/ (megatron-core is not on the GPU image).
set -uo pipefail
OUT=${OUT:-/tmp/etp_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 ETP_TEST_TIMEOUT=240
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
case "${1:-tests}" in
tests)
  echo "=== GPU unit tests (grouped GEMM, Triton kernels compiled)"
  python3 -m pytest -q tests/test_gemm.py tests/test_kernels.py 2>&1 | tee "$OUT/gpu_unit.log" | tail -4
  echo "=== NCCL, 2 GPUs: parity, megatron linears (TP=2 x ETP=2 incl. sequence parallel), async"
  ETP_TEST_BACKEND=nccl ETP_TEST_SIZES=2 python3 -m pytest -q tests/test_parity.py \
    tests/test_megatron_linears.py tests/test_async.py 2>&1 | tee "$OUT/nccl2.log" | tail -6
  echo "=== NCCL, 8 GPUs: parity and megatron linears at ETP=8"
  ETP_TEST_BACKEND=nccl ETP_TEST_SIZES=8 python3 -m pytest -q tests/test_parity.py \
    tests/test_megatron_linears.py -k "not tp2" 2>&1 | tee "$OUT/nccl8.log" | tail -6
  ;;
bench)
  echo "=== GPU grouped GEMM test"
  python3 -m pytest -q tests/test_gemm.py 2>&1 | tail -2
  echo "=== kernel benchmark (1 GPU)"
  python3 tools/bench_kernels.py --benchmarks-md "$OUT/BENCHMARKS_kernels.md" 2>&1 | tee "$OUT/bench_kernels.log" | tail -25
  echo "=== expert stack benchmark (8 GPUs)"
  torchrun --nproc-per-node=8 tools/bench_expert_stack.py --trace "$OUT/trace" \
    --out "$OUT/bench_expert_stack.json" --benchmarks-md "$OUT/BENCHMARKS_expert_stack.md" 2>&1 \
    | tee "$OUT/bench_expert_stack.log" | tail -30
  ;;
esac
