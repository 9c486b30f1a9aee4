#!/usr/bin/env bash
# What changed after its last 2-GPU run, in priority order, for the next session with 2 GPUs
# (from the repository root; megatron-core installed by the caller):
#   OUT=/tmp/etp_pending bash tools/gpu_pending.sh
# Session 7 (2026-11-23) ran session 6's (a)-(c) and (e)'s sweep (BENCHMARKS.md "2xH200, session 7");
# what it changed afterwards, or could not run for lack of device time:
# (a) GPU tests: the EP move kernels after the shared-memory cap (4 cases failed on one GPU
#     before it), the EP GPU tests with num_ctas 132, the embedding-gradient kernel compiled
# (b) bench_ep at the new defaults (132 CTAs): both workloads, forward and backward moves
# (c) the deterministic captured-vs-eager recipe test (bf16 and FP8 gathers; passed at 6 iterations)
# (d) expert stack: bf16 etp_async_ce_capped with --reduce-ctas 16 --gemm-sm-carveout 17 beside replicated
# (e) issue 16's second target: etp's dispatcher against megatron-core's alltoall end to end
#     (tools/bench_ep_megatron.py, new; only its CPU smoke ran)
# Session 8 (2026-11-24) ran (a)-(k) (BENCHMARKS.md "2xH200, session 8"); nothing is pending.
# Kept as the record of those calls' exact command lines. Session 8 added:
# (f) the amax kernel's int16 reduction and cached launch tables: the kernel tests compiled, and
#     bench_kernels' amax sweep (issue 13's 0.80 of the copy's byte rate)
# (g) EP: the trimmed dispatch (valid rows only, no padding back to the capacity) on every
#     backend, and the megatron-dispatcher comparison again with a profile of each round trip
# (h) issue 15, ETP on vs off at micro-batch 2: ETPConfig.gather_reuse chain / pass / step
#     beside ETP off, one call (the flagship recipe at world 2, global batch 8)
# (i) micro-batch 2 with gather_reuse=step and the 16-bit-wire reductions (copy_engine,
#     symm_triton) and with FP8 gathers: what is left of ETP's gap to ETP off there is the
#     per-micro-batch fp32 reduce-scatter
# (j) one call, same machine: micro-batch 2 ETP off vs ETP 2 (chain, the default) vs ETP 2 with
#     gather_reuse=step + reduce_transport=copy_engine, 25 iterations each (loss compared
#     after); the wide recipe with FP8 gathers, default vs step + copy_engine
# (k) micro-batch 2 again, alternating: ETP off / step + copy_engine reduce (plain, with a
#     2-SM GEMM carve-out for the reduction's one-CTA barrier kernels, with FP8 gathers)
# (l) the EP 2 recipe through the trimmed etp dispatcher (adapter rewritten in session 8) beside
#     megatron's alltoall dispatcher, 25 iterations each, deterministic; the EP GPU tests again
# Session 9 (2026-11-24) ran (m), (n), (o) (BENCHMARKS.md "2xH200 and 1xH200, session 9"); it added:
# (m) issue 14: the push reduce-scatter (reduce_transport=copy_engine_push: copy-engine pushes
#     fenced by stream flag operations, the fp32 sum on the compute stream between GEMMs): the
#     transport GPU tests, then the expert stack beside replicated, without and with a 1-SM
#     carve-out (the copy-engine gather's barrier kernel), traced
# (n) issue 13: the flagship recipe deterministic (no NaN fill of new allocations now) with bf16,
#     fp8_tensorwise and fp8_blockwise gathers and ETP off, compared after; deterministic FP8 with
#     torch's NaN fill back on (ETP_DETERMINISTIC_FILL=1) for the before / after figure
# Session 11 (2026-11-26) added:
# (p) issue 14: the copy-engine gather fenced by stream flag operations (FlagBarrier) instead of
#     two barrier kernels per gather: the transport GPU tests (a FlagBarrier ordering test, no
#     barrier kernel in a profiled step), then the expert stack in two interleaved rounds beside
#     replicated and the kernel-fenced gather (etp_async_ce_push_kfence), traced
# (q) the flagship recipe (world 2, ETP 2/2) with the push reduce-scatter beside the default
#     reductions and ETP off, bf16 and FP8 gathers, loss compared after
# (r) issue 13: does FP8 track bf16 once the loss has settled? The flagship recipe deterministic at
#     its own 50 iterations with bf16 and fp8_tensorwise gathers; at 25 iterations FP8 without FP8
#     weight gradients (which part of FP8 moves the trajectory) and bf16 with another seed (how far
#     two bf16 runs differ in the same window)
# (s) after reduce_transport auto -> copy_engine_push and one stream lookup per fence: the expert
#     stack (bf16 and FP8, flag vs kernel fences) and the flagship recipe, auto vs NCCL reductions,
#     bf16 and FP8 gathers, and a captured run (cuda_graph=step: auto swaps to NCCL)
# (t) the GPU tests the auto change touches: transports, stream ops, graphs, the captured recipe,
#     the 2-layer FP8 recipe; then bench_overlap with the flag-fenced and kernel-fenced gathers and
#     the push reduce-scatter beside a grouped GEMM
# (u) bench_overlap with paired rounds (GEMMs alone right before GEMMs beside, median of 5): the
#     gathers and the bf16 reductions; the expert stack traced, replicated vs push (both traces
#     kept, gzipped: which GEMMs run slower beside the copy engines)
# (v) is the GEMMs' +5% beside ETP a clock effect? The expert stack, replicated and push each in
#     its own run, with SM clocks, power and throttle reasons sampled (tools/gpu_clocks.sh)
# (w) RUN in session 12 (w_graph_det not yet): every transport GPU test (the flag_pad refactor);
#     the own rows of a copy-engine gather copied on a companion stream beside the peer pull
#     (session 11's own_copy_beside: no gain, removed; the variants below are gone) against the
#     default; bf16 and FP8 recipe runs profiled, rank 0's traces through trace_gaps (host
#     gaps, --stream-waits); the two deterministic captured-vs-eager recipe tests (their reduce
#     transport pinned to nccl; not run in sessions 11 and 12)
# (x) session 12: does a device-local copy block a grouped GEMM beside it (tools/probe_local_copy.py);
#     the expert stack's push variant traced, its compute-stream gaps that end with an own-rows copy
# (y) RUN in session 13 (call 1; the graph test's busy_ticket then fixed, rerun in (z)): ETPConfig.alias_own_rows on the real recipe
#     and everywhere else. Its GPU test and the expert stack ran (58.15 vs 60.95 ms); then: every
#     transport GPU test, the graph tests, the flagship recipe bf16 and FP8 with it on and off
#     (25 iterations each, the pairs interleaved), and the audit's prediction against the measured
#     peak with it on. Make it the default (ETPConfig, configs/etp.yaml, README, docs) when the
#     recipe trains with it (loss within compare_recipe_runs' 3%) and is not slower.
# (z) session 13: the sync-free optimizer step (no host read of the grad norm or the loss per
#     iteration) against the code before it (tools/scratch/old: `git archive <commit> etp`, carried),
#     bf16 and FP8, and alias_own_rows on top; interleaved, 30 iterations, medians of the 5-iteration
#     windows compared after. The GPU tests: sync-free vs megatron's own step, the fixed graph test.
# (ab) session 13, after alias_own_rows became the default and the sync-free step: the flagship
#     recipe with --timeline (host issue vs device, unprofiled), bf16 / FP8 / bf16 / FP8 / ETP off;
#     every transport and graph GPU test (now aliased by default); the megatron training tests.
# (ac) session 13: the recipe is issue-bound (step (ab): leads ~0 in forward and backward; FP8's host
#     issue +50 ms a pass): whole-step capture (cuda_graph=step) against eager, FP8 and bf16, 20 iterations.
# Each step has its own timeout; the whole script stays under BUDGET seconds (default 560).
# (ad) session 14: where the FP8 recipe's extra ~100 ms of host issue per iteration goes (cProfile
#      per function, launches and syncs per iteration, bf16 beside it) and where replicated_fp8's
#      device time goes against replicated (one stack trace each, kernels paired).
# (ae) session 14: why a captured micro-batch takes ~90 ms of device time when eager's kernels are
#      busy ~45 ms per micro-batch: the captured recipe (bf16, FP8) profiled.
# (af) session 14: the push reduce-scatter's flags became set-and-clear signals, so captured steps
#      keep it (step (ae): under capture the NCCL fallback's fp32 LL reduce-scatter took 40 ms of a
#      90 ms micro-batch): the graph tests (captured == eager bit for bit, push included), the
#      transport tests, then the recipe eager vs captured, bf16 and FP8.
# (ag) session 14, after (af): captured beside eager once more, with ETP off (captured and eager)
#      and FP8 blockwise captured, then the deterministic captured == eager recipe test in FP8
#      (now with the push reduce-scatter on both sides).
# (ah) session 14: the bf16 deterministic captured == eager recipe test (push on both sides), and the
#      expert stack on 2xH200 after the set-and-clear flags (two more stream writes per push).
# (ai) session 14: why the FP8 push stack (56.6 ms) is no faster than bf16 push (55.9) on 2xH200 when
#      replicated_fp8_wgrad is 20% faster than replicated: traces of both, GEMMs paired, stream waits.
# (aj) session 14, after (ai) showed the eager FP8 push stack idle on its compute stream (host launches,
#      GEMMs no slower): the expert stack captured on both sides (GraphedStep), eager peers beside.
# (ak) session 15, after (aj) showed capture does not help the bf16 push stack (55.6 ms graphed, 55.2
#      eager, replicated 49.4): where its compute stream waits (trace, stream waits per step), and
#      replicated_fp8_wgrad_graphed again after its scales became stable buffers (NaN in (aj)).
# (al) session 15, after (ak) put the bf16 push stack's 5.6 ms over replicated in GEMMs slowed 5.5%
#      beside the copies (2.4 ms), the push sums (1.8 ms) and the step's head gather and tail push
#      (1.3 ms): forward gathers kept for backward (gather_reuse "pass", half the gather bytes).
# (am) session 15, after (al): reuse changed nothing (56.67 against 56.64 ms) and its GEMMs are
#      still 5-8% slower than replicated's with nothing beside them: is it where the weight lives
#      (a VMM-mapped gather buffer, a buffer a copy just rewrote) or the peer's traffic on this HBM?
#      And FP8 push with and without reuse side by side.
# (an) session 15: the eager FP8 host path lighter (the quantization's cast plan keeps its launch
#      tables, the grouped GEMMs' offsets and the FP8 weight scale rows made once per counts /
#      scales): the eager recipe against HEAD 8864189's etp (tools/scratch/before, carried),
#      interleaved, and the GPU tests of what changed; the GEMM operand probe with rotated rounds.
# (ao) session 15: the operand probe again with GEMM-by-GEMM interleaving (neighbours share the
#      power state) and a one-allocation VMM case; the expert stack after the host fixes, with
#      the un-aliased push beside the aliased one.
# (ap) session 15: the eager recipe's host profile again (cProfile's pstats kept whole), FP8 and
#      bf16, after (an)'s host fixes: what still makes eager FP8 slower than eager bf16.
# (aq) session 15: ETP's backward runs the weight gradient (and issues its reduce-scatter) before
#      the input gradient, so the push overlaps the dgrad GEMM and the step's last reduction no
#      longer waits after the last GEMM: the stack against replicated, and the GPU tests of it.
# (ar) session 15, not run (device time spent): what (aq) left. (aq) ran on 2xH100 and its test step
#      stopped at its 150 s limit inside tests/test_transport_gpu.py (test_gemm and test_fp8 had
#      passed): the transport tests with room, the flagship recipe eager and captured (bf16, FP8)
#      with the weight gradient before the input gradient, and the stack on H200 (its
#      replicated_fp8* baselines now keep their cast plan, as quantize_shards does).
# (as) session 16: where the eager recipe's host time goes without a profiler's per-call tax:
#      tools/host_sampler.py samples rank 0's main-thread stack every millisecond over iterations
#      12-21 of the eager flagship recipe, FP8 and bf16 gathers (the timeline beside it).
# (at) session 16: the eager FP8 GEMMs' host path lighter (the rowwise quantization stores 1/scale
#      itself: no reciprocal pass per GEMM; the FP8 weight gradient's padded layout made once per
#      counts and already int32; the sm90 check cached): the kernel and GEMM tests compiled, the
#      eager recipe against HEAD 0739346's etp/ interleaved, and the sampled host profile again
#      (now with autograd's backward thread).
# (au) session 16: (at)'s sampler put ~11 ms per FP8 iteration in making the weights' per-column
#      scale rows inside forward and backward (now made by the quantization, in the optimizer's
#      phase) and ~25 ms in stream flag writes: each host operation's own cost alone
#      (tools/bench_host_ops.py), (ar)'s GPU tests, and the eager FP8 recipe against 0739346 again.
# (av) session 16, the last call: the host cost of each operation again (launch grids now plain
#      integer arithmetic, not triton.cdiv), the flagship recipe captured (FP8, bf16) after this
#      session's changes, and (ar)'s stack (its replicated FP8 baseline keeps its cast plan).
# (aw) session 16: the sampled host profile of the eager recipe once more, FP8 and bf16, after
#      (au) and (av)'s changes (scale rows made by the quantization, plain launch grids).
# (ax) session 16, not run (device time spent): the stack's replicated FP8 baseline now makes its
#      scale rows at its quantization (etp.quant.prepare_scale_rows), as quantize_shards does for
#      ETP's weights: the stack again, on H200 when lent (issue 13's 0.80x is an H200 target).
# ONLY (tools/gpu_lib.sh) runs a subset, e.g. ONLY='^(a_|b_)'.
source tools/gpu_lib.sh
budget_begin /tmp/etp_pending 560
FLAG=recipes/moe_h200x8.yaml
WIDE=recipes/moe_h200x2_wide.yaml
TRAIN="torchrun --standalone --nproc-per-node 2 -m etp.megatron.train"
AT2="--set world_size=2 --set global_batch_size=8 --set etp.etp_size=2 --set etp.expert_etp_size=2"

