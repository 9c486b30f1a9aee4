#!/usr/bin/env bash
# GPU verification on the device machine (8×H200), from the repository root:
#   bash tools/gpu_checks.sh tests    GPU unit tests; NCCL parity / async / FP8-recipe tests on 2 GPUs, and on 4 or 8 when present
#   bash tools/gpu_checks.sh fp8      FP8 GEMM test (1 GPU), FP8-vs-bf16 training on 2 GPUs (NCCL)
#   bash tools/gpu_checks.sh kernels  kernel benchmark (1 GPU)
#   bash tools/gpu_checks.sh bench    expert-stack benchmark, all default variants (8 GPUs)
#   bash tools/gpu_checks.sh ctas N   expert-stack benchmark with NCCL_MAX_CTAS=N (8 GPUs)
#   bash tools/gpu_checks.sh checkpoint  recipe (LAYERS layers) at ETP=NPROC saved at iteration 10,
#                                      resumed at ETP=NPROC/2 on NPROC/2 GPUs, at ETP=NPROC/2 with
#                                      the distributed optimizer and at ETP=1 on NPROC GPUs,
#                                      each vs the uninterrupted run (SAVE_EXTRA: --set overrides
#                                      of the saving run, e.g. the distributed optimizer)
#   bash tools/gpu_checks.sh fp8recipe recipes/moe_h200x8.yaml at world NPROC (default 2), ETP=NPROC:
#                                      bf16 gathers, fp8_tensorwise, fp8_blockwise, and ETP off, ITERS
#                                      iterations each (default 50, the recipe's own; deterministic
#                                      unless DET=0); each FP8 run vs the bf16-gather run
#                                      (compare_recipe_runs.py), then the 2-layer FP8 GPU test.
#                                      GRAPH=1: every run captured (cuda_graph=step), the fast way
#                                      (BENCHMARKS.md, session 14)
#                                      Why 50: at 25 the last-10 window sits in the loss's fall, where
#                                      two bf16 runs with different seeds differ by 12% (session 11)
#   bash tools/gpu_checks.sh megatron  driver vs stock megatron-core on 2 GPUs (pytest), then
#                                      recipes/moe_h200x8.yaml with and without ETP (NPROC GPUs)
# NPROC=4 runs the benchmarks on 4 GPUs instead of 8.
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
  G=$(nvidia-smi -L | wc -l)
  echo "=== GPU unit tests (grouped GEMM, Triton kernels compiled, every FP8 kernel shape)"
  python3 -m pytest -q tests/test_gemm.py tests/test_kernels.py tests/test_kernel_shapes.py 2>&1 | tee "$OUT/gpu_unit.log" | tail -4
  echo "=== NCCL, 2 GPUs: parity, megatron linears (TP=2 x ETP=2 incl. sequence parallel), async, FP8 recipe shapes"
  ETP_TEST_BACKEND=nccl ETP_TEST_SIZES=2 python3 -m pytest -q tests/test_parity.py \
    tests/test_megatron_linears.py tests/test_async.py tests/test_fp8_recipe_gpu.py 2>&1 | tee "$OUT/nccl2.log" | tail -6
  if [ "$G" -ge 4 ]; then  # the largest power of two up to the GPUs present
    S=4; [ "$G" -ge 8 ] && S=8
    echo "=== NCCL, $S GPUs: parity and megatron linears at ETP=$S"
    ETP_TEST_BACKEND=nccl ETP_TEST_SIZES=$S python3 -m pytest -q tests/test_parity.py \
      tests/test_megatron_linears.py -k "not tp2" 2>&1 | tee "$OUT/nccl$S.log" | tail -6
  fi
  ;;
fp8)
  echo "=== FP8: scaled GEMMs (1 GPU), grouped GEMM; FP8-vs-bf16 training and wire bytes on 2 GPUs (NCCL)"
  python3 -m pytest -q tests/test_gemm.py tests/test_fp8.py -k "gemm" 2>&1 | tail -3
  ETP_TEST_BACKEND=nccl python3 -m pytest -q -rA tests/test_fp8.py -k "training or byte" 2>&1 \
    | tee "$OUT/gpu_fp8.log" | tail -8
  ;;
