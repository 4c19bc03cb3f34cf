#!/usr/bin/env bash
# The figures of docs/fsdp-pictures.md are what docs/fsdp_numbers.sh prints
# today: regenerates the table and compares it with the document's.
#   tests/docs/check_numbers.sh BUILD SOURCE
set -euo pipefail
build=$1
src=$2
doc=$src/docs/fsdp-pictures.md
want=$(sed -n '/<!-- fsdp-numbers begin/,/<!-- fsdp-numbers end/p' "$doc" | sed '1d;$d')
got=$("$src/docs/fsdp_numbers.sh" "$build")
if [[ "$want" != "$got" ]]; then
  echo "FAIL: $doc's table is not what docs/fsdp_numbers.sh prints now; update it:"
  diff <(echo "$want") <(echo "$got") || true
  exit 1
fi
echo "docs/fsdp-pictures.md: the table matches docs/fsdp_numbers.sh ($(wc -l <<< "$got") lines)"
