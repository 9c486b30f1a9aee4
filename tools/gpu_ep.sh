#!/usr/bin/env bash
# Expert-parallel (etp.ep) GPU checks, from the repository root on a fresh GPU machine
# (etp not installed; torch + triton present; NCCL_NVLS_ENABLE=0 and
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1 preset there and kept):
#   bash tools/gpu_ep.sh          GPU tests on 2 GPUs, then the benchmark on NPROC (default 2) GPUs
# Logs, JSON and the markdown table go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/etp_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 ETP_TEST_TIMEOUT=180
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
echo "=== move kernels compiled on 1 GPU (W ranks simulated with local pointer tables)"
timeout 150 python3 -m pytest -q tests/test_ep_kernels.py 2>&1 | tee "$OUT/ep_kernels_gpu.log" | tail -3
echo "=== NCCL, 2 GPUs: every backend vs reference, CUDA-graph replay, allocation-free moves"
ETP_TEST_BACKEND=nccl timeout 200 python3 -m pytest -q -x tests/test_ep_gpu.py 2>&1 | tee "$OUT/ep_gpu.log" | tail -15
echo "=== benchmark, ${NPROC:-2} GPUs"
timeout 240 torchrun --nproc-per-node=${NPROC:-2} tools/bench_ep.py --out "$OUT/bench_ep.json" \
  --benchmarks-md "$OUT/BENCHMARKS_ep.md" 2>&1 | tee "$OUT/bench_ep.log" | grep -v "^W[0-9]\|OMP_NUM_THREADS\|\*\*\*\*" | tail -20