kernels)
  python3 tools/bench_kernels.py --benchmarks-md "$OUT/BENCHMARKS_kernels.md" 2>&1 | tee "$OUT/bench_kernels.log" | tail -25
  ;;
bench)
  torchrun --nproc-per-node=${NPROC:-8} tools/bench_expert_stack.py --trace "$OUT/trace" \
    --out "$OUT/bench_expert_stack.json" --benchmarks-md "$OUT/BENCHMARKS_expert_stack.md" 2>&1 \
    | grep -v "^W1121\|OMP_NUM_THREADS\|\*\*\*\*\|_warn_once\|acc_events" | tail -40
  ;;
ctas)
  torchrun --nproc-per-node=${NPROC:-8} tools/bench_expert_stack.py --nccl-max-ctas "$2" \
    --variants replicated,etp_async,etp_async_fp8 --out "$OUT/bench_expert_stack_ctas$2.json" \
    --benchmarks-md "$OUT/BENCHMARKS_expert_stack.md" 2>&1 | grep "^|" | tail -12
  ;;
megatron)
  echo "=== NCCL, 2 GPUs: etp-train's megatron path (ETP DDP + megatron Adam) vs stock megatron-core"
  ETP_TEST_BACKEND=nccl python3 -m pytest -q tests/test_megatron_train_gpu.py 2>&1 | tee "$OUT/megatron_train_gpu.log" | tail -6
  N=${NPROC:-8}; ITERS=${ITERS:-50}
  if [ "$N" != 8 ]; then SET="--set world_size=$N --set etp.etp_size=$N --set etp.expert_etp_size=$N --set global_batch_size=$((4 * N))"; else SET=""; fi
  CMD="torchrun --nproc-per-node=$N -m etp.megatron.train --recipe recipes/moe_h200x8.yaml --train-iters $ITERS --log-interval 5 $SET ${EXTRA:-}"
  echo "=== $CMD"
  $CMD --json "$OUT/recipe_etp.json" --audit "$OUT/audit_etp.json" 2>&1 | grep -v "^W1121\|OMP_NUM\|\*\*\*\*" | tail -30
  echo "=== same, without ETP"
  $CMD --set etp.etp_size=1 --set etp.expert_etp_size=1 --json "$OUT/recipe_plain.json" --audit "$OUT/audit_plain.json" 2>&1 \
    | grep -v "^W1121\|OMP_NUM\|\*\*\*\*" | tail -30
  python3 tools/compare_recipe_runs.py --etp "$OUT/recipe_etp.json" --baseline "$OUT/recipe_plain.json" \
    --tolerance 0.03 --command "$CMD" --out "$OUT/moe_h200x8_compare.json"
  ;;
fp8recipe)
  N=${NPROC:-2}; ITERS=${ITERS:-50}; LOG="$OUT/fp8recipe.log"
  [[ ${DET:-1} == 1 ]] && EXTRA="--set deterministic=true ${EXTRA:-}"
  [[ ${GRAPH:-0} == 1 ]] && EXTRA="--set cuda_graph=step --set overlap_grad_reduce=false ${EXTRA:-}"
  echo "=== 2-layer FP8 GPU test (full log in $LOG)"
  ETP_TEST_BACKEND=nccl timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_recipe_gpu.py > "$OUT/pytest.tmp" 2>&1
  grep -v "frame #\|TCPStore\|sendBytes\|should dump" "$OUT/pytest.tmp" >> "$LOG"; rm -f "$OUT/pytest.tmp"
  grep -A25 "raised:" "$LOG" | grep -v "^--$" | head -40; tail -3 "$LOG"
  CMD="torchrun --nproc-per-node=$N -m etp.megatron.train --recipe recipes/moe_h200x8.yaml --train-iters $ITERS --log-interval 5 --set world_size=$N --set global_batch_size=$((4 * N)) ${EXTRA:-}"
  run() {  # name, then --set overrides
    local name=$1; shift
    echo "=== $name: $CMD $*" | tee -a "$LOG"
    timeout 300 $CMD "$@" --json "$OUT/fp8recipe_$name.json" 2>&1 | grep -v "frame #\|TCPStore\|sendBytes\|should dump" >> "$LOG"
    grep "^iter.*/$ITERS\b\|^etp-train\|Error" "$LOG" | tail -3
  }
  run bf16 --set etp.etp_size=$N --set etp.expert_etp_size=$N --set etp.gather_dtype=param
  run fp8_tensorwise --set etp.etp_size=$N --set etp.expert_etp_size=$N --set etp.gather_dtype=fp8_tensorwise
  run fp8_blockwise --set etp.etp_size=$N --set etp.expert_etp_size=$N --set etp.gather_dtype=fp8_blockwise --set etp.pad_for_alignment=128
  run etp_off --set etp.etp_size=1 --set etp.expert_etp_size=1
  for name in fp8_tensorwise fp8_blockwise etp_off; do
    python3 tools/compare_recipe_runs.py --etp "$OUT/fp8recipe_$name.json" --baseline "$OUT/fp8recipe_bf16.json" \
      --tolerance 0.03 --command "$CMD ($name vs bf16 gathers)" --out "$OUT/fp8recipe_${name}_vs_bf16.json" 2>&1 | tail -5
  done
  ;;
