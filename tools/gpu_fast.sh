#!/usr/bin/env bash
# Issue #15 (etp-train throughput) on a fresh 2×H200 machine, from the repository root; megatron-core
# is installed by the caller. Everything goes to $OUT (logs, JSON, traces, breakdowns):
#   bash tools/gpu_fast.sh
# (a) GPU parity: SDPAttention vs megatron-core's local DotProductAttention in bf16 (pytest)
# (b) flagship recipe at world 2, ETP 2, micro-batch 2, global batch 8, 12 iterations, profiled,
#     with attention_backend=local then sdpa (breakdown tables printed, traces in $OUT/prof_*)
# (c) deterministic: true twice (6 iterations, sdpa) and the difference of their losses
# (d) recipes/moe_h200x2_wide.yaml with ETP 2, and the peers without ETP (megatron-core DDP; with
#     the distributed optimizer), each at the largest micro-batch the audit says fits (global batch
#     <= 32), 10 iterations
# Every step has its own timeout and the whole script stays under BUDGET seconds (default 530):
# a step that fails or times out is reported and the next one runs. summary.json lists them.
source tools/gpu_lib.sh
budget_begin /tmp/etp_fast 530
FLAG=recipes/moe_h200x8.yaml
WIDE=recipes/moe_h200x2_wide.yaml
TRAIN="torchrun --standalone --nproc-per-node 2 -m etp.megatron.train"
AT2="--set world_size=2 --set etp.etp_size=2 --set etp.expert_etp_size=2"

python3 -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__)"


# (a) bf16 parity on one GPU
TAIL=6 step a_sdpa_parity 90 python3 -m pytest -q -rA tests/test_attention_gpu.py

# (b) where the time goes, local vs sdpa attention
for backend in local sdpa; do
  TAIL=40 step "b_profile_$backend" 130 $TRAIN --recipe $FLAG $AT2 --set global_batch_size=8 --set micro_batch_size=2 \
    --set attention_backend=$backend --train-iters 12 --log-interval 1 \
    --profile "$OUT/prof_$backend" --json "$OUT/b_profile_$backend.json"
done

# (c) deterministic twice, then the loss difference
for run in 1 2; do
  TAIL=8 step "c_deterministic_$run" 90 $TRAIN --recipe $FLAG $AT2 --set global_batch_size=8 --set micro_batch_size=2 \
    --set deterministic=true --set lr_warmup_iters=2 --train-iters 6 --log-interval 1 --json "$OUT/c_deterministic_$run.json"
done
python3 - "$OUT" <<'EOF' 2>&1 | tee "$OUT/c_deterministic_diff.log"
import json, sys
out = sys.argv[1]
try:
    a, b = (json.load(open(f"{out}/c_deterministic_{i}.json"))["losses"] for i in (1, 2))
except (OSError, KeyError, ValueError) as exc:
    print("deterministic diff: a run is missing:", exc); sys.exit(0)
diff = max(abs(x - y) for x, y in zip(a, b))
print("deterministic losses run 1:", a); print("deterministic losses run 2:", b)
print(f"max |difference| = {diff:.3e}:", "IDENTICAL" if a == b else "DIFFERENT")
EOF

# (d) the wide recipe and its peers at the largest micro-batch the audit says fits (global batch <= 32)
best() {  # best ETP_SIZE DISTRIBUTED(0/1) -> micro-batch
  python3 - "$@" <<'EOF'
import sys, torch
from etp.audit.predict import largest_micro_batch
from etp.megatron.recipe import Recipe
size, distributed = int(sys.argv[1]), sys.argv[2] == "1"
recipe = Recipe.from_yaml("recipes/moe_h200x2_wide.yaml", etp={"etp_size": size, "expert_etp_size": size})
gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 141 * 2**30
dp = recipe.data_parallel_size(2)
fit, _ = largest_micro_batch(recipe, 2, gpu, distributed_optimizer=distributed,
                             candidates=[b for b in (1, 2, 4, 8, 16, 32) if b * dp <= 32])
print(fit or 1)
EOF
}
python3 -m etp.audit.cli --recipe $WIDE --gpu-memory local --json "$OUT/d_audit.json" 2>&1 | tail -12 | tee "$OUT/d_audit.log"
MB_ETP=$(best 2 0); MB_DDP=$(best 1 0); MB_DIST=$(best 1 1)
echo "audit's micro-batches: ETP 2 $MB_ETP, DDP $MB_DDP, distributed optimizer $MB_DIST"
TAIL=6 step d_wide_etp2 110 $TRAIN --recipe $WIDE --set micro_batch_size=$MB_ETP --set global_batch_size=32 \
  --train-iters 10 --log-interval 1 --json "$OUT/d_wide_etp2.json"
TAIL=6 step d_wide_ddp 110 $TRAIN --recipe $WIDE --set etp.etp_size=1 --set etp.expert_etp_size=1 \
  --set micro_batch_size=$MB_DDP --set global_batch_size=32 --train-iters 10 --log-interval 1 --json "$OUT/d_wide_ddp.json"
TAIL=6 step d_wide_distopt 110 $TRAIN --recipe $WIDE --set etp.etp_size=1 --set etp.expert_etp_size=1 \
  --set use_distributed_optimizer=true --set micro_batch_size=$MB_DIST --set global_batch_size=32 \
  --train-iters 10 --log-interval 1 --json "$OUT/d_wide_distopt.json"

python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
rows = []
for name in ("b_profile_local", "b_profile_sdpa", "c_deterministic_1", "d_wide_etp2", "d_wide_ddp", "d_wide_distopt"):
    try:
        r = json.load(open(f"{out}/{name}.json"))
    except (OSError, ValueError):
        rows.append(f"| {name} | failed / missing | | | | |"); continue
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
    predicted = f"{r['predicted_peak_gib']:.1f}" if r.get("predicted_peak_gib") else "n/a"
    rows.append(f"| {name} | {r['ms_per_iter']:.0f} | {r['tflops_per_rank']:.1f} | {mfu} | {r['peak_allocated_gib']:.1f} "
                f"| {predicted} |")
print("| run | ms/iter | TFLOP/s/GPU (attention counted) | MFU | peak GiB | audit's predicted peak GiB |")
print("|---|---:|---:|---:|---:|---:|")
print("\n".join(rows))
EOF
budget_end
echo "total $(( $(date +%s) - START ))s; results in $OUT"
