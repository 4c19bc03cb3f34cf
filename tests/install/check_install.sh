#!/usr/bin/env bash
# Installs the build into a temporary root and checks it as an embedding
# engine would use it:
#   - libtessera.so.0 (SONAME) and libtessera.a are there;
#   - the public headers compile with -Wall -Wextra -Wpedantic -Werror and pull
#     in no MPI, BLAS, oneDNN, OpenMP, CUDA or JSON header;
#   - tests/install/embed.cpp builds with `pkg-config tessera` (shared, and
#     static with --static) and with CMake's find_package(Tessera) (shared and
#     static), and each program runs
#     without LD_LIBRARY_PATH; the static one also has no wider instruction
#     outside the kernels' AVX2/AVX-512 copies (tests/tools/check_isa.sh);
#   - the installed programs run without LD_LIBRARY_PATH from the prefix and
#     from a copy of it (run path $ORIGIN/../<libdir>);
#   - tests/install/train_hf.cpp, built the same four ways, loads a Hugging
#     Face GPT-2 folder and its tokenizer.json, trains it with FSDP over 2 ranks
#     for three steps and writes a checkpoint: its losses equal tessera-train's
#     on the same data and seed, bit for bit.
set -eu
build_dir=$1
source_dir=$2
sanitize=${3:-none}  # a sanitized library needs a sanitized program
native=${4:-false}
extra=""
[ "$sanitize" = none ] || extra="-fsanitize=$sanitize"
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
meson install -C "$build_dir" --destdir "$root" --no-rebuild --quiet >/dev/null
pc=$(find "$root" -name tessera.pc | head -n 1)
[ -n "$pc" ] || fail "tessera.pc was not installed"
prefix=$(sed -n 's/^prefix=//p' "$pc")
export PKG_CONFIG_PATH="$(dirname "$pc")"
pcflags="--define-variable=prefix=$root$prefix"
libdir=$(pkg-config "$pcflags" --variable=libdir tessera)
[ -f "$root$prefix/include/tessera/tessera.h" ] || fail "umbrella header missing"
[ -f "$root$prefix/include/tessera/runtime/tensor.h" ] || fail "runtime headers missing"

# The libraries: a versioned shared one and a static one.
[ -f "$libdir/libtessera.a" ] || fail "libtessera.a was not installed"
soname=$(readelf -d "$libdir/libtessera.so" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$soname" = libtessera.so.0 ] || fail "SONAME is '$soname', expected libtessera.so.0"
[ -L "$libdir/libtessera.so.0" ] || fail "libtessera.so.0 link missing"
echo "libraries: libtessera.so (SONAME $soname), libtessera.a"

# The headers in a user's strict build, and what they include.
flags=$(pkg-config "$pcflags" --cflags --libs tessera)
# Every installed header, not only those the umbrella includes.
(cd "$root$prefix/include" && find tessera -name '*.h' | sort | sed 's/.*/#include <&>/') > "$root/all_headers.cpp"
c++ -fsyntax-only -H -Wall -Wextra -Wpedantic -Werror $extra "$root/all_headers.cpp" \
  $(pkg-config "$pcflags" --cflags tessera) 2> "$root/includes" \
  || { cat "$root/includes"; fail "the public headers do not compile with -Wall -Wextra -Wpedantic -Werror"; }
leaks=$(grep -E '^\.+ ' "$root/includes" | grep -v "$root/" | grep -E '/(mpi|cblas|openblas[^/]*|omp|nccl|cuda[^/]*|cublas[^/]*)\.h$|/oneapi/|/nlohmann/|/toml\+\+/' || true)
[ -z "$leaks" ] || { echo "$leaks"; fail "the public headers include library headers a user should not see"; }
echo "headers: all $(wc -l < "$root/all_headers.cpp") -Wall -Wextra -Wpedantic -Werror clean, no MPI/BLAS/oneDNN/OpenMP/CUDA/JSON inside"

# What the compile line gets: the headers' folders and fmt's, no MPI or CUDA include folder.
cflags=$(pkg-config "$pcflags" --cflags tessera)
case "$cflags" in *mpi*|*cuda*|*openblas*|*dnnl*) fail "pkg-config --cflags tessera leaks library include folders: $cflags";; esac