checkpoint)
  N=${NPROC:-8}; H=$((N / 2)); CK=${CKPT_DIR:-/tmp/etp_ckpt}; rm -rf "$CK"
  T=${TRAIN_ITERS:-20}  # 19: one save only (a full-recipe checkpoint is ~66 GB)
  BASE="--recipe recipes/moe_h200x8.yaml --train-iters $T --log-interval 5 --set num_layers=${LAYERS:-8} --set global_batch_size=16 --set save_interval=10 ${EXTRA:-}"
  echo "=== $N GPUs, ETP $N ${SAVE_EXTRA:-}: $T iterations, saving every 10"
  timeout 240 torchrun --nproc-per-node=$N -m etp.megatron.train $BASE --set world_size=$N --set etp.etp_size=$N \
    --set etp.expert_etp_size=$N ${SAVE_EXTRA:-} --set save="$CK/a" --json "$OUT/ckpt_full.json" 2>&1 | grep "^iter\|^etp-train" | tail -12
  du -sh "$CK/a/iter_0000010"
  resume() {  # name, GPUs, then --set overrides: resume from iteration 10 of the first run
    local name=$1 gpus=$2; shift 2
    echo "=== $name: $gpus GPUs, resume from iteration 10 of the first run"
    timeout 240 torchrun --nproc-per-node=$gpus -m etp.megatron.train $BASE --set world_size=$gpus "$@" \
      --set load="$CK/a" --set save="$CK/$name" --resume 10 --json "$OUT/ckpt_$name.json" 2>&1 \
      | grep "^iter\|^etp-train\|Error" | tail -12
  }
  for name in ${RESUMES:-etp$H etp${H}_distopt etp1}; do
    case $name in
      etp$H) resume $name $H --set etp.etp_size=$H --set etp.expert_etp_size=$H ;;
      etp${H}_distopt) resume $name $N --set etp.etp_size=$H --set etp.expert_etp_size=$H --set use_distributed_optimizer=true ;;
      etp1) resume $name $N --set etp.etp_size=1 --set etp.expert_etp_size=1 ;;
    esac
    rm -rf "$CK/$name"  # its own save: the disk holds about three full-recipe checkpoints
  done
  python3 - "$OUT" etp$H etp${H}_distopt etp1 <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
full = json.load(open(f"{out}/ckpt_full.json"))["losses"]
report = {"iterations": list(range(11, len(full) + 1)), "uninterrupted": full[10:]}
for name in names:
    try:
        resumed = json.load(open(f"{out}/ckpt_{name}.json"))["losses"]
    except OSError:
        report[name] = "no result"
        continue
    report[name] = {"resumed": resumed,
                    "max_rel_diff": max(abs(a - b) / b for a, b in zip(resumed, full[10:]))}
json.dump(report, open(f"{out}/ckpt_compare.json", "w"), indent=1)
print(json.dumps({k: (v["max_rel_diff"] if isinstance(v, dict) else v) for k, v in report.items()}))
PY
  ;;
esac