# (a)
TAIL=8 step a_tests 200 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=60 python3 -m pytest -q -rs -p no:warnings \
  tests/test_ep_kernels.py tests/test_ep_gpu.py tests/test_embedding_grad.py

# (b)
TAIL=16 step b_bench_ep 150 torchrun --standalone --nproc-per-node 2 tools/bench_ep.py \
  --workloads sonicmoe,deepseek_v3 --backends nccl,symm_push,symm_dedup --iters 5 --warmup 2 --out "$OUT/bench_ep.json"

# (c)
TAIL=8 step c_graph_det 420 python3 -m pytest -q -rs -p no:warnings tests/test_graph_step.py -k deterministic

# (d)
TAIL=12 step d_expert_stack 90 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants replicated,etp_async_ce,etp_async_ce_capped --reduce-ctas 16 --gemm-sm-carveout 17 \
  --out "$OUT/bench_expert_stack.json"

# (e)
TAIL=12 step e_ep_megatron 120 torchrun --standalone --nproc-per-node 2 tools/bench_ep_megatron.py \
  --workloads sonicmoe,deepseek_v3 --etp-backends symm_dedup,symm_push --out "$OUT/bench_ep_megatron.json"

# (f)
TAIL=8 step f_kernel_tests 150 python3 -m pytest -q -rs -p no:warnings tests/test_kernels.py tests/test_kernel_shapes.py
TAIL=40 step f_bench_kernels 150 python3 tools/bench_kernels.py --out "$OUT/bench_kernels.json"

