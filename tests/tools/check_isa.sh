#!/usr/bin/env bash
# The CPU kernels are compiled once per instruction set (runtime/cpu/kernels_cpu.h)
# and everything else for any x86-64. This checks the binary for leaks: an
# instruction of x86-64-v3 (VEX-encoded AVX/AVX2/FMA/F16C on xmm or ymm, BMI1/2,
# LZCNT/TZCNT, MOVBE) outside a function of the avx2 or avx512 copies, or of
# AVX-512 (zmm, mask registers) outside the avx512 copy, would crash that
# function on a CPU without the extension (or, for lzcnt/tzcnt, silently
# compute bsr/bsf there).
#   check_isa.sh <libtessera.so> <native: true|false>
set -euo pipefail
lib=$1
native=$2
if [[ $native == true ]]; then
  echo "SKIP: built with -Dnative=true (everything for this machine's CPU)"
  exit 77
fi
if [[ $(uname -m) != x86_64 ]]; then
  echo "SKIP: not an x86-64 build"
  exit 77
fi
command -v objdump > /dev/null || { echo "SKIP: no objdump"; exit 77; }
objdump -d --no-show-raw-insn -C "$lib" | awk '
  /^[0-9a-f]+ <.*>:$/ { fn = $0; next }
  /%zmm|%k[0-7]/ { if (fn !~ /cpu::avx512::/) bad[fn] = "AVX-512"; n512++ }
  /%ymm|\tv[a-z0-9]+ .*%xmm|\t(andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx|lzcnt|tzcnt|movbe) / {
    if (fn !~ /cpu::avx(2|512)::/) bad[fn] = "x86-64-v3"; nvex++
  }
  END {
    for (f in bad) { printf "%s instruction outside its copy in %s\n", bad[f], f; nbad++ }
    if (nbad > 0) exit 1
    if (nvex == 0) { print "no x86-64-v3 instruction at all: the avx2 copy was not built"; exit 1 }
    printf "ok: %d x86-64-v3 and %d AVX-512 instructions, all inside their copies\n", nvex, n512
  }'
