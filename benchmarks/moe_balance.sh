#!/bin/sh
# The moe-small preset for 200 steps with DeepSeek-V3's bias balancing and
# without balancing, side by side: the log's "experts max/mean" (the worst
# MoE layer's max / mean tokens per expert, averaged over the log window) and
# the losses. Usage: benchmarks/moe_balance.sh [build dir]
set -eu
build=${1:-build}
out=$(mktemp -d)
for balance in bias none; do
  echo "== moe_balance = $balance"
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$build/tools/tessera-train" --preset moe-small --model.moe_balance "$balance" \
    --training.steps 200 --training.eval_interval 200 --sample.max_new_tokens 0 --metrics.log_interval 50 \
    --job.dump_folder "$out/$balance" 2>&1 | grep -E "^step|^done"
done
rm -rf "$out"