# (g)
TAIL=8 step g_ep_trim_tests 150 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=60 python3 -m pytest -q -rs -p no:warnings \
  tests/test_ep_gpu.py
TAIL=120 step g_ep_megatron 150 torchrun --standalone --nproc-per-node 2 tools/bench_ep_megatron.py \
  --workloads sonicmoe,deepseek_v3 --etp-backends symm_dedup --profile --out "$OUT/bench_ep_megatron.json"

# (h)
for reuse in chain step pass; do
  TAIL=6 step h_mb2_etp2_$reuse 100 $TRAIN --recipe $FLAG $AT2 --set etp.gather_reuse=$reuse --train-iters 15 \
    --log-interval 5 --json "$OUT/h_mb2_etp2_$reuse.json"
done
TAIL=6 step h_mb2_off 100 $TRAIN --recipe $FLAG --set world_size=2 --set global_batch_size=8 --set etp.etp_size=1 \
  --set etp.expert_etp_size=1 --train-iters 15 --log-interval 5 --json "$OUT/h_mb2_off.json"

# (i)
for rt in copy_engine symm_triton; do
  TAIL=6 step i_mb2_step_$rt 100 $TRAIN --recipe $FLAG $AT2 --set etp.gather_reuse=step --set etp.reduce_transport=$rt \
    --set etp.reduce_ctas=16 --train-iters 15 --log-interval 5 --json "$OUT/i_mb2_step_$rt.json"
done
TAIL=6 step i_mb2_step_fp8 100 $TRAIN --recipe $FLAG $AT2 --set etp.gather_reuse=step --set etp.gather_dtype=fp8_tensorwise \
  --train-iters 15 --log-interval 5 --json "$OUT/i_mb2_step_fp8.json"

# (j)
STEP_CE="--set etp.gather_reuse=step --set etp.reduce_transport=copy_engine"
TAIL=4 step j_mb2_off 100 $TRAIN --recipe $FLAG --set world_size=2 --set global_batch_size=8 --set etp.etp_size=1 \
  --set etp.expert_etp_size=1 --train-iters 25 --log-interval 5 --json "$OUT/j_mb2_off.json"
TAIL=4 step j_mb2_etp2 100 $TRAIN --recipe $FLAG $AT2 --train-iters 25 --log-interval 5 --json "$OUT/j_mb2_etp2.json"
TAIL=4 step j_mb2_etp2_step_ce 100 $TRAIN --recipe $FLAG $AT2 $STEP_CE --train-iters 25 --log-interval 5 \
  --json "$OUT/j_mb2_etp2_step_ce.json"
TAIL=4 step j_wide_fp8 100 $TRAIN --recipe $WIDE --set micro_batch_size=16 --set global_batch_size=32 \
  --set etp.gather_dtype=fp8_tensorwise --train-iters 10 --log-interval 1 --json "$OUT/j_wide_fp8.json"
TAIL=4 step j_wide_fp8_step_ce 100 $TRAIN --recipe $WIDE --set micro_batch_size=16 --set global_batch_size=32 \
  --set etp.gather_dtype=fp8_tensorwise $STEP_CE --train-iters 10 --log-interval 1 --json "$OUT/j_wide_fp8_step_ce.json"

# (k)
for v in off ce ce_carve2 ce_fp8 off2 ce2; do
  case $v in
    off*) set_="--set etp.etp_size=1 --set etp.expert_etp_size=1" ;;
    ce|ce2) set_="$STEP_CE" ;;
    ce_carve2) set_="$STEP_CE --set etp.gemm_sm_carveout=2" ;;
    ce_fp8) set_="$STEP_CE --set etp.gather_dtype=fp8_tensorwise" ;;
  esac
  TAIL=3 step k_mb2_$v 100 $TRAIN --recipe $FLAG $AT2 $set_ --train-iters 25 --log-interval 5 --json "$OUT/k_mb2_$v.json"
done

# (l)
TAIL=4 step l_ep_gpu_tests 150 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=60 python3 -m pytest -q -p no:warnings \
  tests/test_ep_gpu.py tests/test_ep_megatron.py
for disp in etp alltoall; do
  TAIL=3 step l_ep2_$disp 120 $TRAIN --recipe $FLAG --set world_size=2 --set global_batch_size=8 \
    --set expert_model_parallel_size=2 --set etp.etp_size=2 --set etp.expert_etp_size=1 \
    --set moe_token_dispatcher_type=$disp --set deterministic=true --train-iters 25 --log-interval 5 \
    --json "$OUT/l_ep2_$disp.json"
done

# (m)
TAIL=6 step m_transport_gpu_tests 200 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=90 python3 -m pytest -q -p no:warnings \
  -o faulthandler_timeout=150 tests/test_stream_ops_gpu.py tests/test_transport_gpu.py