# pkg-config, shared library, no LD_LIBRARY_PATH: the program finds it by its run path.
c++ -O1 -Wall -Wextra -Wpedantic -Werror $extra "$source_dir/tests/install/embed.cpp" $flags \
  -Wl,-rpath,"$libdir" -o "$root/embed"
env -u LD_LIBRARY_PATH "$root/embed"
env -u LD_LIBRARY_PATH ldd "$root/embed" | grep -q "$libdir/libtessera.so.0" || fail "pkg-config program does not load the installed libtessera.so.0"

# pkg-config --static: Libs.private names everything libtessera.a needs.
c++ -O1 $extra "$source_dir/tests/install/embed.cpp" $cflags "$libdir/libtessera.a" \
  $(pkg-config "$pcflags" --static --libs tessera | sed 's/-ltessera\b//') -o "$root/embed_static_pc" \
  || fail "a static link with pkg-config --static --libs tessera failed"
env -u LD_LIBRARY_PATH "$root/embed_static_pc"

# CMake: find_package(Tessera), shared and static.
cmake -S "$source_dir/tests/install/cmake" -B "$root/cmake-build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$root$prefix" -DCMAKE_CXX_FLAGS="-Wall -Wextra -Wpedantic -Werror $extra" \
  > "$root/cmake.log" 2>&1 || { cat "$root/cmake.log"; fail "cmake could not configure against the install"; }
cmake --build "$root/cmake-build" > "$root/cmake-build.log" 2>&1 \
  || { cat "$root/cmake-build.log"; fail "cmake could not build against the install"; }
env -u LD_LIBRARY_PATH "$root/cmake-build/embed_shared"
env -u LD_LIBRARY_PATH "$root/cmake-build/embed_static"
env -u LD_LIBRARY_PATH ldd "$root/cmake-build/embed_shared" | grep -q "$libdir/libtessera.so.0" || fail "CMake shared program does not load the installed libtessera.so.0"
! env -u LD_LIBRARY_PATH ldd "$root/cmake-build/embed_static" | grep -q libtessera || fail "CMake static program loads libtessera.so"
[ "$sanitize" != none ] || "$source_dir/tests/tools/check_isa.sh" "$root/cmake-build/embed_static" "$native"
echo "install: pkg-config (shared, static), CMake (shared, static) programs built and ran"

# The installed programs run from the prefix without LD_LIBRARY_PATH (their
# run path is $ORIGIN/../<libdir>), even from a copy of it elsewhere.
[ "$sanitize" = none ] || { echo "install: the installed programs are not run under $sanitize"; exit 0; }
for prog in tessera-train tessera-plan tessera-generate tessera-ckpt tessera-data tessera-run; do
  env -u LD_LIBRARY_PATH ldd "$root$prefix/bin/$prog" | grep -q "libtessera.so.0 => $root$prefix/bin/\.\./" ||
    fail "the installed $prog does not load the installed libtessera.so.0: $(env -u LD_LIBRARY_PATH ldd "$root$prefix/bin/$prog" | grep tessera)"
done
cp -a "$root$prefix" "$root/moved"
( cd "$root" && env -u LD_LIBRARY_PATH moved/bin/tessera-train --preset tiny --training.steps 3 \
    --training.data_dir "$root/tiny-data" --job.dump_folder installed-run --sample.max_new_tokens 0 \
    --metrics.progress off > installed-run.log 2>&1 ) || { cat "$root/installed-run.log"; fail "the installed tessera-train did not run from a moved prefix"; }
env -u LD_LIBRARY_PATH "$root/moved/bin/tessera-plan" --preset tiny --ranks 2 | grep -q "predicted peak" ||
  fail "the installed tessera-plan did not run from a moved prefix"
