#!/usr/bin/env bash
# Expert parallelism (etp.ep) on one 4-GPU machine (H100 / H200), from the repository root,
# megatron-core importable, NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 as the
# device machines preset them. Every log and JSON goes to $OUT (default /tmp/etp_ep); the last
# step prints the targets, met or not, from every JSON that was written:
#   bash tools/gpu_ep_check.sh                        everything (about 8 minutes)
#   ONLY='^(a|b|c|d|t)' bash tools/gpu_ep_check.sh    tests and benchmarks (about 5 minutes)
#   ONLY='^(e|t)' bash tools/gpu_ep_check.sh          the flagship recipe runs (about 3 minutes)
# (a) GPU tests on GPUs 0,1: the move kernels compiled (1 GPU), every backend against
#     reference, CUDA-graph replay = eager bit for bit (symm_*, nccl_padded), moves that
#     allocate nothing (symm_*, nccl, nccl_padded), hierarchical over 2 declared hosts x 1
# (b) beside (a), on GPUs 2,3: tools/bench_ep.py at 2 ranks, both workloads, every backend,
#     NCCL all_to_all_single of the same bytes and megatron's alltoall dispatcher in the run
# (c) 4 GPUs: hierarchical over 2 declared hosts x 2 against reference
# (d) 4 GPUs: tools/bench_ep.py at 4 ranks, the same plus hierarchical over 2 hosts x 2. In (b)
#     and (d) the rows "symm_push@combine=pull" and "symm_dedup@combine=pull/peer_order=sequential"
#     are the combines as they were (pulled from the peers, peers in rank order) beside the
#     pushed, rotated ones
# (e) 4 GPUs: the flagship recipe at world 4, each dispatcher at its defaults (etp's and the local
#     one captured by auto where the audit fits them, megatron's alltoall eager: it syncs with the
#     host), global batch 16, dense ETP 4, 15 iterations: EP 4 with the etp dispatcher (and eager)
#     / megatron's alltoall, EP 2 x expert ETP 2 (etp dispatcher), EP 1 x expert ETP 4 (the
#     recipe's own local dispatcher)
# (t) the targets table (tools/bench_ep.py --targets), and what backend=auto chose
set -uo pipefail
OUT=${OUT:-/tmp/etp_ep}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export ETP_CACHE_DIR="$OUT/ep_cache" ETP_TEST_TIMEOUT=120
START=$(date +%s)

# step NAME TIMEOUT CMD...: CMD in its own process group with a time limit, logged to
# $OUT/NAME.log; prints the log's tail and the exit code. ONLY (a regex) selects steps.
step() {
  local name=$1 limit=$2; shift 2
  if [[ -n "${ONLY:-}" ]] && ! [[ $name =~ $ONLY ]]; then return 0; fi
  echo "=== $name (limit ${limit}s): $*"
  local began=$(date +%s)
  setsid timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "^W[0-9]\|OMP_NUM_THREADS\|\*\*\*\*\*\|warnings.warn\|UserWarning\|FutureWarning" "$OUT/$name.log" \
    | tail -"${TAIL:-15}"
  echo "--- $name: rc=$rc in $(( $(date +%s) - began ))s (total $(( $(date +%s) - START ))s)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -4
python3 -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), 'megatron-core', m.__version__)"
BACKENDS="nccl,nccl_padded,symm_push,symm_push@combine=pull,symm_allgather,symm_dedup"
BACKENDS="$BACKENDS,symm_dedup@combine=pull/peer_order=sequential"

# (a) and (b) side by side, two GPUs each
( export CUDA_VISIBLE_DEVICES=0,1
  TAIL=14 step a_tests_2gpu 270 env ETP_TEST_BACKEND=nccl python3 -m pytest -q -rs -p no:warnings \
    -p no:cacheprovider tests/kernels/test_ep_kernels.py tests/ep/test_ep_gpu.py ) &
( export CUDA_VISIBLE_DEVICES=2,3
  TAIL=12 step b_bench_2gpu 270 torchrun --standalone --nproc-per-node 2 tools/bench_ep.py --backends "$BACKENDS" \
    --out "$OUT/bench_ep_2gpu.json" --benchmarks-md "$OUT/bench_ep_2gpu.md" ) &
wait

# (c), (d): 4 GPUs
TAIL=8 step c_tests_4gpu 120 env ETP_TEST_BACKEND=nccl python3 -m pytest -q -rs -p no:warnings -p no:cacheprovider \
  tests/ep/test_ep_gpu.py -k "hierarchical and 4"
TAIL=12 step d_bench_4gpu 240 torchrun --standalone --nproc-per-node 4 tools/bench_ep.py \
  --backends "$BACKENDS,hierarchical@ranks_per_host=2" --out "$OUT/bench_ep_4gpu.json" \
  --benchmarks-md "$OUT/bench_ep_4gpu.md"

# (e) the flagship recipe at world 4
TRAIN="torchrun --standalone --nproc-per-node 4 -m etp.train --recipe recipes/moe_flagship.yaml"
# --log-interval 1: every iteration is a log window, so (t) compares the runs over their
# steady second half (tools/bench_ep.py steady_ms), not over compilation and warm-up.
AT4="--set global_batch_size=16 --set etp.etp_size=4 --train-iters 15 --log-interval 1"
TAIL=4 step e_ep4_etp 110 $TRAIN $AT4 --set expert_model_parallel_size=4 \
  --set etp.expert_etp_size=1 --set moe_token_dispatcher_type=etp --json "$OUT/e_ep4_etp.json"
TAIL=4 step e_ep4_etp_eager 110 $TRAIN $AT4 --set cuda_graph=none --set expert_model_parallel_size=4 \
  --set etp.expert_etp_size=1 --set moe_token_dispatcher_type=etp --json "$OUT/e_ep4_etp_eager.json"
TAIL=4 step e_ep4_alltoall 110 $TRAIN $AT4 --set expert_model_parallel_size=4 --set etp.expert_etp_size=1 \
  --set moe_token_dispatcher_type=alltoall --json "$OUT/e_ep4_alltoall.json"
# A hang prints every rank's Python stacks into the log after 90 s (ETP_DUMP_STACKS_AFTER).
TAIL=4 step e_ep2_xetp2 110 env ETP_DUMP_STACKS_AFTER=90 $TRAIN $AT4 --set expert_model_parallel_size=2 --set etp.expert_etp_size=2 \
  --set moe_token_dispatcher_type=etp --json "$OUT/e_ep2_xetp2.json"
TAIL=4 step e_ep1_xetp4 110 $TRAIN $AT4 --set etp.expert_etp_size=4 --json "$OUT/e_ep1_xetp4.json"

# (t) the targets, from whatever ran; what backend=auto chose, with every candidate's times
files=()
for f in bench_ep_2gpu bench_ep_4gpu e_ep4_etp e_ep4_etp_eager e_ep4_alltoall e_ep2_xetp2 e_ep1_xetp4; do
  [[ -s "$OUT/$f.json" ]] && files+=("${f#e_}=$OUT/$f.json")
done
if (( ${#files[@]} )); then
  TAIL=200 step t_targets 60 python3 tools/bench_ep.py --targets "${files[@]}"
fi
[[ -s "$ETP_CACHE_DIR/ep_backends.json" ]] && cat "$ETP_CACHE_DIR/ep_backends.json"
echo "total $(( $(date +%s) - START ))s; logs and JSON in $OUT"
