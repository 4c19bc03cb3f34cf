#!/usr/bin/env bash
# The training loop's stall per checkpoint, synchronous against asynchronous
# (checkpoint.async_mode async): the default model over 4 ranks, a checkpoint
# every 10 steps, 40 steps; the stall is what tessera-train records as
# checkpoint_stall_s (the whole save, or the planning and staging of an
# asynchronous one). Alternates the two modes, `pairs` times.
#   benchmarks/async_checkpoint.sh [build] [pairs] [data_dir]
set -euo pipefail
build=${1:-build}
pairs=${2:-2}
data=${3:-/tmp/tessera-ckpt-data}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpi=(mpirun --oversubscribe --bind-to none)
[ "$(id -u)" = 0 ] && mpi+=(--allow-run-as-root)
run() {  # mode -> the mean stall in seconds
  rm -rf "$work/run"
  "${mpi[@]}" -np 4 "$build/tools/tessera-train" --preset default --training.steps 40 --metrics.log_interval 10 \
    --training.data_dir "$data" --sample.max_new_tokens 0 --metrics.progress off --job.dump_folder "$work/run" \
    --checkpoint.enable true --checkpoint.interval 10 --checkpoint.async_mode "$1" > "$work/$1.log"
  python3 -c '
import json, sys
s = [r["checkpoint_stall_s"] for r in map(json.loads, open(sys.argv[1])) if "checkpoint_stall_s" in r]
print("%.4f %d" % (sum(s) / len(s), len(s)))' "$work/run/metrics.jsonl"
}
sync_all=() async_all=()
for ((i = 0; i < pairs; ++i)); do
  for mode in off async; do
    read -r mean n < <(run "$mode")
    echo "$mode: mean stall $mean s over $n saves"
    if [ "$mode" = off ]; then sync_all+=("$mean"); else async_all+=("$mean"); fi
  done
done
python3 -c '
import sys
s, a = [float(x) for x in sys.argv[1].split()], [float(x) for x in sys.argv[2].split()]
ms, ma = sum(s) / len(s), sum(a) / len(a)
print("synchronous %.4f s, asynchronous %.4f s per save: the stall is %.3f of the synchronous one" % (ms, ma, ma / ms))' \
  "${sync_all[*]}" "${async_all[*]}"
