#!/usr/bin/env bash
# Checkpoints across processes (ckpt_tool does the work; see its header).
#   1. Save at every W in 1..4 and on a 2x2 mesh; load at every W' in 1..4
#      and on a 2x2 mesh: every shard identical to the full reference.
#   2. Exact resume: (train 3, save, restart, train 3 more) == train 6, bit for
#      bit, at the same world size; within f32 rounding at other world sizes.
#   3. A rank killed with SIGKILL in the middle of a save: the step-N.tmp
#      directory never loads, the previous checkpoint stays the latest and
#      resumes exactly.
set -euo pipefail
tool=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
mpi=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
run() { local np=$1; shift; "${mpi[@]}" -np "$np" "$tool" "$@"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

echo "== reshard: save at W, load at W'"
for w in 1 2 3 4; do
  run "$w" save "$work/w$w" "$work/ref$w.safetensors"
  for w2 in 1 2 3 4; do
    out=$(run "$w2" verify "$(ls -d "$work/w$w"/step-*)" "$work/ref$w.safetensors")
    echo "W=$w -> W'=$w2: $out"
    [[ $out == *"mismatches 0"* ]] || fail "W=$w -> W'=$w2"
  done
  out=$(run 4 verify "$(ls -d "$work/w$w"/step-*)" "$work/ref$w.safetensors" 2d)
  echo "W=$w -> 2x2 mesh: $out"
  [[ $out == *"mismatches 0"* ]] || fail "W=$w -> 2x2"
done
echo "== reshard: save on a 2x2 HSDP mesh, load on 1-D meshes and on 2x2"
run 4 save "$work/hsdp" "$work/ref-hsdp.safetensors" 2d
for w2 in 1 2 3 4; do
  out=$(run "$w2" verify "$(ls -d "$work/hsdp"/step-*)" "$work/ref-hsdp.safetensors")
  echo "2x2 -> W'=$w2: $out"
  [[ $out == *"mismatches 0"* ]] || fail "2x2 -> W'=$w2"
done
out=$(run 4 verify "$(ls -d "$work/hsdp"/step-*)" "$work/ref-hsdp.safetensors" 2d)
echo "2x2 -> 2x2: $out"
[[ $out == *"mismatches 0"* ]] || fail "2x2 -> 2x2"

losses() { grep '^step' | awk '$2 >= 3'; }
echo "== exact resume"
for w in 1 2 3 4; do
  straight=$(run "$w" train "$work/r$w" 6 3 | losses)
  [[ $(echo "$straight" | wc -l) == 3 ]] || fail "expected 3 losses, got: $straight"
  resumed=$(run "$w" resume "$work/r$w" 6 | losses)
  echo "W=$w straight: $(echo $straight)"
  echo "W=$w resumed:  $(echo $resumed)"
  [[ "$straight" == "$resumed" ]] || fail "resume at W=$w is not bitwise identical"
done
echo "== resume on another world size (f32 rounding)"
straight=$(run 2 train "$work/x" 6 3 | losses)
for w in 1 3 4; do
  resumed=$(run "$w" resume "$work/x" 6 | losses)
  echo "W=2 -> $w resumed: $(echo $resumed)"
  paste <(echo "$straight") <(echo "$resumed") | awk '{ d = $4 - $8; if (d < 0) d = -d;
    if (d > 1e-5 * ($4 < 0 ? -$4 : $4)) { print "step " $2 ": " $4 " vs " $8; bad = 1 } } END { exit bad }' \
    || fail "resume W=2 -> $w drifted beyond f32 rounding"
done

echo "== a rank killed mid-save"
run 2 train "$work/k" 6 3 >/dev/null
set +e
TESSERA_CHECKPOINT_KILL_RANK=1 TESSERA_CHECKPOINT_KILL_AFTER=200 run 2 resume "$work/k" 6 5 \
  >"$work/killed.log" 2>&1
rc=$?
set -e
[[ $rc != 0 ]] || fail "the killed save exited 0"
[[ -d "$work/k/step-00000005.tmp" ]] || fail "expected an incomplete step-00000005.tmp"
[[ ! -e "$work/k/step-00000005" ]] || fail "an interrupted save produced step-00000005"
[[ $(cat "$work/k/latest") == "step-00000003" ]] || fail "latest moved to an incomplete checkpoint"
if out=$(run 1 verify "$work/k/step-00000005.tmp" "$work/ref1.safetensors" 2>&1); then
  fail "the incomplete directory loaded"
fi
[[ $out == *"no checkpoint metadata"* ]] || fail "unexpected error for the incomplete directory: $out"
resumed=$(run 2 resume "$work/k" 6 | losses)
straight=$(run 2 train "$work/k2" 6 3 | losses)
[[ "$straight" == "$resumed" ]] || fail "resume after the interrupted save differs"
echo "interrupted save: previous checkpoint loads and resumes exactly"
echo "checkpoint_test: all passed"
