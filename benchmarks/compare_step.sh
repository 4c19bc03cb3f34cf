#!/usr/bin/env bash
# Tessera vs PyTorch eager on the GPT benchmark step, side by side: the two
# alternate ROUNDS times in one run and the medians are compared (this
# machine is noisy, so only the ratio is meaningful).
#   benchmarks/compare_step.sh [build-dir] [rounds]
set -eu
build=${1:-build}
rounds=${2:-3}
torch_threads=${TORCH_THREADS:-1}   # PyTorch's best setting here (see benchmarks/README.md)
if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  echo "PyTorch not installed (apt-get install python3-torch): skipping the comparison"; exit 0
fi
ours=(); theirs=()
for r in $(seq "$rounds"); do
  line=$("$build/benchmarks/bench_step" 20 | grep '^threads')
  ours+=("$(echo "$line" | sed -E 's/.*step ([0-9.]+) ms.*/\1/')")
  echo "tessera: $line"
  line=$(/usr/bin/python3 "$(dirname "$0")/torch_step.py" 20 "$torch_threads")
  theirs+=("$(echo "$line" | sed -E 's/.*step ([0-9.]+) ms.*/\1/')")
  echo "pytorch: $line"
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mo=$(median "${ours[@]}"); mt=$(median "${theirs[@]}")
awk -v a="$mo" -v b="$mt" 'BEGIN { printf "median step: tessera %.1f ms, pytorch %.1f ms -> tessera is %.2fx as fast\n", a, b, b / a }'
