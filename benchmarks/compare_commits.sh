#!/usr/bin/env bash
# This tree against another commit (default: HEAD~1) on the CPU step
# benchmarks, side by side: bench_step (one process) and bench_fsdp (2 ranks,
# the "fsdp" row) of the two builds alternate ROUNDS times in one run and the
# medians are compared. Only the ratio is meaningful on these noisy machines;
# above 1 means this tree is faster. STEP_ARGS are bench_step's arguments
# (default "10": ten steps of the GPT; "10 4 256 f32 llama" for the Llama).
# With GEMM_ARGS set, bench_gemm GEMM_ARGS runs instead (e.g. "--products NT
# 1024 1536 512 ..."): the mean over its products of Tessera's GFLOP/s column.
#   [STEP_ARGS=...|GEMM_ARGS=...] benchmarks/compare_commits.sh [base-commit] [build-dir] [rounds]
# The base is built (release) in a git worktree under /tmp.
set -eu
base=${1:-HEAD~1}
build=${2:-build}
rounds=${3:-5}
root=$(cd "$(dirname "$0")/.." && pwd)
sha=$(git -C "$root" rev-parse --short "$base")
wt=/tmp/tessera-base-$sha
if [ ! -x "$wt/build/benchmarks/bench_fsdp" ]; then
  echo "building $base ($sha) in $wt"
  rm -rf "$wt"
  git -C "$root" worktree prune
  git -C "$root" worktree add --detach "$wt" "$sha" >/dev/null
  (cd "$wt" && meson setup build --buildtype=release -Dtests=false -Dcuda=disabled >/dev/null && meson compile -C build >/dev/null)
fi
mpi="mpirun --oversubscribe --allow-run-as-root --bind-to none"
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
if [ -n "${GEMM_ARGS:-}" ]; then
  # A product's row: ... op m n k tessera ...; the mean of the tessera column.
  gemm_mean() {
    awk '{ for (i = 1; i + 4 <= NF; i++) if ($i ~ /^(NN|NT|TN|TT)$/ && $(i + 4) ~ /^[0-9.]+$/) { s += $(i + 4); n++; break } }
         END { if (n) printf "%.2f\n", s / n }'
  }
  ours=(); theirs=()
  for r in $(seq "$rounds"); do
    ours+=("$("$root/$build/benchmarks/bench_gemm" $GEMM_ARGS | gemm_mean)")
    theirs+=("$("$wt/build/benchmarks/bench_gemm" $GEMM_ARGS | gemm_mean)")
    echo "round $r: bench_gemm mean ${ours[-1]} vs ${theirs[-1]} GFLOP/s"
  done
  awk -v a="$(median "${ours[@]}")" -v b="$(median "${theirs[@]}")" -v s="$sha" \
    'BEGIN { printf "bench_gemm (mean of its products) this tree %.1f GFLOP/s, %s %.1f -> ratio %.3f (this / base)\n", a, s, b, a / b }'
  exit 0
fi
step_ms() { sed -nE 's/.*step ([0-9.]+) ms.*/\1/p' | head -1; }
fsdp_ms() { awk '$1 == "fsdp" {print $2}'; }
ours_step=(); base_step=(); ours_fsdp=(); base_fsdp=()
for r in $(seq "$rounds"); do
  ours_step+=("$("$root/$build/benchmarks/bench_step" ${STEP_ARGS:-10} | step_ms)")
  base_step+=("$("$wt/build/benchmarks/bench_step" ${STEP_ARGS:-10} | step_ms)")
  ours_fsdp+=("$(OMP_NUM_THREADS=1 $mpi -np 2 -x OMP_NUM_THREADS "$root/$build/benchmarks/bench_fsdp" 8 | fsdp_ms)")
  base_fsdp+=("$(OMP_NUM_THREADS=1 $mpi -np 2 -x OMP_NUM_THREADS "$wt/build/benchmarks/bench_fsdp" 8 | fsdp_ms)")
  echo "round $r: bench_step ${ours_step[-1]} vs ${base_step[-1]} ms, bench_fsdp (2 ranks) ${ours_fsdp[-1]} vs ${base_fsdp[-1]} ms"
done
report() {
  awk -v n="$1" -v a="$2" -v b="$3" -v s="$sha" \
    'BEGIN { printf "%-22s this tree %7.1f ms, %s %7.1f ms -> ratio %.3f (base / this)\n", n, a, s, b, b / a }'
}
report "bench_step ${STEP_ARGS:-10} (1 rank)" "$(median "${ours_step[@]}")" "$(median "${base_step[@]}")"
report "bench_fsdp (2 ranks)" "$(median "${ours_fsdp[@]}")" "$(median "${base_fsdp[@]}")"
