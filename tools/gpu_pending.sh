#!/usr/bin/env bash
# What changed after its last 2-GPU run, in priority order, for the next session with 2 GPUs
# (from the repository root; megatron-core installed by the caller):
#   OUT=/tmp/etp_pending bash tools/gpu_pending.sh
# Session 6 (2026-11-23) ran everything sessions 3-5 had left here (BENCHMARKS.md "2xH200,
# session 6"); what it changed afterwards without a device run:
# (a) GPU tests: the FP8 recipe test and the FP8 GEMM tests with fp8_wgrad: true and
#     fp8_weight_scaling: delayed as the defaults (commit b6c322f), the graph tests
# (b) the flagship recipe with FP8 gathers and the new defaults beside bf16 gathers (25 iterations,
#     compare_recipe_runs, tolerance 0.03), and the wide recipe with FP8 gathers (defaults)
# (c) bench_overlap with each beside-run paired with a fresh GEMM-alone time
# (d) expert stack with the defaults: replicated / replicated_fp8 / replicated_fp8_wgrad /
#     etp_async_ce / etp_async_ce_fp8_wgrad, and the quantization plan (c400bfd) on etp_async_fp8 (NCCL gathers)
# (e) bench_ep: SonicMoE's and the DeepSeek-V3-like workloads (issue 16's target: >= 1.2x NCCL's
#     all-to-all; last measured 0.47x / 0.32x, session 2), and symm_push on 64 / 132 CTAs
# Each step has its own timeout; the whole script stays under BUDGET seconds (default 560).
# ONLY (tools/gpu_lib.sh) runs a subset, e.g. ONLY='^(a_|b_)'.
source tools/gpu_lib.sh
budget_begin /tmp/etp_pending 560
FLAG=recipes/moe_h200x8.yaml
WIDE=recipes/moe_h200x2_wide.yaml
TRAIN="torchrun --standalone --nproc-per-node 2 -m etp.megatron.train"
AT2="--set world_size=2 --set global_batch_size=8 --set etp.etp_size=2 --set etp.expert_etp_size=2"

# (a)
TAIL=8 step a_tests 200 env ETP_TEST_BACKEND=nccl python3 -m pytest -q -rs -p no:warnings \
  tests/test_fp8_recipe_gpu.py tests/test_fp8.py tests/test_colwise.py tests/test_graphs_gpu.py

# (b)
for gd in bf16 fp8_tensorwise; do
  TAIL=4 step "b_recipe_$gd" 75 $TRAIN --recipe $FLAG $AT2 --set etp.gather_dtype=$gd \
    --train-iters 25 --log-interval 5 --json "$OUT/b_recipe_$gd.json"
done
TAIL=4 step b_compare 30 python3 tools/compare_recipe_runs.py --etp "$OUT/b_recipe_fp8_tensorwise.json" \
  --baseline "$OUT/b_recipe_bf16.json" --tolerance 0.03
TAIL=4 step b_wide_fp8 90 $TRAIN --recipe $WIDE --set micro_batch_size=16 --set global_batch_size=32 \
  --set etp.gather_dtype=fp8_tensorwise --train-iters 10 --log-interval 1 --json "$OUT/b_wide_fp8.json"

# (c)
TAIL=16 step c_overlap 90 torchrun --standalone --nproc-per-node 2 tools/bench_overlap.py --reduce-ctas 8 \
  --out "$OUT/bench_overlap.json"

# (d)
TAIL=12 step d_expert_stack 120 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants replicated,replicated_fp8,replicated_fp8_wgrad,etp_async_fp8,etp_async_ce,etp_async_ce_fp8_wgrad \
  --out "$OUT/bench_expert_stack.json"

# (e)
TAIL=16 step e_bench_ep 150 torchrun --standalone --nproc-per-node 2 tools/bench_ep.py \
  --workloads sonicmoe,deepseek_v3 --iters 5 --warmup 2 --out "$OUT/bench_ep.json"
# The symm kernels run on EPConfig.num_ctas (32) CTAs: is 0.47x of NCCL a CTA budget, not a design limit?
for ctas in 64 132; do
  TAIL=10 step "e_bench_ep_ctas$ctas" 90 torchrun --standalone --nproc-per-node 2 tools/bench_ep.py \
    --workloads sonicmoe --backends symm_push --num-ctas $ctas --iters 5 --warmup 2 --out "$OUT/bench_ep_ctas$ctas.json"
done

python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
print("| run | ms/iter | TFLOP/s/GPU | peak GiB | first / last loss |")
print("|---|---:|---:|---:|---|")
for name in ("b_recipe_bf16", "b_recipe_fp8_tensorwise", "b_wide_fp8"):
    try:
        r = json.load(open(f"{out}/{name}.json"))
    except (OSError, ValueError):
        print(f"| {name} | failed / missing | | | |"); continue
    print(f"| {name} | {r['ms_per_iter']:.1f} | {r['tflops_per_rank']:.1f} | {r['peak_allocated_gib']:.2f} "
          f"| {r['losses'][0]:.4f} / {r['losses'][-1]:.4f} |")
EOF
budget_end
