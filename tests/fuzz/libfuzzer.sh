#!/usr/bin/env bash
# Builds tests/fuzz/libfuzzer.cpp with clang (libFuzzer + AddressSanitizer +
# UBSan; the readers' sources compiled in with coverage, the rest of Tessera
# linked from BUILD's libtessera.so.0) and fuzzes each reader for SECONDS.
#
#   tests/fuzz/libfuzzer.sh BUILD SECONDS [merge] [TARGET...]
#
# The corpus of interesting inputs lives in tests/fuzz/corpus/TARGET/. A run
# starts from a copy of it (the repository is not touched); with `merge`, the
# new inputs that add coverage are merged back into it (`make fuzz`, by hand).
# Any finding (a crash, a sanitizer report, an exception other than
# tessera::Error, a leak, more than 2 GiB of memory) fails the run; its input
# is kept in BUILD/fuzz-clang/findings/. Without clang++ or its libFuzzer
# runtime (Debian: clang, libclang-rt-14-dev) the test is skipped (exit 77).
set -euo pipefail
build=$(cd "$1" && pwd)
seconds=$2
shift 2
merge=0
if [[ ${1:-} == merge ]]; then merge=1; shift; fi
targets=("$@")
(( ${#targets[@]} )) || targets=(shards metadata datafile safetensors toml tokenizer hf hardware)
root=$(cd "$(dirname "$0")/../.." && pwd)
cxx=${CLANGXX:-clang++}
if ! command -v "$cxx" > /dev/null; then
  echo "SKIP: no $cxx (install Debian's clang and libclang-rt-14-dev)"
  exit 77
fi
out=$build/fuzz-clang
mkdir -p "$out/findings"
echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' > "$out/probe.cpp"
if ! "$cxx" -fsanitize=fuzzer "$out/probe.cpp" -o "$out/probe" 2> "$out/probe.log"; then
  echo "SKIP: $cxx cannot link libFuzzer (install Debian's libclang-rt-14-dev): $(head -1 "$out/probe.log")"
  exit 77
fi

# The build: only when a source is newer than the program.
sources=(tests/fuzz/libfuzzer.cpp nn/safetensors.cpp fsdp/checkpoint_format.cpp io/data.cpp tools/config.cpp tools/config_options.cpp tools/presets.cpp tools/config_check.cpp
         io/tokenizer.cpp io/hf.cpp tools/hardware.cpp runtime/json_scan.cpp)
bin=$out/fuzz_readers_libfuzzer
stale=0
[[ -x $bin ]] || stale=1
for s in "${sources[@]}" "$build/libtessera.so.0"; do
  [[ -f $root/$s || -f $s ]] || continue
  [[ ${s:0:1} == / ]] && f=$s || f=$root/$s
  [[ $f -nt $bin ]] && stale=1
done
if (( stale )); then
  echo "building $bin with $cxx"
  flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
         -fno-omit-frame-pointer -I"$root" -I"$root/include" -I"$build"
         $(pkg-config --cflags fmt tomlplusplus))
  objs=()
  for s in "${sources[@]}"; do
    o=$out/$(basename "${s%.cpp}").o
    "$cxx" "${flags[@]}" -c "$root/$s" -o "$o"
    objs+=("$o")
  done
  "$cxx" -fsanitize=fuzzer,address,undefined "${objs[@]}" -o "$bin" \
    "$build/libtessera.so.0" -Wl,-rpath,"$build" $(pkg-config --libs fmt tomlplusplus)
fi

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 TESSERA_BPE=$root/tests/fixtures/bpe/tokenizer.json
failed=0
for t in "${targets[@]}"; do
  corpus=$root/tests/fuzz/corpus/$t
  [[ -d $corpus ]] || { echo "no corpus $corpus"; exit 1; }
  work=$out/corpus-$t
  rm -rf "$work"
  cp -r "$corpus" "$work"
  dict=()
  [[ -f $root/tests/fuzz/$t.dict ]] && dict=(-dict="$root/tests/fuzz/$t.dict")
  log=$out/$t.log
  rc=0
  FUZZ_TARGET=$t "$bin" "$work" "${dict[@]}" -max_total_time="$seconds" -rss_limit_mb=2048 \
    -max_len=65536 -timeout=20 -artifact_prefix="$out/findings/$t-" -print_final_stats=1 \
    > "$log" 2>&1 || rc=$?
  cov=$(grep -oE "cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9a-zA-Z]+" "$log" | tail -1)
  runs=$(grep -oE "stat::number_of_executed_units: *[0-9]+" "$log" | grep -oE "[0-9]+$" || echo "?")
  if (( rc != 0 )); then
    echo "FAIL $t: libFuzzer exited $rc after $runs runs (log: $log; inputs in $out/findings/)"
    grep -E "FINDING|ERROR|SUMMARY|runtime error" "$log" | head -5
    failed=1
  else
    echo "ok   $t: $runs runs in ${seconds}s, $cov"
  fi
  if (( merge )); then
    FUZZ_TARGET=$t "$bin" -merge=1 "$corpus" "$work" > "$out/$t-merge.log" 2>&1
    echo "     merged into tests/fuzz/corpus/$t: $(ls "$corpus" | wc -l) inputs"
  fi
done
exit $failed
