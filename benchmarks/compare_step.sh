#!/usr/bin/env bash
# Tessera vs PyTorch eager on the GPT benchmark step, side by side: the same
# model, batch and number of threads; the two alternate ROUNDS times in one
# run and the medians are compared (these machines are noisy, so only the
# ratio is meaningful).
#   benchmarks/compare_step.sh [build-dir] [rounds]
# THREADS: the thread counts to compare (default "1 2"); MODELS: layers x
# width (default "4x256 8x512"); TORCH: a python with torch (default the
# PyTorch 2.x of benchmarks/torch2.sh, installed on demand; /usr/bin/python3
# for Debian's 1.13); DTYPE: f32 (default) or bf16 (parameters, activations
# and AdamW's state in bf16 on both sides).
set -eu
build=${1:-build}
rounds=${2:-3}
here=$(cd "$(dirname "$0")" && pwd)
torch_py=${TORCH:-}
if [ -z "$torch_py" ]; then
  torch_py=$("$here/torch2.sh") || { echo "no PyTorch 2.x (benchmarks/torch2.sh failed): skipping"; exit 0; }
fi
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
step_ms() { sed -nE 's/.* step ([0-9.]+) ms.*/\1/p'; }
summary=()
for model in ${MODELS:-4x256 8x512}; do
  layers=${model%x*} width=${model#*x}
  for threads in ${THREADS:-1 2}; do
    ours=(); theirs=()
    for r in $(seq "$rounds"); do
      line=$(OMP_NUM_THREADS=$threads "$build/benchmarks/bench_step" 10 "$layers" "$width" "${DTYPE:-f32}" | tail -1)
      ours+=("$(echo "$line" | step_ms)")
      echo "tessera: $line"
      line=$("$torch_py" "$here/torch_step.py" 10 "$threads" "$layers" "$width" "${DTYPE:-f32}")
      theirs+=("$(echo "$line" | step_ms)")
      echo "pytorch: $line"
    done
    summary+=("$(awk -v m="$model" -v t="$threads" -v a="$(median "${ours[@]}")" -v b="$(median "${theirs[@]}")" \
      'BEGIN { printf "%-6s '"${DTYPE:-f32}"' %d thread(s): tessera %7.1f ms, pytorch %7.1f ms -> tessera is %.2fx as fast", m, t, a, b, b / a }')")
  done
done
echo "median step, $("$torch_py" -c 'import torch; print("torch", torch.__version__)'):"
printf '%s\n' "${summary[@]}"
