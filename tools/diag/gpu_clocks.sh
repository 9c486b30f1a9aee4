#!/usr/bin/env bash
# Samples every GPU's SM clock, power and throttle reasons (nvidia-smi, every 100 ms) while a
# command runs; writes the samples and a per-GPU summary (median clock and power, throttled
# share) next to them. Used to ask whether a variant's kernels run slower because the chip
# clocks down (power), not because of what runs beside them:
#   bash tools/diag/gpu_clocks.sh $OUT/clocks_replicated torchrun ... tools/bench_expert_stack.py --variants replicated
set -uo pipefail
PREFIX=$1; shift
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,clocks_throttle_reasons.active \
  --format=csv,noheader,nounits -lms 100 > "$PREFIX.csv" &
SAMPLER=$!
"$@"
RC=$?
kill $SAMPLER 2>/dev/null; wait $SAMPLER 2>/dev/null
python3 - "$PREFIX.csv" <<'PY'
import statistics, sys
rows = [[c.strip() for c in line.split(",")] for line in open(sys.argv[1]) if line.count(",") >= 4]
by_gpu = {}
for _, index, clock, power, reasons in rows:
    try:
        by_gpu.setdefault(index, []).append((float(clock), float(power), int(reasons, 16)))
    except ValueError:
        continue
for index, samples in sorted(by_gpu.items()):
    busy = [s for s in samples if s[1] > 200]  # the samples while the benchmark loads the GPU
    if not busy:
        continue
    print(f"GPU {index}: {len(busy)} busy samples, SM clock median {statistics.median(s[0] for s in busy):.0f} MHz "
          f"(min {min(s[0] for s in busy):.0f}), power median {statistics.median(s[1] for s in busy):.0f} W, "
          f"power-capped in {sum(1 for s in busy if s[2] & 0x4) / len(busy):.0%} "
          f"(any throttle {sum(1 for s in busy if s[2] & ~0x1) / len(busy):.0%})")
PY
exit $RC
