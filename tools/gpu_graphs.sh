#!/usr/bin/env bash
# Issue #17 (CUDA graphs + activation recompute) on 2 GPUs, from the repository root; megatron-core
# is installed by the caller. Logs and JSON go to $OUT:
#   bash tools/gpu_graphs.sh [graphs|recompute|all]
# graphs:    (a) tests/test_graphs_gpu.py: 10 Adam steps captured vs eager, bit for bit (bf16 / FP8
#                gathers, NCCL / copy-engine), hooks once per replay, replays allocate nothing;
#                full recompute trains bit for bit
#            (b) expert stack: etp_async and etp_async_fp8, eager vs captured (etp.GraphedStep)
# recompute: the flagship recipe at world 2, ETP 2, full recompute of every layer with the recompute
#            chain prefetched and gathered on demand (etp.prefetch_recompute), and without recompute:
#            (c) ITERS (20) iterations each (PROFILE=1: profiled, exposed communication);
#            (d) deterministic: true, 6 iterations each: the three loss curves must be identical
# Every step has its own timeout and the whole script stays under BUDGET seconds (default 540).
source tools/gpu_lib.sh
budget_begin /tmp/etp_graphs 540
N=${NPROC:-2}
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
  # (c) timing, ITERS iterations; (d) deterministic: true, 6 iterations, losses compared exactly
  for kind in ${KINDS:-timing exact}; do
    for run in prefetched on_demand plain; do
      case $run in
        prefetched) SETS="$FULL --set etp.prefetch_recompute=true" ;;
        on_demand) SETS="$FULL --set etp.prefetch_recompute=false" ;;
        plain) SETS="" ;;
      esac
      if [ $kind = timing ]; then MORE="--train-iters ${ITERS:-20} --log-interval 5 ${PROFILE:+--profile $OUT/prof_$run}"
      else MORE="--set deterministic=true --set lr_warmup_iters=2 --train-iters 6 --log-interval 3"; fi
      TAIL=8 step "${kind}_$run" 150 $TRAIN $AT $SETS $MORE --json "$OUT/${kind}_$run.json"
    done
  done
  python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/recompute_table.md"
import json, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(f"{out}/{name}.json"))
    except (OSError, ValueError):
        return None
print("| run | ms/iter | TFLOP/s/GPU | peak GiB | exposed comm ms/iter | host gaps ms/iter |")
print("|---|---:|---:|---:|---:|---:|")
for name in ("prefetched", "on_demand", "plain"):
    r = load(f"timing_{name}")
    if r is None:
        print(f"| {name} | failed / missing | | | | |"); continue
    prof = r.get("profile") or {}
    fmt = lambda v: "n/a" if v is None else f"{v:.1f}"
    print(f"| {name} | {r['ms_per_iter']:.0f} | {r['tflops_per_rank']:.1f} | {r['peak_allocated_gib']:.1f} "
          f"| {fmt(prof.get('exposed_communication'))} | {fmt(prof.get('host_gaps'))} |")
exact = {name: (load(f"exact_{name}") or {}).get("losses") for name in ("prefetched", "on_demand", "plain")}
for name, losses in exact.items():
    print(f"deterministic losses, {name}: {losses}")
if all(exact.values()):
    same = exact["prefetched"] == exact["on_demand"] == exact["plain"]
    print("recompute (prefetched, on demand) vs no recompute, deterministic:", "IDENTICAL" if same else "DIFFERENT")
PY
fi
budget_end
echo "total $(( $(date +%s) - START ))s; results in $OUT"
