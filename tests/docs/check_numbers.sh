#!/usr/bin/env bash
# The generated figures of the documents are what their scripts print today:
# every block of docs/*.md between
#   <!-- numbers begin: SCRIPT ... -->   and   <!-- numbers end -->
# is compared with the output of `SCRIPT BUILD` (SCRIPT relative to the
# repository root), so the figures cannot drift from the code.
#   tests/docs/check_numbers.sh BUILD SOURCE
set -euo pipefail
build=$1
src=$2
blocks=0
for doc in "$src"/docs/*.md; do
  while read -r script; do
    [[ -n $script ]] || continue
    want=$(awk -v s="$script" '
      index($0, "<!-- numbers begin: " s) == 1 { on = 1; next }
      on && index($0, "<!-- numbers end") == 1 { exit }
      on { print }' "$doc")
    got=$("$src/$script" "$build")
    if [[ "$want" != "$got" ]]; then
      echo "FAIL: ${doc#$src/}: the block from $script is not what it prints now; update it:"
      diff <(echo "$want") <(echo "$got") || true
      exit 1
    fi
    echo "${doc#$src/}: the block from $script matches ($(wc -l <<< "$got") lines)"
    blocks=$((blocks + 1))
  done < <(sed -n 's/^<!-- numbers begin: \([^ ]*\).*/\1/p' "$doc")
done
(( blocks > 0 )) || { echo "FAIL: no numbers blocks found under $src/docs"; exit 1; }
