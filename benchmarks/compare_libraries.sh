#!/usr/bin/env bash
# Two builds of libtessera against each other on one benchmark binary, side
# by side: the binary finds its library through RUNPATH, which
# LD_LIBRARY_PATH overrides, so one bench_step runs on library A, then on B,
# ROUNDS times (A B, then B A, alternating, so that drift hits both alike).
# Prints each round's step times and, at the end, the medians, the median of
# the rounds' A / B ratios (above 1: B is faster) and in how many rounds B
# was faster. Only a change inside the library compares this way (the
# binary and its headers stay A's); compare_commits.sh builds a whole tree.
#   [THREADS=1] benchmarks/compare_libraries.sh DIR_A DIR_B [rounds] [bench_step args...]
# DIR_A and DIR_B each hold a libtessera.so.0, e.g.
#   mkdir -p /tmp/libA && cp -L build/libtessera.so.0 /tmp/libA/    # before the change
#   (change, then: meson compile -C build libtessera.so.0.1.0)
#   mkdir -p /tmp/libB && cp -L build/libtessera.so.0 /tmp/libB/
#   THREADS=2 benchmarks/compare_libraries.sh /tmp/libA /tmp/libB 10 10 4 256
set -eu
[ $# -ge 2 ] || { echo "usage: benchmarks/compare_libraries.sh DIR_A DIR_B [rounds] [bench_step args...]" >&2; exit 2; }
a=$1 b=$2
shift 2
rounds=${1:-10}
[ $# -gt 0 ] && shift
for dir in "$a" "$b"; do
  [ -f "$dir/libtessera.so.0" ] || { echo "compare_libraries: $dir holds no libtessera.so.0" >&2; exit 2; }
done
build=${BUILD:-build}
bench=$build/benchmarks/bench_step
[ -x "$bench" ] || { echo "compare_libraries: $bench is not built (meson compile -C $build)" >&2; exit 2; }
threads=${THREADS:-1}
step_ms() { sed -nE 's/.* step ([0-9.]+) ms.*/\1/p'; }
results=$(mktemp)
trap 'rm -f "$results"' EXIT
echo "bench_step ${*:-(defaults)} at $threads thread(s), $rounds rounds; A = $a, B = $b"
for r in $(seq "$rounds"); do
  order="A B"
  [ $((r % 2)) = 0 ] && order="B A"
  for v in $order; do
    dir=$a
    [ "$v" = B ] && dir=$b
    ms=$(OMP_NUM_THREADS=$threads LD_LIBRARY_PATH=$dir "$bench" "$@" | tail -1 | step_ms)
    [ -n "$ms" ] || { echo "compare_libraries: bench_step printed no step time on library $v" >&2; exit 1; }
    echo "round $r $v $ms ms"
    echo "$r $v $ms" >> "$results"
  done
done
awk '
  { ms[$1, $2] = $3; n = $1 > n ? $1 : n }
  function median(x, k,   i, j, t) {  # sorts x[1..k]
    for (i = 2; i <= k; i++) for (j = i; j > 1 && x[j - 1] > x[j]; j--) { t = x[j]; x[j] = x[j - 1]; x[j - 1] = t }
    return k % 2 ? x[(k + 1) / 2] : (x[k / 2] + x[k / 2 + 1]) / 2
  }
  END {
    for (r = 1; r <= n; r++) { a[r] = ms[r, "A"]; b[r] = ms[r, "B"]; q[r] = ms[r, "A"] / ms[r, "B"]; faster += q[r] > 1 }
    printf "median step: A %.1f ms, B %.1f ms; A / B per round: median %.3f; B faster in %d of %d rounds\n",
      median(a, n), median(b, n), median(q, n), faster, n
  }' "$results"
