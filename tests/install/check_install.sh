#!/bin/sh
# Installs the build into a temporary root, then compiles and runs
# tests/install/embed.cpp against that copy using only `pkg-config tessera`.
set -eu
build_dir=$1
source_dir=$2
sanitize=${3:-none}  # a sanitized library needs a sanitized program
extra=""
[ "$sanitize" = none ] || extra="-fsanitize=$sanitize"
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
meson install -C "$build_dir" --destdir "$root" --no-rebuild --quiet >/dev/null
pc=$(find "$root" -name tessera.pc | head -n 1)
[ -n "$pc" ] || { echo "tessera.pc was not installed"; exit 1; }
prefix=$(sed -n 's/^prefix=//p' "$pc")
export PKG_CONFIG_PATH="$(dirname "$pc")"
flags=$(pkg-config --define-variable=prefix="$root$prefix" --cflags --libs tessera)
libdir=$(pkg-config --define-variable=prefix="$root$prefix" --variable=libdir tessera)
[ -f "$root$prefix/include/tessera/tessera.h" ] || { echo "umbrella header missing"; exit 1; }
[ -f "$root$prefix/include/tessera/runtime/tensor.h" ] || { echo "runtime headers missing"; exit 1; }
c++ -O1 $extra "$source_dir/tests/install/embed.cpp" $flags -Wl,-rpath,"$libdir" -o "$root/embed"
"$root/embed"
