#!/usr/bin/env bash
# On the GPU machine (from the repository root), one device call of several commands: each runs
# with the time left of BUDGET_S seconds (skipped when under 20 s are left), its output in
# $OUT/NAME.log (what a call brings back), then its status, seconds and last lines are printed.
# Pass --out $OUT/... to the benches so their JSON comes back too; at most 8 files come back.
# usage: bash xtask/scripts/device_steps.sh BUDGET_S NAME CMD [NAME CMD ...]
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
deadline=$(( $(date +%s) + $1 )); shift
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
while [ $# -ge 2 ]; do
  name=$1 cmd=$2; shift 2
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 20 ]; then echo "== $name: skipped (no time)"; continue; fi
  start=$(date +%s)
  timeout --signal=KILL "$left" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - start ))s"
  tail -n 30 "$OUT/$name.log"
done