echo "install: the installed programs run from the prefix and from a copy of it, without LD_LIBRARY_PATH"

# What tessera-train does, from the installed library alone: a Hugging Face
# GPT-2 folder with its tokenizer (made here by tessera-train and tessera-ckpt
# to-hf from the build), sharded over 2 ranks, three steps, a checkpoint.
tools=$build_dir/tools
mpi="mpirun --oversubscribe --allow-run-as-root --bind-to none -np 2"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
text=$source_dir/README.md  # any text the tokenizer encodes
model=(--model.n_layer 2 --model.n_embd 48 --model.n_head 3 --model.vocab_size 1024 --training.seq_len 32)
( cd "$root" && "$tools/tessera-train" "${model[@]}" --training.steps 4 --training.batch_size 4 \
    --training.tokenizer "$source_dir/tests/fixtures/bpe/tokenizer.json" --training.dataset text \
    --training.text "$text" --job.dump_folder src --training.data_dir src/data --checkpoint.enable true \
    --sample.max_new_tokens 0 --metrics.progress off > src.log 2>&1 ) || { cat "$root/src.log"; fail "tessera-train could not make the model"; }
"$tools/tessera-ckpt" to-hf "$root/src/checkpoint" "$root/hf" > /dev/null || fail "tessera-ckpt to-hf failed"
[ -f "$root/hf/tokenizer.json" ] || fail "to-hf did not copy the tokenizer beside the model"
"$tools/tessera-ckpt" from-hf "$root/hf" "$root/imported" > /dev/null || fail "tessera-ckpt from-hf failed"
( cd "$root" && $mpi "$tools/tessera-train" "${model[@]}" --checkpoint.initial_load_path imported \
    --training.tokenizer hf/tokenizer.json --training.dataset text --training.text "$text" --training.steps 3 \
    --training.batch_size 8 --job.dump_folder ref --training.data_dir ref/data --sample.max_new_tokens 0 \
    --metrics.log_interval 1 --metrics.progress off > ref.log 2>&1 ) || { cat "$root/ref.log"; fail "the reference run failed"; }
want=$(python3 -c 'import json, sys
print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1]) if "\"loss\"" in l))' "$root/ref/metrics.jsonl")
c++ -O1 -Wall -Wextra -Wpedantic -Werror "$source_dir/tests/install/train_hf.cpp" $flags -Wl,-rpath,"$libdir" \
  -o "$root/train_hf" || fail "train_hf.cpp does not build with pkg-config"
c++ -O1 "$source_dir/tests/install/train_hf.cpp" $cflags "$libdir/libtessera.a" \
  $(pkg-config "$pcflags" --static --libs tessera | sed 's/-ltessera\b//') -o "$root/train_hf_static_pc" \
  || fail "train_hf.cpp does not link statically with pkg-config --static"
for prog in "$root/train_hf" "$root/train_hf_static_pc" "$root/cmake-build/train_hf_shared" \
            "$root/cmake-build/train_hf_static"; do
  work=$root/run-$(basename "$prog")
  out=$(env -u LD_LIBRARY_PATH $mpi "$prog" "$root/hf" "$text" "$work" 2>&1) || { echo "$out"; fail "$prog failed"; }
  got=$(python3 -c 'import sys
print(" ".join(repr(float(l.split()[3])) for l in sys.stdin if l.startswith("step ")))' <<< "$out")
  [ "$got" = "$want" ] || fail "$(basename "$prog"): losses $got, tessera-train's $want"
  ls "$work"/checkpoint/step-00000003/metadata.json > /dev/null || fail "$(basename "$prog") wrote no checkpoint"
  "$tools/tessera-ckpt" list "$work/checkpoint" > /dev/null || fail "the checkpoint of $(basename "$prog") does not read"
done
echo "install: a Hugging Face GPT-2 and its tokenizer trained with FSDP over 2 ranks from the installed library" \
  "(pkg-config and CMake, shared and static): losses $want, equal to tessera-train's; checkpoints written"
