#!/usr/bin/env bash
# tools/gpu-check.sh on a machine without a GPU (suite `tools`): --dry-run
# prints every step it would run and names each library a shipped build lacks;
# --ship copies them into BUILD/lib, after which --dry-run finds none missing
# and the shipped copy of the suite runs (SKIP, 77, here).
set -euo pipefail
build=$(cd "$1" && pwd)
work=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
fail() { echo "FAIL: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work/b/tests" "$work/b/tools" "$work/b/benchmarks"
cd "$work"
# A build folder as it would be shipped: the programs and libtessera (found through $ORIGIN/..).
cp -L "$build/libtessera.so.0" b/
cp "$build/tests/test_cuda" b/tests/
cp "$build/tools/tessera-train" b/tools/
[ -x "$build/benchmarks/bench_gpu" ] && cp "$build/benchmarks/bench_gpu" b/benchmarks/

if OUT="$work/out" "$src/tools/gpu-check.sh" --dry-run b > dry1.log 2>&1; then
  fail "--dry-run passed on a build that carries none of its libraries: $(cat dry1.log)"
fi
grep -q "tools/tessera-train needs libtomlplusplus" dry1.log || fail "--dry-run did not name toml++: $(cat dry1.log)"
grep -q "tests/test_cuda needs libfmt" dry1.log || fail "--dry-run did not name fmt: $(cat dry1.log)"
for step in "b/tests/test_cuda --durations yes$" "compute-sanitizer --tool memcheck .*b/tests/test_cuda" \
            "compute-sanitizer --tool racecheck .*b/tests/test_cuda" "tessera-train --job.device cuda" \
            "bench_gpu 10 8" "torch_gpu.py 10 8"; do
  grep -q "^would run: .*$step" dry1.log || fail "--dry-run does not show the step '$step': $(cat dry1.log)"
done
[ ! -e out ] || fail "--dry-run wrote logs"
if grep -q "libcublasLt\|libcudart\|libnccl\|libc\.so\|ld-linux" dry1.log; then
  fail "--dry-run asked for a library every GPU machine brings: $(cat dry1.log)"
fi

"$src/tools/gpu-check.sh" --ship b > ship.log 2>&1 || fail "--ship: $(cat ship.log)"
grep -q "every library the programs need is carried or provided" ship.log || fail "--ship: $(cat ship.log)"
[ -e b/lib/libtomlplusplus.so.3 ] || fail "--ship did not carry toml++: $(ls b/lib)"
[ ! -e b/lib/libcublasLt.so.13 ] && [ ! -e b/lib/libc.so.6 ] || fail "--ship carried what the GPU machine brings: $(ls b/lib)"
OUT="$work/out" "$src/tools/gpu-check.sh" --dry-run b > dry2.log 2>&1 || fail "--dry-run after --ship: $(cat dry2.log)"
grep -q "all carried or provided" dry2.log || fail "--dry-run after --ship: $(cat dry2.log)"

set +e
LD_LIBRARY_PATH="$work/b/lib" b/tests/test_cuda > shipped.log 2>&1
rc=$?
set -e
[ $rc -eq 77 ] || fail "the shipped suite should SKIP (77) without a GPU, exit $rc: $(cat shipped.log)"
grep -q "^SKIP: " shipped.log || fail "the shipped suite's SKIP line: $(cat shipped.log)"
echo "gpu-check: --dry-run, --ship and the shipped suite OK ($(ls b/lib | wc -l) libraries, $(du -sh b/lib | cut -f1))"
