#!/usr/bin/env bash
# Issue #15, host overhead of the TE-free megatron-core step, from the repository root on a GPU
# machine (megatron-core installed by the caller). Every GPU visible is used (NPROC to override);
# ETP is on when NPROC > 1 (ETP = NPROC), off at one GPU. Three runs of the flagship recipe,
# global batch 2 x NPROC x 2 (two micro-batches of 2 per rank), ITERS iterations, profiled
# (etp-train --profile: kernel classes, host launches / syncs, cProfile hot spots):
#   stock:  megatron_fallbacks=stock, moe_token_dispatcher_type=alltoall (megatron-core as shipped)
#   fast:   megatron_fallbacks=fast (etp.megatron.fast_fallbacks), alltoall
#   local:  fast + moe_token_dispatcher_type=local (etp.megatron.local_dispatcher)
#   eager:  local with overlap_grad_reduce=false (the pair of graph)
#   graph:  eager + cuda_graph=step (etp.megatron.graph_step; not in the default VARIANTS)
#   OUT=/tmp/etp_host bash tools/gpu_host.sh
source tools/gpu_lib.sh
budget_begin /tmp/etp_host 530
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
ITERS=${ITERS:-14}
MICRO=${MICRO:-2}
ETP=$(( NPROC > 1 ? NPROC : 1 ))

TAIL=4 step tests 120 python3 -m pytest -q -rs tests/test_megatron_fallbacks.py tests/test_local_dispatcher.py
for variant in ${VARIANTS:-stock fast local}; do
  case $variant in
    stock) SETS="--set megatron_fallbacks=stock --set moe_token_dispatcher_type=alltoall" ;;
    fast)  SETS="--set megatron_fallbacks=fast --set moe_token_dispatcher_type=alltoall" ;;
    local) SETS="--set megatron_fallbacks=fast --set moe_token_dispatcher_type=local" ;;
    eager) SETS="--set moe_token_dispatcher_type=local --set overlap_grad_reduce=false" ;;
    graph) SETS="--set moe_token_dispatcher_type=local --set overlap_grad_reduce=false --set cuda_graph=step" ;;
    *) echo "unknown variant $variant (stock | fast | local | eager | graph)"; continue ;;
  esac
  TAIL=22 step "host_$variant" 150 torchrun --standalone --nproc-per-node "$NPROC" -m etp.megatron.train \
    --recipe recipes/moe_h200x8.yaml --set world_size=$NPROC --set etp.etp_size=$ETP --set etp.expert_etp_size=$ETP \
    --set micro_batch_size=$MICRO --set global_batch_size=$(( NPROC * MICRO * 2 )) $SETS \
    --train-iters "$ITERS" --log-interval 1 --profile "/tmp/prof_$variant" --json "$OUT/host_$variant.json"
  cp "/tmp/prof_$variant/host_rank0.txt" "$OUT/host_${variant}_python.txt" 2>/dev/null
done
budget_end
