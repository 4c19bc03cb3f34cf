#!/usr/bin/env bash
# tessera-run end to end, on the tiny preset with a checkpoint every 5 steps:
#   rank 3 of 4 killed at step 13: the job restarts by itself from step 10
#     and ends at the loss, bit for bit, of the killed run's step-10
#     checkpoint resumed by hand on 4 ranks;
#   the same, with --on-failure taking a node out of the hostfile: the job
#     restarts on 3 ranks (the checkpoint reshards) and ends at the loss of
#     that checkpoint resumed by hand on 3;
#   a rank that stops answering: the others' collectives time out, and the
#     job restarts from step 5;
#   a rank killed at step 13 in every launch: the loop stops after the second
#     time, naming the step and the error; restarts.jsonl says what happened;
#   refusals: restarts without checkpoints, a hostile hostfile.
set -euo pipefail
bin=$1      # build/tools
work=$2
rm -rf "$work"
mkdir -p "$work"
cd "$work"
fail() { echo "FAIL: $*" >&2; exit 1; }
launcher="mpirun --oversubscribe --allow-run-as-root --bind-to none"
# batch 12: a multiple of both 4 and 3 ranks.
args=(--preset tiny --training.steps 20 --training.batch_size 12 --metrics.log_interval 1
      --training.data_dir "$work/data" --sample.max_new_tokens 0 --metrics.progress off
      --checkpoint.enable true --checkpoint.interval 5 --checkpoint.keep 0)
