#!/usr/bin/env bash
# The generated figures of the documents are what their scripts print today:
# every block of docs/*.md between
#   <!-- numbers begin: SCRIPT ... -->   and   <!-- numbers end -->
# is compared with the output of `SCRIPT BUILD` (SCRIPT relative to the
# repository root), so the figures cannot drift from the code; and a code
# block marked as a file's (below) is that file's text.
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
# Code shown as a file's: the block after
#   <!-- code from: PATH ... -->
# is PATH's text from its first #include on.
for doc in "$src"/README.md "$src"/docs/*.md; do
  while read -r path; do
    want=$(sed -n '/^#include/,$p' "$src/$path")
    got=$(awk -v p="$path" '
      index($0, "<!-- code from: " p) == 1 { on = 1; next }
      on == 1 && /^```/ { on = 2; next }
      on == 2 && /^```/ { exit }
      on == 2 { print }' "$doc")
    if [[ "$want" != "$got" ]]; then
      echo "FAIL: ${doc#$src/}: the code shown as $path is not the file's; update it:"
      diff <(echo "$want") <(echo "$got") || true
      exit 1
    fi
    echo "${doc#$src/}: the code shown as $path is the file's ($(wc -l <<< "$got") lines)"
  done < <(sed -n 's/^<!-- code from: \([^ ]*\).*/\1/p' "$doc")
done
