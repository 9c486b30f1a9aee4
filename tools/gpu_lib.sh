# Shared by the tools/gpu_*.sh scripts (sourced, not run): a budgeted run of time-limited steps.
#   source tools/gpu_lib.sh
#   budget_begin /tmp/etp_x 530   # env, OUT (default), BUDGET (default seconds), START, summary, GPU line
#   step NAME TIMEOUT CMD...      # as many as fit (ONLY=REGEX: just the matching steps)
#   budget_end                    # summary.json with every step's rc and seconds
budget_begin() {
  set -uo pipefail
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 OMP_NUM_THREADS=4
  OUT=${OUT:-$1}; mkdir -p "$OUT"
  BUDGET=${BUDGET:-$2}
  START=$(date +%s)
  echo "{" > "$OUT/summary.json.part"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -2
}

budget_end() {
  echo "\"elapsed_s\": $(( $(date +%s) - START ))}" >> "$OUT/summary.json.part"
  mv "$OUT/summary.json.part" "$OUT/summary.json"
}

# step NAME TIMEOUT CMD...: runs CMD with min(TIMEOUT, what is left of BUDGET), logs to $OUT/NAME.log
# ONLY (an extended regex, optional) runs just the steps whose name matches it: one script, split
# over several device calls.
step() {
  local name=$1 limit=$2; shift 2
  if [[ -n "${ONLY:-}" ]] && ! [[ $name =~ $ONLY ]]; then return; fi
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 20 )); then
    echo "=== $name: skipped (budget of ${BUDGET}s spent)"
    echo "\"$name\": {\"rc\": null, \"skipped\": true}," >> "$OUT/summary.json.part"; return
  fi
  (( limit > left )) && limit=$left
  echo "=== $name (timeout ${limit}s): $*"
  local began=$(date +%s)
  # Own process group, so a timeout ends torchrun *and* its workers (which hold the GPUs).
  setsid "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  ( sleep "$limit"; echo "TIMEOUT after ${limit}s" >> "$OUT/$name.log"; kill -TERM -- -$pid 2>/dev/null
    sleep 10; kill -KILL -- -$pid 2>/dev/null ) </dev/null >/dev/null 2>&1 &  # holds no pipe of ours
  local watchdog=$!
  wait $pid
  local rc=$?
  kill $watchdog 2>/dev/null; wait $watchdog 2>/dev/null
  grep -v "^W[0-9]\|OMP_NUM_THREADS\|\*\*\*\*\*\|warnings.warn\|UserWarning\|FutureWarning" "$OUT/$name.log" | tail -${TAIL:-30}
  echo "--- $name: rc=$rc in $(( $(date +%s) - began ))s"
  echo "\"$name\": {\"rc\": $rc, \"seconds\": $(( $(date +%s) - began ))}," >> "$OUT/summary.json.part"
}


# recipe_steps PREFIX TIMEOUT TAIL "NAME|ARGS" ... -- COMMON...: one step PREFIX_NAME per spec, each
# "$TRAIN --recipe $FLAG ARGS COMMON --json $OUT/PREFIX_NAME.json" (TRAIN and FLAG from the caller)
recipe_steps() {
  local prefix=$1 limit=$2 tail=$3; shift 3
  local specs=()
  while [[ $# -gt 0 && $1 != "--" ]]; do specs+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  local spec name
  for spec in "${specs[@]}"; do
    name=${spec%%|*}
    # shellcheck disable=SC2086  # ARGS and TRAIN are word lists
    TAIL=$tail step "${prefix}_$name" "$limit" $TRAIN --recipe $FLAG ${spec#*|} "$@" --json "$OUT/${prefix}_$name.json"
  done
}