TAIL=14 step m_stack_push 120 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants replicated,etp_async_ce_capped,etp_async_ce_push,etp_async_ce_fp8_wgrad,etp_async_ce_push_fp8_wgrad \
  --reduce-ctas 16 --out "$OUT/m_stack_push.json"
TAIL=14 step m_stack_push_carve1 120 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants replicated,etp_async_ce_push --gemm-sm-carveout 1 --trace "$OUT/m_trace" --out "$OUT/m_stack_push_carve1.json"

# (n)
DET="--set deterministic=true --train-iters 25 --log-interval 5"
for gd in param fp8_tensorwise fp8_blockwise; do
  extra=""; [[ $gd == fp8_blockwise ]] && extra="--set etp.pad_for_alignment=128"
  TAIL=3 step n_det_$gd 110 $TRAIN --recipe $FLAG $AT2 --set etp.gather_dtype=$gd $extra $DET --json "$OUT/n_det_$gd.json"
done
TAIL=3 step n_det_off 110 $TRAIN --recipe $FLAG --set world_size=2 --set global_batch_size=8 --set etp.etp_size=1 \
  --set etp.expert_etp_size=1 $DET --json "$OUT/n_det_off.json"
TAIL=3 step n_det_fp8_fill 110 env ETP_DETERMINISTIC_FILL=1 $TRAIN --recipe $FLAG $AT2 --set etp.gather_dtype=fp8_tensorwise \
  $DET --json "$OUT/n_det_fp8_fill.json"
for gd in fp8_tensorwise fp8_blockwise off; do
  [[ -f "$OUT/n_det_$gd.json" && -f "$OUT/n_det_param.json" ]] && python3 tools/compare_recipe_runs.py \
    --etp "$OUT/n_det_$gd.json" --baseline "$OUT/n_det_param.json" --tolerance 0.03 | tail -4
done

# (o) one GPU (when no 2-GPU machine is lent): the stream flag operations and the push
#     reduction's sum kernel compiled; issue 13's FP8 compute on the expert stack in three
#     interleaved rounds (clock drift reaches every variant alike), traced; the same under
#     etp-train's deterministic mode, with and without torch's NaN fill of new memory
TAIL=6 step o_gpu1_tests 150 python3 -m pytest -q -p no:warnings -o faulthandler_timeout=100 \
  tests/test_stream_ops_gpu.py tests/test_transport.py -k "stream or sum_received or symm_reduce_kernel"
TAIL=14 step o_gpu1_stack_fp8 200 torchrun --standalone --nproc-per-node 1 tools/bench_expert_stack.py \
  --variants replicated,replicated_fp8,replicated_fp8_wgrad --rounds 3 --trace "$OUT/o_trace" --out "$OUT/o_gpu1_stack_fp8.json"
for fill in 0 1; do
  TAIL=8 step o_gpu1_stack_det_fill$fill 120 env ETP_DETERMINISTIC_FILL=$fill torchrun --standalone --nproc-per-node 1 \
    tools/bench_expert_stack.py --variants replicated,replicated_fp8_wgrad --deterministic \
    --out "$OUT/o_gpu1_stack_det_fill$fill.json"
