#!/usr/bin/env bash
# Issue #14 (SM-free communication) on a fresh 2xH200 machine, from the repository root:
#   bash tools/gpu_overlap.sh
# megatron-core is installed by the caller's wrapper. Every step has its own timeout and a
# failing step never stops the next; the whole script stays under 9 minutes. Output in $OUT:
#   probe_nccl_ce.json      NCCL 2.28 zero-CTA / window registration / max_ctas from torch
#   gpu_tests.log           tests/test_transport_gpu.py + the Triton RS kernel tests, 2 GPUs
#   bench_overlap.json/.md  each gather / reduce-scatter alone and beside a grouped GEMM
#   bench_expert_stack.json, BENCHMARKS_expert_stack.md, trace/  the expert stack, all variants
set -uo pipefail
OUT=${OUT:-/tmp/etp_overlap_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 ETP_TEST_TIMEOUT=120
T0=$SECONDS
status() { echo "=== [$((SECONDS - T0))s] $1: exit $2" | tee -a "$OUT/steps.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"

echo "=== 1. probe: NCCL zero-CTA policy, symmetric windows, per-communicator max_ctas"
timeout -k 5 50 torchrun --nproc-per-node=2 tools/probe_nccl_ce.py --out "$OUT/probe_nccl_ce.json" \
  > "$OUT/probe.log" 2>&1; status probe $?
grep "\[probe\]" "$OUT/probe.log" | cut -c1-400

echo "=== 2. GPU tests, 2 GPUs (copy-engine parity, async == sync bf16/FP8, symm RS kernel compiled)"
ETP_TEST_BACKEND=nccl timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/test_transport_gpu.py \
  "tests/test_transport.py::test_symm_reduce_kernel_matches_reference_and_float64" \
  > "$OUT/gpu_tests.log" 2>&1; status gpu_tests $?
tail -8 "$OUT/gpu_tests.log"

echo "=== 3. bench_overlap: each transport alone and beside a grouped GEMM"
timeout -k 5 110 torchrun --nproc-per-node=2 tools/bench_overlap.py --out "$OUT/bench_overlap.json" \
  --md "$OUT/BENCHMARKS_overlap.md" > "$OUT/bench_overlap.log" 2>&1; status bench_overlap $?
tail -3 "$OUT/bench_overlap.log"

echo "=== 4. bench_expert_stack: replicated, FSDP2, NCCL ETP and the new transports"
VARIANTS=replicated,replicated_fp8,fsdp2,etp_async,etp_async_fp8,etp_async_ce,etp_async_ce_fp8,etp_async_ce_symm,etp_async_ce_fp8_symm,etp_async_ce_pull,etp_async_ce_fp8_pull,etp_async_capped
timeout -k 5 215 torchrun --nproc-per-node=2 tools/bench_expert_stack.py --variants "$VARIANTS" \
  --trace "$OUT/trace" --out "$OUT/bench_expert_stack.json" --benchmarks-md "$OUT/BENCHMARKS_expert_stack.md" \
  > "$OUT/bench_expert_stack.log" 2>&1; status bench_expert_stack $?
tail -3 "$OUT/bench_expert_stack.log"

echo "=== summary"
cat "$OUT/steps.txt"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception as exc:  # noqa: BLE001
        print(f"({name}: {exc})")
        return None
probe = load("probe_nccl_ce.json")
if probe:
    for key in ("max_ctas_4_reduce_scatter", "zero_cta_plain_buffers", "zero_cta_nccl_symmetric_window"):
        step = probe.get(key, {})
        prof = step.get("profile", {})
        print(f"probe {key}: ok={step.get('ok')} ms={step.get('ms')} kernels={[k for k, _ in prof.get('kernels', [])][:2]} "
              f"grids={[g for _, g in prof.get('kernels', [])][:2]} memcpy={prof.get('memcpy')} {step.get('error', '')[:120]}")
ov = load("bench_overlap.json")
if ov:
    print(f"\n| op | alone ms | beside ms | GEMM slowdown % | SM kernels |  (GEMM alone {ov['gemm_alone_ms']*1e3:.0f} us)")
    for r in ov["ops"]:
        if r["status"] != "ok":
            print(f"| {r['op']} | {r['status'][:80]} |")
            continue
        print(f"| {r['op']} | {r['alone_ms']:.3f} | {r.get('beside_op_ms', float('nan')):.3f} | "
              f"{r.get('gemm_slowdown_pct', float('nan')):+.1f} | {len(r.get('sm_kernels', []))} |")
es = load("bench_expert_stack.json")
if es:
    print("\n| variant | step ms | x replicated | peak GiB | + symmetric GiB | transports |")
    for name, r in es["results"].items():
        if r.get("status") != "ok":
            print(f"| {name} | {str(r.get('status'))[:80]} |")
            continue
        stats = r.get("runtime_stats") if isinstance(r.get("runtime_stats"), dict) else {}
        symm = ((stats or {}).get("nbytes") or {}).get("transport", 0) / 2**30
        print(f"| {name} | {r['step_ms']:.2f} | {r.get('fraction_of_replicated', float('nan')):.3f} | "
              f"{r.get('peak_allocated_gib') or float('nan'):.2f} | {symm:.2f} | "
              f"{list((r.get('transports') or {}).values())[:1]} |")
PY
echo "=== total $((SECONDS - T0))s"
