#!/usr/bin/env bash
# tessera-train vs PyTorch (FSDP2 over gloo) on the same model, global batch
# and ranks, side by side in one run: the default preset and gpt-medium at
# 1, 2 and 4 ranks. Tessera's figure is the tokens/s of the last log window
# (steady state) from its JSONL metrics; PyTorch's the median step.
#   benchmarks/compare_train.sh [build-dir] [steps]
# PyTorch is optional: a PyTorch 2.x at $TORCH2 (default /opt/torch2/bin/python).
# PRESETS (default "default gpt-medium") and RANKS (default "1 2 4") choose the
# rows; PARAM_DTYPE=bfloat16 runs Tessera with bf16 parameters and f32
# gradient reduction (mixed_precision.*) against PyTorch's f32 run.
set -u
build=${1:-build}
steps=${2:-30}
here=$(cd "$(dirname "$0")" && pwd)
torch2=${TORCH2:-/opt/torch2/bin/python}
peak=0.2   # PyTorch's MFU figure only (tessera-train measures this CPU's peak)
mpi="mpirun --oversubscribe --allow-run-as-root --bind-to none"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf "%-12s %5s %16s %10s %16s %10s %8s\n" preset ranks "tessera tok/s" "MFU" "torch tok/s" "MFU" ratio
param_dtype=${PARAM_DTYPE:-float32}
echo "tessera param_dtype $param_dtype, pytorch float32"
for preset in ${PRESETS:-default gpt-medium}; do
  case $preset in
    default) shape="4 256 4 128 16" ;;
    gpt-medium) shape="8 384 6 128 16" ;;
  esac
  for w in ${RANKS:-1 2 4}; do
    $mpi -np "$w" "$build/tools/tessera-train" --preset "$preset" --training.steps "$steps" \
      --mixed_precision.param_dtype "$param_dtype" \
      --metrics.log_interval 10 --training.eval_interval 100000 --sample.max_new_tokens 0 --metrics.plot "" \
      --metrics.progress off --job.dump_folder "$work/$preset-$w" --training.data_dir "$work/data" >/dev/null
    read -r tt tm < <(python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "tokens_per_s" in l]
print("%.0f %.1f" % (rows[-1]["tokens_per_s"], rows[-1]["mfu_pct"]))' "$work/$preset-$w/metrics.jsonl")
    pt="-"; pm="-"; ratio="-"
    if [ -x "$torch2" ]; then
      out=$(for r in $(seq 0 $((w - 1))); do
        RANK=$r WORLD_SIZE=$w LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29700 + w)) \
          "$torch2" "$here/torch_train.py" $shape "$steps" "$peak" 2>/dev/null &
      done; wait)
      pt=$(echo "$out" | sed -n 's/.*: \([0-9]*\) tok\/s.*/\1/p')
      pm=$(echo "$out" | sed -n 's/.*MFU \([0-9.]*\)%.*/\1/p')
      [ -n "$pt" ] && ratio=$(python3 -c "print('%.2f' % ($tt / $pt))")
    fi
    printf "%-12s %5s %16s %9s%% %16s %9s%% %8s\n" "$preset" "$w" "$tt" "$tm" "${pt:--}" "${pm:--}" "$ratio"
  done
done
