#!/usr/bin/env bash
# Issue #17 (CUDA graphs + activation recompute) on 2 GPUs, from the repository root; megatron-core
# is installed by the caller. Logs and JSON go to $OUT:
#   bash tools/gpu_graphs.sh [graphs|recompute|all]
# graphs:    (a) tests/test_graphs_gpu.py: 10 Adam steps captured vs eager, bit for bit (bf16 / FP8
#                gathers, NCCL / copy-engine), hooks once per replay, replays allocate nothing;
#                full recompute trains bit for bit
#            (b) expert stack: etp_async and etp_async_fp8, eager vs captured (etp.GraphedStep)
# recompute: (c) the flagship recipe at world 2, ETP 2, full recompute of every layer, with the
#                recompute chain prefetched and gathered on demand (etp.prefetch_recompute),
#                12 iterations each, profiled (exposed communication), and without recompute
# Every step has its own timeout and the whole script stays under BUDGET seconds (default 540).
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/etp_graphs}; mkdir -p "$OUT"
BUDGET=${BUDGET:-540}
START=$(date +%s)
N=${NPROC:-2}
echo "{" > "$OUT/summary.json.part"
source tools/gpu_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
WHAT=${1:-all}

if [ "$WHAT" = graphs ] || [ "$WHAT" = all ]; then
  TAIL=15 step a_graphs_tests 240 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=200 python3 -m pytest -q -rA \
    -p no:cacheprovider tests/test_graphs_gpu.py
  TAIL=25 step b_bench_graphed 200 torchrun --standalone --nproc-per-node "$N" tools/bench_expert_stack.py \
    --variants replicated,etp_async,etp_async_graphed,etp_async_fp8,etp_async_fp8_graphed \
    --out "$OUT/bench_graphed.json"
fi

if [ "$WHAT" = recompute ] || [ "$WHAT" = all ]; then
  TRAIN="torchrun --standalone --nproc-per-node $N -m etp.megatron.train --recipe recipes/moe_h200x8.yaml"
  AT="--set world_size=$N --set etp.etp_size=$N --set etp.expert_etp_size=$N --set global_batch_size=$((4 * N))"
  FULL="--set recompute_granularity=full --set recompute_method=uniform --set recompute_num_layers=1"
  for run in prefetched on_demand plain; do
    case $run in
      prefetched) SETS="$FULL --set etp.prefetch_recompute=true" ;;
      on_demand) SETS="$FULL --set etp.prefetch_recompute=false" ;;
      plain) SETS="" ;;
    esac
    TAIL=30 step "c_recompute_$run" 170 $TRAIN $AT $SETS --train-iters 12 --log-interval 4 \
      --profile "$OUT/prof_$run" --json "$OUT/c_recompute_$run.json"
  done
  python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/c_recompute_table.md"
import json, sys
out = sys.argv[1]
print("| run | ms/iter | TFLOP/s/GPU | peak GiB | exposed comm ms/iter | busy ms/iter | final loss |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name in ("prefetched", "on_demand", "plain"):
    try:
        r = json.load(open(f"{out}/c_recompute_{name}.json"))
    except (OSError, ValueError):
        print(f"| {name} | failed / missing | | | | | |"); continue
    prof = r.get("profile") or {}
    per = prof.get("per_iteration_ms") or prof
    exposed, busy = per.get("exposed_communication"), per.get("busy")
    fmt = lambda v: "n/a" if v is None else f"{v:.1f}"
    print(f"| {name} | {r['ms_per_iter']:.0f} | {r['tflops_per_rank']:.1f} | {r['peak_allocated_gib']:.1f} "
          f"| {fmt(exposed)} | {fmt(busy)} | {r['losses'][-1]:.4f} |")
PY
fi
echo "\"elapsed_s\": $(( $(date +%s) - START ))}" >> "$OUT/summary.json.part"
mv "$OUT/summary.json.part" "$OUT/summary.json"
echo "total $(( $(date +%s) - START ))s; results in $OUT"
