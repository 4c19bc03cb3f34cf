#!/usr/bin/env bash
# The planner's predicted step time and exposed communication (tessera-plan
# --time) beside what tessera-train measures, at 1, 2 and 4 ranks. Not a test:
# a table for benchmarks/README.md.
#   benchmarks/step_time_vs_run.sh [build] [rounds]   (default build/, 3 rounds)
#
# This machine's speed moves by 20-40% over minutes (a shared host), so a
# prediction from kernels timed at one moment and a run at another compare
# the machine with itself, not the model with the run. Each row therefore
# times its kernels afresh just before and just after its run (an empty
# kernel cache each time; the prediction is the mean of the two), and the
# whole table is repeated `rounds` times, interleaved; the summary gives per
# row the median of the rounds' errors and how many rounds fell within 15%
# (ROWS=file prints it again from the rows a run wrote to stderr). A run's
# measured step is the median of the five log
# windows of steps 16-40 (the median drops a window that met another job).
# Fits the collectives first (bench_collectives --save) where this machine
# has none for a world size; those fits are kept in $TESSERA_CACHE_DIR
# (default ~/.cache/tessera).
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
bin=$(cd "$build" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=(); [[ $(id -u) == 0 ]] && root=(--allow-run-as-root)
cache=${TESSERA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tessera}
for np in 2 4; do
  [[ -f "$cache/collectives-$np.tsv" ]] ||
    mpirun -np "$np" --oversubscribe --bind-to none "${root[@]}" "$bin/benchmarks/bench_collectives" 16 --save >/dev/null
done
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
# The plan's step time and exposed share, its kernels timed now (an empty kernel cache).
predict() {
  local np=$1; shift
  rm -rf "$work/cache" && mkdir -p "$work/cache" && cp "$cache"/collectives-*.tsv "$work/cache/"
  TESSERA_CACHE_DIR="$work/cache" "$bin/tools/tessera-plan" --ranks "$np" --time "$@" 2>/dev/null >"$work/plan"
  awk '/^step time/ { t = $(NF-1) } /exposed/ && /of the step/ { gsub(/\(/, "", $(NF-3)); e = $(NF-3) }
       END { print t, e }' "$work/plan"
}
# One row: "config ranks measured predicted measured-exposed predicted-exposed".
measure() {
  local np=$1; shift
  local before after tokens measured exposed
  before=$(predict "$np" "$@")
  rm -rf "$work/out"
  mpirun -np "$np" --oversubscribe --bind-to none "${root[@]}" "$bin/tools/tessera-train" \
    --training.steps 40 --metrics.log_interval 5 --training.eval_interval 1000 --metrics.plot "" \
    --metrics.progress off --sample.max_new_tokens 0 --training.data_dir "$PWD/data" \
    --job.dump_folder "$work/out" "$@" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  after=$(predict "$np" "$@")
  # Tokens per step: micro-batch x seq_len x grad_accum x ranks, from the plan's first line.
  tokens=$(awk -v np="$np" '/^plan:/ { for (i = 1; i <= NF; ++i) { if ($i == "micro-batch") m = $(i+1) * $(i+3);
    if ($i == "grad_accum") g = $(i+1) } print m * g * np }' "$work/plan")
  measured=$(grep -o '"tokens_per_s":[0-9.]*' "$work/out/metrics.jsonl" | tail -5 | cut -d: -f2 |
    awk -v t="$tokens" '{ printf "%.1f\n", 1000 * t / $1 }' | median)
  exposed=$(grep -o '"exposed_comm_pct_max_rank":[0-9.]*' "$work/out/metrics.jsonl" | tail -5 | cut -d: -f2 | median)
  local cfg="$*"
  echo "${cfg:-default}|$np|$measured|$before|$after|$exposed" | awk -F'|' '{ split($4, b, " "); split($5, a, " ");
    printf "%s|%s|%s|%.1f|%s|%.1f\n", $1, $2, $3, (b[1] + a[1]) / 2, $6, (b[2] + a[2]) / 2 }'
}
configs=("" "--model.arch llama --model.n_kv_head 2 --model.bias false")
# The table from the rounds' rows: each round is a run and the calibrations
# beside it, so the error is the median of the rounds' own errors (the
# step times and shares are medians too, each column on its own).
summarize() {
  echo "| config | ranks | measured ms/step | predicted ms/step | error | measured exposed | predicted exposed | rounds within 15% |"
  echo "|---|---|---|---|---|---|---|---|"
  local cfg rows m p e me pe within
  for cfg in "default|1" "default|2" "default|4" "${configs[1]}|2" "${configs[1]}|4"; do
    rows=$(grep -F -e "$cfg|" "$1" || true)
    [[ -n $rows ]] || continue
    m=$(echo "$rows" | cut -d'|' -f3 | median); p=$(echo "$rows" | cut -d'|' -f4 | median)
    e=$(echo "$rows" | awk -F'|' '{ printf "%.4f\n", 100 * ($4 - $3) / $3 }' | median)
    me=$(echo "$rows" | cut -d'|' -f5 | median); pe=$(echo "$rows" | cut -d'|' -f6 | median)
    within=$(echo "$rows" | awk -F'|' '{ n++; if ($4 <= 1.15 * $3 && $4 >= 0.85 * $3) w++ } END { printf "%d of %d", w, n }')
    awk -v c="${cfg%|*}" -v np="${cfg#*|}" -v m="$m" -v p="$p" -v e="$e" -v me="$me" -v pe="$pe" -v w="$within" \
      'BEGIN { printf "| %s | %d | %.1f | %.1f | %+.1f%% | %.1f%% | %.1f%% | %s |\n", c, np, m, p, e, me, pe, w }'
  done
}
# ROWS=file: only the table, from rows an earlier run printed (stderr).
if [[ -n ${ROWS:-} ]]; then summarize "$ROWS"; exit 0; fi
: >"$work/rows"
for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  for np in 1 2 4; do measure "$np" | tee -a "$work/rows" >&2; done
  for np in 2 4; do measure "$np" ${configs[1]} | tee -a "$work/rows" >&2; done
done
summarize "$work/rows"
