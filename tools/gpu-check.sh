#!/usr/bin/env bash
# A GPU machine's check in one command (docs/gpu.md): builds Tessera with CUDA
# (or takes a build folder made elsewhere), runs the `cuda` test suite, then
# compute-sanitizer's memcheck and racecheck over it, then the GPT-2 124M step
# of Tessera (bench_gpu) and of PyTorch eager (benchmarks/torch_gpu.py, where
# torch is installed) side by side, and prints one summary.
#
#   tools/gpu-check.sh                 # build in build-gpu/ (needs meson, ninja and the deps)
#   tools/gpu-check.sh path/to/build   # use a build shipped from another machine
#   OUT=/some/dir tools/gpu-check.sh   # logs there (default: gpu-check-logs/)
set -u
cd "$(dirname "$0")/.."
build=${1:-}
out=${OUT:-gpu-check-logs}
mkdir -p "$out"
start=$(date +%s)
declare -A result

if [ -z "$build" ]; then
  build=build-gpu
  [ -f "$build/build.ninja" ] || meson setup "$build" --buildtype=release -Dcuda=enabled \
    > "$out/setup.log" 2>&1 || { echo "meson setup failed: $out/setup.log"; exit 1; }
  ninja -C "$build" tests/test_cuda benchmarks/bench_gpu tools/tessera-train > "$out/build.log" 2>&1 ||
    { echo "build failed: $out/build.log"; exit 1; }
fi
test_cuda="$build/tests/test_cuda"
[ -x "$test_cuda" ] || { echo "no $test_cuda in the build"; exit 1; }
# A shipped build carries its non-CUDA shared libraries in $build/lib (docs/gpu.md).
[ -d "$build/lib" ] && export LD_LIBRARY_PATH="$build/lib:${LD_LIBRARY_PATH:-}"
[ -f "$build/libtessera.so" ] && export LD_LIBRARY_PATH="$build:${LD_LIBRARY_PATH:-}"
export PATH="$PATH:${CUDA_HOME:-/usr/local/cuda}/bin"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
else
  echo "none found (no nvidia-smi)" > "$out/gpu.txt"
fi

run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  case $rc in 0) result[$name]="pass";; 77) result[$name]="SKIP (no GPU seen)";; *) result[$name]="FAIL (exit $rc)";; esac
  result[$name]="${result[$name]} in $(( $(date +%s) - t0 )) s, log $out/$name.log"
}

run cuda-suite "$test_cuda"
if command -v compute-sanitizer > /dev/null; then
  run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$test_cuda" "~[model]"
  run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$test_cuda" "~[model]"
else
  result[memcheck]="not run (no compute-sanitizer)"
fi

# The planner's check on a GPU (tools/plan.h): a model that cannot fit is
# refused before anything is allocated, against this GPU's free memory.
refused() {
  "$build/tools/tessera-train" --job.device cuda --preset tiny --model.n_embd 65536 --metrics.progress off \
    --job.dump_folder "$out/refused"
  [ $? -eq 2 ]
}
if [ -x "$build/tools/tessera-train" ]; then
  run planner-refusal refused
  grep -q "the planned peak does not fit" "$out/planner-refusal.log" ||
    result[planner-refusal]="FAIL (no planned refusal in $out/planner-refusal.log)"
fi

if [ -x "$build/benchmarks/bench_gpu" ]; then
  run bench-tessera "$build/benchmarks/bench_gpu" 10 8
else
  result[bench-tessera]="not run (no $build/benchmarks/bench_gpu: configure with -Dbenchmarks=true)"
fi
if python3 -c "import torch" 2> /dev/null; then
  run bench-pytorch python3 benchmarks/torch_gpu.py 10 8
else
  result[bench-pytorch]="not run (no torch in python3)"
fi

echo "GPU: $(cat "$out/gpu.txt")"
for k in cuda-suite memcheck racecheck planner-refusal bench-tessera bench-pytorch; do
  [ -n "${result[$k]:-}" ] && echo "$k: ${result[$k]}"
done
for k in bench-tessera bench-pytorch; do grep -hE "^(tessera|pytorch) " "$out/$k.log" 2> /dev/null; done
echo "total $(( $(date +%s) - start )) s"
for k in "${!result[@]}"; do case ${result[$k]} in FAIL*) exit 1;; esac; done
exit 0