# The loss at the last step (full precision, from the JSONL file).
final_loss() { python3 -c '
import json, sys
last = None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "loss" in r: last = (r["step"], repr(r["loss"]))
print(*last)' "$1/metrics.jsonl"; }

echo "== the references: the killed run's step-10 checkpoint resumed by hand on 4 and on 3 ranks"
if TESSERA_TEST_KILL=3:13 $launcher -np 4 "$bin/tessera-train" "${args[@]}" --job.dump_folder killed > killed.log 2>&1; then
  fail "the run with a killed rank exited 0"
fi
[[ -d killed/checkpoint/step-00000010 ]] || fail "no step-10 checkpoint: $(ls killed/checkpoint)"
for np in 4 3; do
  mkdir -p ref$np/checkpoint
  cp -r killed/checkpoint/step-00000005 killed/checkpoint/step-00000010 ref$np/checkpoint/
  $launcher -np $np "$bin/tessera-train" "${args[@]}" --job.dump_folder ref$np --checkpoint.resume true \
    > ref$np.log 2>&1 || fail "resume on $np ranks: $(tail -5 ref$np.log)"
  grep -q "resumed from .*step-00000010" ref$np.log || fail "ref$np did not resume from step 10"
done
echo "reference losses: 4 ranks $(final_loss ref4), 3 ranks $(final_loss ref3)"

echo "== rank 3 killed at step 13: restarts by itself on 4 ranks"
TESSERA_TEST_KILL=3:13:0 "$bin/tessera-run" --np 4 --launcher "$launcher" --restart-delay 0 -- \
  "${args[@]}" --job.dump_folder same --job.max_restarts 2 > same.log 2>&1 || fail "restart on 4: $(tail -5 same.log)"
grep -q "rank 3: killing itself at step 13" same.log || fail "rank 3 was not killed"
grep -q "tessera-run: failed at step 13: a rank was killed by signal 9.*restart 1 of 2 from step 10 (3 steps lost)" same.log ||
  fail "no restart line: $(grep tessera-run same.log)"
[[ $(final_loss same) == "$(final_loss ref4)" ]] || fail "final loss $(final_loss same) != the resumed run's $(final_loss ref4)"
python3 - same/restarts.jsonl <<'EOF' || fail "restarts.jsonl: $(cat same/restarts.jsonl)"
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
assert [x["next"] for x in r] == ["restart", "done"], r
assert r[0]["step"] == 13 and r[0]["resumed_from_step"] == 10 and r[0]["steps_lost"] == 3 and r[0]["ranks"] == 4, r[0]
assert r[0]["exit_code"] == 137 and "signal 9" in r[0]["error"], r[0]
EOF
grep -q '"status": "completed"' same/status.json || fail "status: $(cat same/status.json)"
echo "restart on 4 ranks: final loss $(final_loss same), the same as resuming by hand"

echo "== the same, a node gone: the hostfile loses a slot and the job restarts on 3 ranks"
echo "localhost slots=4" > hosts
TESSERA_TEST_KILL=3:13:0 "$bin/tessera-run" --hostfile hosts --launcher "$launcher" --restart-delay 0 \
  --on-failure 'echo "localhost slots=3  # one gone at step $TESSERA_FAILED_STEP" > hosts' -- \
  "${args[@]}" --job.dump_folder shrunk --job.max_restarts 1 > shrunk.log 2>&1 || fail "restart on 3: $(tail -5 shrunk.log)"
grep -q "tessera-run: launch 2 on 3 ranks" shrunk.log || fail "not relaunched on 3: $(grep tessera-run shrunk.log)"
grep -q "saved on 4 rank(s), now 3" shrunk.log || fail "no reshard on resume: $(grep resumed shrunk.log)"
[[ $(final_loss shrunk) == "$(final_loss ref3)" ]] || fail "final loss $(final_loss shrunk) != the resumed run's $(final_loss ref3)"
echo "restart on 3 ranks: final loss $(final_loss shrunk), the same as resuming by hand"

echo "== a rank that stops answering: the collectives time out, the job restarts"
TESSERA_COLLECTIVE_TIMEOUT=4 TESSERA_TEST_HANG=2:7:0 "$bin/tessera-run" --np 4 --restart-delay 0 \
  --launcher "$launcher -x TESSERA_COLLECTIVE_TIMEOUT" -- "${args[@]}" --job.dump_folder hang --job.max_restarts 1 \
  > hang.log 2>&1 || fail "restart after a timeout: $(tail -5 hang.log)"
grep -q "tessera-run: failed at step 7: .*did not complete within 4.0 s.*restart 1 of 1 from step 5 (2 steps lost)" hang.log ||
  fail "no restart after the timeout: $(grep tessera-run hang.log)"
[[ $(final_loss hang) == "$(final_loss ref4)" ]] || fail "final loss after the timeout $(final_loss hang) != $(final_loss ref4)"
echo "timeout: restarted from step 5, final loss $(final_loss hang)"

echo "== killed at step 13 in every launch: the loop stops on the second"
if TESSERA_TEST_KILL=3:13 "$bin/tessera-run" --np 4 --launcher "$launcher" --restart-delay 0 -- \
  "${args[@]}" --job.dump_folder again --job.max_restarts 5 > again.log 2>&1; then
  fail "the repeated failure exited 0"
fi
[[ $(grep -c "tessera-run: launch" again.log) == 2 ]] || fail "expected 2 launches: $(grep tessera-run again.log)"
grep -q "tessera-run: stopping: the same failure at step 13 twice: a rank was killed by signal 9" again.log ||
  fail "no stop naming the step and error: $(grep tessera-run again.log)"
python3 -c '
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
assert [x["next"] for x in r] == ["restart", "stop"], r' again/restarts.jsonl || fail "$(cat again/restarts.jsonl)"
echo "repeat: stopped after 2 launches"

echo "== refusals"
if "$bin/tessera-run" --np 2 --launcher "$launcher" -- --preset tiny --job.max_restarts 2 > nock.log 2>&1; then
  fail "restarts without checkpoints were accepted"
fi
grep -q "job.max_restarts 2: .*checkpoint.enable is false" nock.log || fail "$(cat nock.log)"
printf 'node1 slots=2\nnode2 slots=two\n' > badhosts
if "$bin/tessera-run" --hostfile badhosts --launcher "$launcher" -- "${args[@]}" --job.dump_folder bad > bad.log 2>&1; then
  fail "a bad hostfile was accepted"
fi
grep -q "hostfile badhosts line 2: slots must be a count" bad.log || fail "$(cat bad.log)"
mkdir -p hostdir
if "$bin/tessera-run" --hostfile hostdir --launcher "$launcher" -- "${args[@]}" --job.dump_folder bad > dir.log 2>&1; then
  fail "a directory as hostfile was accepted"
fi
grep -q "hostfile hostdir: a directory, not a hostfile" dir.log || fail "$(cat dir.log)"
if "$bin/tessera-run" --np 0 -- --preset tiny > np0.log 2>&1; then fail "--np 0 was accepted"; fi
grep -q "\-\-np: expected a count >= 1, got '0'" np0.log || fail "$(cat np0.log)"
echo "refusals name what is wrong"
echo "PASS"