done
[[ -d "$OUT/o_trace" ]] && python3 tools/trace_gaps.py "$OUT"/o_trace/*_trace.json --top 8 --json "$OUT/o_trace_gaps.json" \
  && rm -rf "$OUT/o_trace"

# (p)
TAIL=6 step p_transport_gpu_tests 200 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=90 python3 -m pytest -q -p no:warnings \
  -o faulthandler_timeout=150 tests/test_stream_ops_gpu.py tests/test_transport_gpu.py
TAIL=16 step p_stack_flags 300 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants replicated,etp_async_ce_push,etp_async_ce_push_kfence,etp_async_ce_push_fp8_wgrad --rounds 2 \
  --trace "$OUT/p_trace" --out "$OUT/p_stack_flags.json"
[[ -d "$OUT/p_trace" ]] && python3 tools/trace_gaps.py "$OUT"/p_trace/*_trace.json --top 8 --json "$OUT/p_trace_gaps.json" \
  > "$OUT/p_trace_gaps.log" 2>&1; rm -rf "$OUT/p_trace"

# (q)
TAIL=16 step q_stack_fences 200 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants replicated,replicated_fp8_wgrad,etp_async_ce_push,etp_async_ce_push_kfence,etp_async_ce_push_fp8_wgrad,\
etp_async_ce_push_fp8_wgrad_kfence --rounds 2 --trace "$OUT/q_trace" --out "$OUT/q_stack_fences.json"
[[ -d "$OUT/q_trace" ]] && python3 tools/trace_gaps.py "$OUT"/q_trace/*_trace.json --top 8 --json "$OUT/q_trace_gaps.json" \
  > "$OUT/q_trace_gaps.log" 2>&1 && gzip -c "$OUT/q_trace/etp_async_ce_push_fp8_wgrad_trace.json" > "$OUT/q_fp8_push_trace.json.gz"
rm -rf "$OUT/q_trace"
OFF2="--set world_size=2 --set global_batch_size=8 --set etp.etp_size=1 --set etp.expert_etp_size=1"
PUSH="--set etp.reduce_transport=copy_engine_push"
recipe_steps q_recipe 110 3 "nccl|$AT2" "push|$AT2 $PUSH" "off|$OFF2" \
  "push_fp8|$AT2 $PUSH --set etp.gather_dtype=fp8_tensorwise" -- --train-iters 25 --log-interval 5
for v in push off; do
  [[ -f "$OUT/q_recipe_$v.json" && -f "$OUT/q_recipe_nccl.json" ]] && python3 tools/compare_recipe_runs.py \
    --etp "$OUT/q_recipe_$v.json" --baseline "$OUT/q_recipe_nccl.json" --tolerance 0.03 | tail -4
done

# (r)
DET50="$AT2 --set deterministic=true --log-interval 5"
recipe_steps r_det 120 2 "bf16_50|$DET50 --train-iters 50" "fp8_50|$DET50 --train-iters 50 --set etp.gather_dtype=fp8_tensorwise" \
  "fp8_nowgrad_25|$DET50 --train-iters 25 --set etp.gather_dtype=fp8_tensorwise --set etp.fp8_wgrad=false" \
  "bf16_seed_25|$DET50 --train-iters 25 --set seed=4321" --

# (s)
TAIL=12 step s_stack 150 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants replicated,etp_async_ce_push,etp_async_ce_push_kfence,etp_async_ce_push_fp8_wgrad,\
etp_async_ce_push_fp8_wgrad_kfence --rounds 2 --out "$OUT/s_stack.json"
FP8T="--set etp.gather_dtype=fp8_tensorwise"
recipe_steps s_recipe 100 2 "bf16_auto|$AT2" "bf16_nccl|$AT2 --set etp.reduce_transport=nccl" "fp8_auto|$AT2 $FP8T" \
  "fp8_nccl|$AT2 $FP8T --set etp.reduce_transport=nccl" -- --train-iters 25 --log-interval 5
TAIL=3 step s_recipe_graph_auto 100 $TRAIN --recipe $FLAG $AT2 --set cuda_graph=step --set overlap_grad_reduce=false \
  --train-iters 25 --log-interval 5 --json "$OUT/s_recipe_graph_auto.json"

# (t)
TAIL=8 step t_gpu_tests 420 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=120 python3 -m pytest -q -p no:warnings -rs \
  -o faulthandler_timeout=300 tests/test_stream_ops_gpu.py tests/test_transport_gpu.py tests/test_graphs_gpu.py \
  tests/test_fp8_recipe_gpu.py tests/test_graph_step.py -k "not deterministic_captured"
TAIL=24 step t_overlap 150 torchrun --standalone --nproc-per-node 2 tools/bench_overlap.py --reduce-ctas 8 \
  --out "$OUT/t_overlap.json" --md "$OUT/t_overlap.md"

# (u)
TAIL=14 step u_overlap 150 torchrun --standalone --nproc-per-node 2 tools/bench_overlap.py --reduce-ctas 8 --rounds 5 \
  --only "gather/,reduce/nccl bf16,reduce/copy_engine_push" --out "$OUT/u_overlap.json" --md "$OUT/u_overlap.md"
TAIL=10 step u_stack_trace 120 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants replicated,etp_async_ce_push --trace "$OUT/u_trace" --out "$OUT/u_stack_trace.json"
for v in replicated etp_async_ce_push; do
  [[ -f "$OUT/u_trace/${v}_trace.json" ]] && gzip -c "$OUT/u_trace/${v}_trace.json" > "$OUT/u_${v}_trace.json.gz"
done
rm -rf "$OUT/u_trace"

# (v)
for v in replicated etp_async_ce_push; do
  TAIL=8 step v_clocks_$v 90 bash tools/gpu_clocks.sh "$OUT/v_clocks_$v" torchrun --standalone --nproc-per-node 2 \
    tools/bench_expert_stack.py --variants $v --steps 60 --out "$OUT/v_clocks_$v.json"
done

# (w)
TAIL=6 step w_transport_tests 200 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=120 python3 -m pytest -q -p no:warnings \
  -o faulthandler_timeout=150 tests/test_transport_gpu.py tests/test_stream_ops_gpu.py
for gd in param fp8_tensorwise; do
  TAIL=4 step w_recipe_profile_$gd 150 $TRAIN --recipe $FLAG $AT2 --set etp.gather_dtype=$gd --train-iters 12 \
    --log-interval 4 --profile "$OUT/w_prof_$gd" --json "$OUT/w_recipe_profile_$gd.json"
  trace="$OUT/w_prof_$gd/trace_rank0.json"; [[ -f "$trace" ]] || trace=""
  [[ -n "$trace" ]] && python3 tools/trace_gaps.py "$trace" --stream-waits --top 10 --json "$OUT/w_gaps_$gd.json" \
    > "$OUT/w_gaps_$gd.log" 2>&1 && gzip -c "$trace" > "$OUT/w_recipe_trace_$gd.json.gz"
  rm -rf "$OUT/w_prof_$gd"
done
TAIL=6 step w_graph_det 420 python3 -m pytest -q -rs -p no:warnings tests/test_graph_step.py -k deterministic_captured

# (x)
TAIL=8 step x_probe_local_copy 90 python3 tools/probe_local_copy.py "$OUT/x_probe_local_copy.json"
TAIL=9 step x_stack_trace 100 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants etp_async_ce_push --trace "$OUT/x_trace" --out "$OUT/x_stack_trace.json"
[[ -f "$OUT/x_trace/etp_async_ce_push_trace.json" ]] && python3 tools/trace_gaps.py \
  "$OUT/x_trace/etp_async_ce_push_trace.json" --stream-waits --steps 3 > "$OUT/x_gaps.log" 2>&1

# (y)
TAIL=8 step y_transport_tests 240 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=120 python3 -m pytest -q -p no:warnings \
  -o faulthandler_timeout=150 tests/test_transport_gpu.py tests/test_stream_ops_gpu.py tests/test_graphs_gpu.py
TAIL=12 step y_stack_alias 150 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
  replicated,etp_async_ce_push,etp_async_ce_push_alias,etp_async_ce_push_fp8_wgrad,etp_async_ce_push_fp8_wgrad_alias \
  --rounds 3 --out "$OUT/y_stack_alias.json"
recipe_steps y_recipe 100 4 "bf16_alias|--set etp.alias_own_rows=true" "bf16|" \
  "fp8_alias|--set etp.alias_own_rows=true --set etp.gather_dtype=fp8_tensorwise" "fp8|--set etp.gather_dtype=fp8_tensorwise" \
  -- $AT2 --train-iters 25 --log-interval 5

# (z)
TAIL=6 step z_tests 200 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=150 python3 -m pytest -q -p no:warnings \
  tests/test_megatron_train_gpu.py -k "sync_free or fp32" tests/test_graphs_gpu.py::test_recompute_prefetches_survive_deterministic_fill
OLD="env -C $PWD/tools/scratch/old PYTHONPATH=$PWD/tools/scratch/old:${PYTHONPATH:-}"
Z="$AT2 --train-iters 30 --log-interval 5"
FP8="--set etp.gather_dtype=fp8_tensorwise"
ALIAS="--set etp.alias_own_rows=true"
TAIL=3 step z_old_bf16 90 $OLD $TRAIN --recipe $PWD/$FLAG $Z --json "$OUT/z_old_bf16.json"
TAIL=3 step z_new_bf16 90 $TRAIN --recipe $FLAG $Z --json "$OUT/z_new_bf16.json"
TAIL=3 step z_new_bf16_alias 90 $TRAIN --recipe $FLAG $Z $ALIAS --json "$OUT/z_new_bf16_alias.json"
TAIL=3 step z_old_fp8 90 $OLD $TRAIN --recipe $PWD/$FLAG $Z $FP8 --json "$OUT/z_old_fp8.json"
TAIL=3 step z_new_fp8 90 $TRAIN --recipe $FLAG $Z $FP8 --json "$OUT/z_new_fp8.json"
TAIL=3 step z_new_fp8_alias 90 $TRAIN --recipe $FLAG $Z $FP8 $ALIAS --json "$OUT/z_new_fp8_alias.json"
TAIL=3 step z_new_bf16_b 90 $TRAIN --recipe $FLAG $Z --json "$OUT/z_new_bf16_b.json"
TAIL=3 step z_old_bf16_b 90 $OLD $TRAIN --recipe $PWD/$FLAG $Z --json "$OUT/z_old_bf16_b.json"

# (ab)
AB="$AT2 --train-iters 30 --log-interval 5 --timeline"
TAIL=12 step ab_bf16 90 $TRAIN --recipe $FLAG $AB --json "$OUT/ab_bf16.json"
TAIL=12 step ab_fp8 90 $TRAIN --recipe $FLAG $AB --set etp.gather_dtype=fp8_tensorwise --json "$OUT/ab_fp8.json"
TAIL=3 step ab_bf16_b 90 $TRAIN --recipe $FLAG $AB --json "$OUT/ab_bf16_b.json"
TAIL=3 step ab_fp8_b 90 $TRAIN --recipe $FLAG $AB --set etp.gather_dtype=fp8_tensorwise --json "$OUT/ab_fp8_b.json"
TAIL=12 step ab_off 90 $TRAIN --recipe $FLAG --set world_size=2 --set global_batch_size=8 --set etp.etp_size=1 \
  --set etp.expert_etp_size=1 --train-iters 30 --log-interval 5 --timeline --json "$OUT/ab_off.json"
TAIL=8 step ab_transport_tests 240 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=120 python3 -m pytest -q -p no:warnings \
  -o faulthandler_timeout=150 tests/test_transport_gpu.py tests/test_graphs_gpu.py
TAIL=8 step ab_train_tests 200 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=150 python3 -m pytest -q -p no:warnings \
  tests/test_fp8_recipe_gpu.py tests/test_megatron_train_gpu.py -k "fp8 or distopt"

# (ac)
AC="$AT2 --train-iters 20 --log-interval 5 --timeline"
GRAPH="--set cuda_graph=step --set overlap_grad_reduce=false"
TAIL=8 step ac_fp8_graph 70 $TRAIN --recipe $FLAG $AC $GRAPH $FP8 --json "$OUT/ac_fp8_graph.json"
TAIL=8 step ac_bf16_graph 70 $TRAIN --recipe $FLAG $AC $GRAPH --json "$OUT/ac_bf16_graph.json"
TAIL=3 step ac_fp8 60 $TRAIN --recipe $FLAG $AC $FP8 --json "$OUT/ac_fp8.json"
TAIL=3 step ac_bf16 60 $TRAIN --recipe $FLAG $AC --json "$OUT/ac_bf16.json"

# (ad)
# recipe_host_profiles PREFIX TAIL GATHERS...: the eager recipe profiled (cProfile pstats kept) per gathers.
recipe_host_profiles() {
  local prefix=$1 tail=$2 g sets; shift 2
  for g in "$@"; do
    sets=""; [[ $g == fp8 ]] && sets="--set etp.gather_dtype=fp8_tensorwise"
    # shellcheck disable=SC2086
    TAIL=$tail step "${prefix}_${g}_prof" 110 $TRAIN --recipe $FLAG $AT2 $sets --train-iters 12 --log-interval 4 \
      --profile "/tmp/${prefix}_$g" --json "$OUT/${prefix}_${g}.json"
    for f in host_rank0.txt host_rank0.pstats breakdown_rank0.json; do
      cp "/tmp/${prefix}_$g/$f" "$OUT/${prefix}_${g}_$f" 2>/dev/null
    done
  done
}
recipe_host_profiles ad 6 bf16 fp8
TAIL=9 step ad_stack_trace 120 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants replicated,replicated_fp8 --trace /tmp/ad_trace --out "$OUT/ad_stack_trace.json"
for v in replicated replicated_fp8; do
  [[ -f "/tmp/ad_trace/${v}_trace.json" ]] && gzip -c "/tmp/ad_trace/${v}_trace.json" > "$OUT/ad_${v}_trace.json.gz"
done

# (ae)
GRAPH="--set cuda_graph=step --set overlap_grad_reduce=false"
for g in bf16 fp8; do
  SETS=""; [[ $g == fp8 ]] && SETS="--set etp.gather_dtype=fp8_tensorwise"
  # shellcheck disable=SC2086
  TAIL=6 step "ae_${g}_graph_prof" 120 $TRAIN --recipe $FLAG $AT2 $GRAPH $SETS --train-iters 12 --log-interval 4 \
    --profile "/tmp/ae_$g" --json "$OUT/ae_${g}.json"
  for f in host_rank0.txt breakdown_rank0.json; do cp "/tmp/ae_$g/$f" "$OUT/ae_${g}_$f" 2>/dev/null; done
  [[ -f "/tmp/ae_$g/trace_rank0.json" ]] && gzip -c "/tmp/ae_$g/trace_rank0.json" > "$OUT/ae_${g}_trace.json.gz"
done

# (af)
TAIL=8 step af_tests 300 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=150 python3 -m pytest -q -p no:warnings \
  -o faulthandler_timeout=200 tests/test_graphs_gpu.py tests/test_transport_gpu.py
AF="$AT2 --train-iters 20 --log-interval 5 --timeline"
GRAPH="--set cuda_graph=step --set overlap_grad_reduce=false"
FP8="--set etp.gather_dtype=fp8_tensorwise"
recipe_steps af 80 4 "fp8_graph|$GRAPH $FP8" "bf16_graph|$GRAPH" "fp8|$FP8" "bf16|" -- $AF

# (ag)
AG="$AT2 --train-iters 20 --log-interval 5 --timeline"
OFF="--set world_size=2 --set global_batch_size=8 --set etp.etp_size=1 --set etp.expert_etp_size=1 --train-iters 20 --log-interval 5 --timeline"
recipe_steps ag_off 90 4 "graph|$GRAPH" "eager|" -- $OFF  # ETP off: after AT2 would turn it back on
recipe_steps ag 90 4 "fp8_graph|$GRAPH $FP8" "bf16_graph|$GRAPH" \
  "fp8block_graph|$GRAPH --set etp.gather_dtype=fp8_blockwise --set etp.pad_for_alignment=128" -- $AG
TAIL=6 step ag_graph_det_fp8 240 python3 -m pytest -q -rs -p no:warnings tests/test_graph_step.py -k "deterministic_captured and fp8"

# (ah)
TAIL=6 step ah_graph_det_bf16 200 python3 -m pytest -q -rs -p no:warnings tests/test_graph_step.py -k "deterministic_captured and bf16"
TAIL=12 step ah_stack 200 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
  replicated,replicated_fp8_wgrad,etp_async_ce_push_alias,etp_async_ce_push_fp8_wgrad_alias --rounds 2 --out "$OUT/ah_stack.json"

# (ai)
TAIL=8 step ai_stack_trace 150 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
  --variants replicated_fp8_wgrad,etp_async_ce_push_fp8_wgrad_alias --trace /tmp/ai_trace --out "$OUT/ai_stack_trace.json"
if [[ -f /tmp/ai_trace/etp_async_ce_push_fp8_wgrad_alias_trace.json ]]; then
  python3 tools/trace_kernels_compare.py /tmp/ai_trace/replicated_fp8_wgrad_trace.json \
    /tmp/ai_trace/etp_async_ce_push_fp8_wgrad_alias_trace.json --steps 3 --json "$OUT/ai_gemms.json" > "$OUT/ai_gemms.log" 2>&1
  python3 tools/trace_gaps.py /tmp/ai_trace/etp_async_ce_push_fp8_wgrad_alias_trace.json --stream-waits --steps 3 \
    > "$OUT/ai_gaps.log" 2>&1
  for v in replicated_fp8_wgrad etp_async_ce_push_fp8_wgrad_alias; do gzip -c "/tmp/ai_trace/${v}_trace.json" > "$OUT/ai_${v}.json.gz"; done
fi

# (aj)
TAIL=14 step aj_stack_graphed 300 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
  replicated,replicated_graphed,replicated_fp8_wgrad,replicated_fp8_wgrad_graphed,etp_async_ce_push_alias,\
etp_async_ce_push_alias_graphed,etp_async_ce_push_fp8_wgrad_alias,etp_async_ce_push_fp8_wgrad_alias_graphed \
  --rounds 2 --out "$OUT/aj_stack_graphed.json"

# (ak)
# stack_trace_pair PREFIX BASE VARIANT: both traced (3 steps), the GEMMs paired, VARIANT's stream waits.
stack_trace_pair() {
  local prefix=$1 base=$2 variant=$3 dir=/tmp/$1_trace
  TAIL=8 step "${prefix}_stack_trace" 150 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py \
    --variants "$base,$variant" --trace "$dir" --out "$OUT/${prefix}_stack_trace.json"
  [[ -f $dir/${variant}_trace.json ]] || return 0
  python3 tools/trace_kernels_compare.py "$dir/${base}_trace.json" "$dir/${variant}_trace.json" --steps 3 \
    --json "$OUT/${prefix}_gemms.json" > "$OUT/${prefix}_gemms.log" 2>&1
  python3 tools/trace_gaps.py "$dir/${variant}_trace.json" --stream-waits --steps 3 \
    --json "$OUT/${prefix}_gaps.json" > "$OUT/${prefix}_gaps.log" 2>&1
  for v in "$base" "$variant"; do gzip -c "$dir/${v}_trace.json" > "$OUT/${prefix}_$v.json.gz"; done
}
stack_trace_pair ak replicated etp_async_ce_push_alias
TAIL=10 step ak_stack_fp8_graphed 150 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
  replicated,replicated_graphed,replicated_fp8_wgrad,replicated_fp8_wgrad_graphed --rounds 2 --out "$OUT/ak_stack_fp8_graphed.json"

# (al)
TAIL=14 step al_stack_reuse 240 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
replicated,replicated_graphed,etp_async_ce_push_alias,etp_async_ce_push_alias_reuse,etp_async_ce_push_alias_reuse_graphed,\
etp_async_ce_push_fp8_wgrad_alias_reuse,etp_async_ce_push_fp8_wgrad_alias_reuse_graphed --rounds 2 --out "$OUT/al_stack_reuse.json"
stack_trace_pair al replicated etp_async_ce_push_alias_reuse

# (am)
TAIL=10 step am_gemm_operand 120 torchrun --standalone --nproc-per-node 2 tools/bench_gemm_operand.py \
  --out "$OUT/am_gemm_operand.json"
TAIL=10 step am_stack_fp8_reuse 200 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
replicated,etp_async_ce_push_fp8_wgrad_alias,etp_async_ce_push_fp8_wgrad_alias_reuse --rounds 2 --out "$OUT/am_stack_fp8_reuse.json"

# (an)
AN="$AT2 --train-iters 20 --log-interval 5 --timeline"
FP8="--set etp.gather_dtype=fp8_tensorwise"
# ab_round PREFIX ROUND ARGS...: the eager recipe, FP8 and bf16 gathers (FP8 only with FP8_ONLY=1), with this tree's etp/ ("after")
# and the one carried in tools/scratch/before/ (a `git archive` of an earlier commit), interleaved.
ab_round() {
  local prefix=$1 round=$2 v g sets dir; shift 2
  for v in after before; do
    for g in fp8 bf16; do
      [[ $g == bf16 && -n ${FP8_ONLY:-} ]] && continue
      sets=""; [[ $g == fp8 ]] && sets=$FP8
      dir=.; [[ $v == before ]] && dir=tools/scratch/before
      [[ -d $dir ]] || continue  # carried only for the before/after steps
      # shellcheck disable=SC2086
      (cd "$dir" && TAIL=4 step "${prefix}_${g}_${v}_$round" 90 $TRAIN --recipe $FLAG $sets "$@" \
        --json "$OUT/${prefix}_${g}_${v}_$round.json")
    done
  done
}
ab_round an 1 $AN
TAIL=8 step an_tests 300 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=150 python3 -m pytest -q -rs -p no:warnings \
  -o faulthandler_timeout=200 tests/test_kernels.py tests/test_gemm.py tests/test_fp8.py tests/test_graphs_gpu.py \
  tests/test_fp8_recipe_gpu.py
TAIL=10 step an_gemm_operand 120 torchrun --standalone --nproc-per-node 2 tools/bench_gemm_operand.py \
  --out "$OUT/an_gemm_operand.json"
ab_round an 2 $AN

# (ao)
TAIL=16 step ao_gemm_operand 120 torchrun --standalone --nproc-per-node 2 tools/bench_gemm_operand.py \
  --out "$OUT/ao_gemm_operand.json"
TAIL=12 step ao_stack 200 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
replicated,replicated_fp8_wgrad,etp_async_ce_push,etp_async_ce_push_alias,etp_async_ce_push_fp8_wgrad_alias_reuse \
  --rounds 2 --out "$OUT/ao_stack.json"

# (ap)
recipe_host_profiles ap 4 fp8 bf16

# (aq)
TAIL=12 step aq_stack 150 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
replicated,etp_async_ce_push_alias,etp_async_ce_push_fp8_wgrad_alias_reuse --rounds 2 --out "$OUT/aq_stack.json"
TAIL=8 step aq_tests 150 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=100 python3 -m pytest -q -rs -p no:warnings \
  tests/test_gemm.py tests/test_fp8.py tests/test_transport_gpu.py

# (ar)
TAIL=8 step ar_tests 400 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=150 python3 -m pytest -q -rs -p no:warnings \
  -o faulthandler_timeout=300 tests/test_transport_gpu.py tests/test_graphs_gpu.py tests/test_fp8_recipe_gpu.py
AR="$AT2 --train-iters 20 --log-interval 5 --timeline"
recipe_steps ar 90 4 "fp8|$FP8" "bf16|" "fp8_graph|$GRAPH $FP8" "bf16_graph|$GRAPH" -- $AR
TAIL=12 step ar_stack 200 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
replicated,replicated_fp8_wgrad,etp_async_ce_push_alias,etp_async_ce_push_fp8_wgrad_alias_reuse,\
etp_async_ce_push_alias_graphed,etp_async_ce_push_fp8_wgrad_alias_reuse_graphed --rounds 2 --out "$OUT/ar_stack.json"

# (as)
SAMPLED="torchrun --standalone --nproc-per-node 2 tools/host_sampler.py --iterations 12:22"
for g in fp8 bf16; do
  SETS=""; [[ $g == fp8 ]] && SETS=$FP8
  # shellcheck disable=SC2086
  TAIL=6 step "as_${g}_sampled" 120 $SAMPLED --out "$OUT/as_$g" -m etp.megatron.train --recipe $FLAG $AT2 $SETS \
    --train-iters 24 --log-interval 4 --timeline --json "$OUT/as_${g}.json"
done

# (at)
TAIL=6 step at_tests 200 python3 -m pytest -q -rs -p no:warnings tests/test_kernel_shapes.py tests/test_gemm.py \
  tests/test_fp8.py tests/test_colwise.py tests/test_swiglu.py
AT="$AT2 --train-iters 20 --log-interval 5 --timeline"
ab_round at 1 $AT
ab_round at 2 $AT
for g in fp8 bf16; do
  SETS=""; [[ $g == fp8 ]] && SETS=$FP8
  # shellcheck disable=SC2086
  TAIL=4 step "at_${g}_sampled" 120 $SAMPLED --out "$OUT/at_$g" -m etp.megatron.train --recipe $FLAG $AT2 $SETS \
    --train-iters 24 --log-interval 4 --timeline --json "$OUT/at_${g}_sampled.json"
done

# (au)
TAIL=30 step au_host_ops 60 python3 tools/bench_host_ops.py --out "$OUT/au_host_ops.json"
TAIL=8 step au_tests 400 env ETP_TEST_BACKEND=nccl ETP_TEST_TIMEOUT=150 python3 -m pytest -q -rs -p no:warnings \
  -o faulthandler_timeout=300 tests/test_transport_gpu.py tests/test_graphs_gpu.py tests/test_fp8_recipe_gpu.py
FP8_ONLY=1 ab_round au 1 $AT
FP8_ONLY=1 ab_round au 2 $AT

# (av)
TAIL=30 step av_host_ops 60 python3 tools/bench_host_ops.py --out "$OUT/av_host_ops.json"
recipe_steps av 90 4 "fp8_graph|$GRAPH $FP8" "bf16_graph|$GRAPH" -- $AT
TAIL=12 step av_stack 220 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
replicated,replicated_fp8_wgrad,etp_async_ce_push_alias,etp_async_ce_push_fp8_wgrad_alias_reuse,\
replicated_fp8_wgrad_graphed,etp_async_ce_push_fp8_wgrad_alias_reuse_graphed --rounds 2 --out "$OUT/av_stack.json"

# (aw)
for g in fp8 bf16; do
  SETS=""; [[ $g == fp8 ]] && SETS=$FP8
  # shellcheck disable=SC2086
  TAIL=3 step "aw_${g}_sampled" 80 $SAMPLED --out "$OUT/aw_$g" -m etp.megatron.train --recipe $FLAG $AT2 $SETS \
    --train-iters 24 --log-interval 4 --timeline --json "$OUT/aw_${g}_sampled.json"
done

# (ax)
TAIL=12 step ax_stack 220 torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants \
replicated,replicated_fp8_wgrad,etp_async_ce_push_alias,etp_async_ce_push_fp8_wgrad_alias_reuse,\
replicated_fp8_wgrad_graphed,etp_async_ce_push_fp8_wgrad_alias_reuse_graphed --rounds 2 --out "$OUT/ax_stack.json"

# (ay) session 17: Triton's own launch cost against its compiled launcher called directly
TAIL=40 step ay_host_ops 60 python3 tools/bench_host_ops.py --out "$OUT/ay_host_ops.json"

# (az) the cached Triton launches (etp.kernels.launch) and stream lookups: every compiled kernel test, then
# each host operation with this tree and with ddb49ee's (tools/scratch/before), alternating
TAIL=10 step az_tests 300 python3 -m pytest -q -rs -p no:warnings tests/test_launch.py tests/test_kernel_shapes.py \
  tests/test_gemm.py tests/test_fp8.py tests/test_colwise.py tests/test_swiglu.py tests/test_ep_kernels.py \
  tests/test_stream_ops_gpu.py
for r in 1 2; do
  TAIL=30 step "az_host_ops_after_$r" 60 python3 tools/bench_host_ops.py --out "$OUT/az_host_ops_after_$r.json"
  (cd tools/scratch/before && TAIL=30 step "az_host_ops_before_$r" 60 python3 tools/bench_host_ops.py \
    --out "$OUT/az_host_ops_before_$r.json")
done

# (ba) the leaner launch (bound once per key) and transpose wrapper: the compiled tests again, each host
# operation with this tree and ddb49ee's, then the eager recipe with both, interleaved
TAIL=10 step ba_tests 300 python3 -m pytest -q -rs -p no:warnings tests/test_launch.py tests/test_kernel_shapes.py \
  tests/test_gemm.py tests/test_fp8.py tests/test_colwise.py tests/test_swiglu.py tests/test_ep_kernels.py
for r in 1 2; do
  TAIL=30 step "ba_host_ops_after_$r" 60 python3 tools/bench_host_ops.py --out "$OUT/ba_host_ops_after_$r.json"
  (cd tools/scratch/before && TAIL=30 step "ba_host_ops_before_$r" 60 python3 tools/bench_host_ops.py \
    --out "$OUT/ba_host_ops_before_$r.json")
done
ab_round ba 1 $AT
ab_round ba 2 $AT

# (bb) where an FP8 GEMM's host time goes: the rowwise-scaled GEMM calls themselves
TAIL=40 step bb_host_ops 60 python3 tools/bench_host_ops.py --out "$OUT/bb_host_ops.json"

# (bc) Python's garbage collector in the eager loop: counted (--timeline), then off (manual_gc), interleaved.
# Ran once (session 17, call 6) with a manual_gc recipe key that was then removed (no gain): historical.
MGC="--set manual_gc=true"
for r in 1 2; do
  recipe_steps "bc_$r" 80 4 "fp8|$FP8" "fp8_mgc|$FP8 $MGC" "bf16|" "bf16_mgc|$MGC" -- $AT
done

# (bd) the captured flagship recipe with this session's etp, FP8 and bf16 gathers
recipe_steps bd 90 4 "fp8_graph|$GRAPH $FP8" "bf16_graph|$GRAPH" -- $AT

budget_end
