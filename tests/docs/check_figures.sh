#!/usr/bin/env bash
# The figures the documents quote in their prose, recomputed and looked for:
# each `expect DOC TEXT` below builds TEXT from what tessera-plan prints today
# (or a seconds-long tiny run) and fails, showing the text it wanted, when
# DOC does not contain it. Tables and longer passages are numbers blocks
# (tests/docs/check_numbers.sh); timings measured on one machine are not
# recomputed, and say which machine and date they came from.
#   tests/docs/check_figures.sh BUILD SOURCE
set -euo pipefail
# Planned as the libraries run the f32 products (the kernels' baseline
# copy), so that the figures are the same on every CPU: with AVX2 alone
# Tessera's own GEMM kernel runs the large products, and its packed operands
# raise some peaks (docs/fsdp-why.md says by how much; checked below).
export TESSERA_CPU_ISA=baseline
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
plan=$build/tools/tessera-plan
train=$build/tools/tessera-train
checked=0
fail() { echo "FAIL: $*"; exit 1; }
expect() {  # DOC TEXT
  local doc=$1 text=$2
  # Prose wraps: compare with the lines joined and spaces squeezed.
  tr '\n' ' ' < "$src/$doc" | tr -s ' ' | grep -qF -- "$text" ||
    fail "$doc does not say \"$text\" (what the code gives today): update the figure"
  checked=$((checked + 1))
}
peak() { "$plan" --ranks "$@" | awk '/predicted peak/ { print $3 }'; }          # RANKS ARGS...
handed() { "$plan" --ranks "$@" | awk '/^  dp_shard / { print $8 }'; }
counts() { "$plan" --ranks "$@" | awk '/^  dp_shard / { print $3, $5 }'; }
d=(--preset default)

# fsdp-why.md: the peaks as the own f32 kernel plans them on a CPU with AVX2 alone.
avx2_peak() { TESSERA_CPU_ISA=avx2 OMP_NUM_THREADS=2 peak "$@"; }
expect docs/fsdp-why.md "on 2 threads the plan's peaks are $(avx2_peak 1 "${d[@]}") MiB at 1 rank, $(avx2_peak 2 "${d[@]}") MiB at 2 ranks and $(avx2_peak 4 "${d[@]}") MiB at 4 ranks"
# labs.md
expect docs/labs.md "per rank falls from $(peak 1 --preset tiny) to $(peak 4 --preset tiny) MiB"
read -r ag rs < <(counts 2 "${d[@]}")
expect docs/labs.md "the same $ag all-gathers and $rs reduce-scatters per step"
expect docs/labs.md "($(peak 2 "${d[@]}") -> $(peak 2 "${d[@]}" --parallelism.prefetch false) MiB)"
read -r ag0 _ < <(counts 2 "${d[@]}" --parallelism.reshard_after_forward false)
expect docs/labs.md "$ag0 all-gathers instead of $ag, $(handed 2 "${d[@]}" --parallelism.reshard_after_forward false) instead of $(handed 2 "${d[@]}") MiB handed to MPI"
expect docs/labs.md "a higher peak ($(peak 2 "${d[@]}" --parallelism.reshard_after_forward false) against $(peak 2 "${d[@]}") MiB)"
expect docs/labs.md "a peak of $(peak 4 "${d[@]}" --parallelism.data_parallel_replicate_degree 2) MiB against $(peak 4 "${d[@]}") MiB for FSDP over all 4"
bf=(--mixed_precision.param_dtype bfloat16)
expect docs/labs.md "falls from $(peak 2 "${d[@]}") to $(peak 2 "${d[@]}" "${bf[@]}" --bf16-products native) MiB with bf16 products ($(peak 2 "${d[@]}" "${bf[@]}" --bf16-products amx) MiB on AMX, whose kernel packs its operands; $(OMP_NUM_THREADS=1 peak 2 "${d[@]}" "${bf[@]}" --bf16-products own) MiB on AVX2 at one thread per rank, where Tessera's f32 kernel packs them widened; $(peak 2 "${d[@]}" "${bf[@]}" --bf16-products f32) MiB on f32 copies"
expect docs/labs.md "from $(handed 2 "${d[@]}") to $(handed 2 "${d[@]}" "${bf[@]}" --bf16-products native) MiB"
ac=(--activation_checkpoint.mode full)
expect docs/labs.md "($(peak 1 --preset tiny "${ac[@]}") against $(peak 1 --preset tiny) MiB; for the default model at 2 ranks the plan says $(peak 2 "${d[@]}" "${ac[@]}") against $(peak 2 "${d[@]}") MiB)"
params=$("$plan" --ranks 1 --preset tiny | sed -n 's/.*(\([0-9]*\) without the position table.*/\1/p')
expect docs/labs.md "d=64 ($(python3 -c "print(f'{$params:,}')") parameters)"

# labs.md lab 11: the default model at 2 sequences of 2048 tokens, CP 1 and CP 4.
long=(--training.seq_len 2048 --training.batch_size 2)
above() { "$plan" --ranks "$@" | awk '/forward \+ backward/ { print $5 }'; }
expect docs/labs.md "fall from $(above 1 "${long[@]}") MiB on one rank to $(above 4 "${long[@]}" --parallelism.context_parallel_degree 4) MiB per rank at CP 4"
cp4=$("$plan" --ranks 4 "${long[@]}" --parallelism.context_parallel_degree 4)
kv=$(sed -n 's/.* it sends \([0-9.]* MiB\) of K\/V forward.*/\1/p' <<< "$cp4")
expect docs/labs.md "sends $kv of K/V per layer forward"
read -r cag crs < <(awk '/^  cp / { print $3, $5 }' <<< "$cp4")
expect docs/labs.md "$cag all-gathers and $crs reduce-scatters per step (two and one per layer)"
cp4r=$("$plan" --ranks 4 "${long[@]}" --parallelism.context_parallel_degree 4 --parallelism.context_parallel_rotate_method ring)
expect docs/context-parallel.md "$(sed -n 's/^\(context parallel: 4 ranks, ring, .*\)$/\1/p' <<< "$cp4r")"
expect docs/context-parallel.md "$(awk '/K\/V blocks and their gradients/ { print $2 }' <<< "$cp4r") messages sent per step with the ring"
expect docs/context-parallel.md "or $cag all-gathers and $crs reduce-scatters with the all-gather"
expect docs/context-parallel.md "the ring holds less than the all-gather: $(above 4 "${long[@]}" --parallelism.context_parallel_degree 4 --parallelism.context_parallel_rotate_method ring) MiB"
expect docs/context-parallel.md "($(above 4 "${long[@]}" --parallelism.context_parallel_degree 4) against $(above 1 "${long[@]}") MiB above the steady state"
expect docs/context-parallel.md "the activations per rank at CP 4 are $(python3 -c "print(f'{$(above 4 "${long[@]}" --parallelism.context_parallel_degree 4) / $(above 1 "${long[@]}"):.2f}')") of CP 1's"

# labs.md lab 12: moe-small at 4 ranks, EP 1, 2 and 4.
moe() { "$plan" --ranks 4 --preset moe-small --parallelism.expert_parallel_degree "$@"; }
ring() { awk -v g="$1" '$1 == g && /on a ring/ { print $(NF-4) }'; }  # GROUP: its ring MiB
ep1=$(moe 1) ep2=$(moe 2) ep4=$(moe 4)
expect docs/labs.md "$(grep -o 'the routed experts are [0-9]* parameters ([0-9]*% of the model), [0-9]* of them active per token' <<< "$ep1")"
expect docs/labs.md "the \`dp_shard\` group sends $(ring dp_shard <<< "$ep1") MiB on a ring"
expect docs/labs.md "(\`dp_shard_mod_ep\`, $(ring dp_shard_mod_ep <<< "$ep2") MiB)"
a2a=$(awk '$1 == "ep" { for (i = 1; i <= NF; ++i) if ($i == "all-to-all") print $(i + 1) }' <<< "$ep2")
expect docs/labs.md "group's $a2a all-to-alls per step (5 per MoE layer) send $(ring ep <<< "$ep2") MiB"
expect docs/labs.md "the dense parts' $(ring dp_shard <<< "$ep2") MiB, $(python3 -c "print(f'{$(ring dp_shard <<< "$ep2") + $(ring dp_shard_mod_ep <<< "$ep2") + $(ring ep <<< "$ep2"):.1f}')") MiB in all"
expect docs/labs.md "the tokens' $(ring ep <<< "$ep4") MiB and the dense $(ring dp_shard <<< "$ep4") MiB make $(python3 -c "print(f'{$(ring dp_shard <<< "$ep4") + $(ring ep <<< "$ep4"):.1f}')") MiB"
bound() { sed -n 's/.*receive up to \([0-9.]*x\) the balanced rows.*/\1/p'; }
expect docs/labs.md "$(bound <<< "$ep2") the balanced rows at EP 2 and $(bound <<< "$ep4") at EP 4"

# The tiny run of labs 1 and 6 (a second each): the loss at step 40, to the bit.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run40() { (cd "$work" && "$train" --preset tiny --training.steps 40 --sample.max_new_tokens 0 --metrics.progress off \
  --training.data_dir "$work/data" --job.dump_folder "$1" "${@:2}" > /dev/null) &&
  python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(next(repr(r["loss"]) for r in rows if r.get("step") == 40 and "loss" in r))' "$work/$1/metrics.jsonl"; }
loss=$(run40 r1)
expect docs/labs.md "here \`$loss\` in both files"
[[ $(run40 ac "${ac[@]}") == "$loss" ]] || fail "activation checkpointing changed the loss at step 40 (labs.md lab 6 says it does not)"
expect docs/labs.md "to the bit (\`$loss\`)"

# fsdp-pictures.md and fsdp-why.md
expect docs/fsdp-pictures.md "($(peak 2 "${d[@]}") -> $(peak 2 "${d[@]}" --parallelism.prefetch false) MiB"
expect docs/fsdp-pictures.md "instead of nine, $(handed 2 "${d[@]}" --parallelism.reshard_after_forward false) instead of $(handed 2 "${d[@]}") MiB handed to MPI, and a higher peak ($(peak 2 "${d[@]}" --parallelism.reshard_after_forward false) MiB)"
expect docs/fsdp-pictures.md "higher than FSDP's over 4 ranks ($(peak 4 "${d[@]}" --parallelism.data_parallel_replicate_degree 2) against $(peak 4 "${d[@]}") MiB)"
expect docs/fsdp-why.md "The peak, $(peak 4 "${d[@]}") MiB, is that plus"
expect docs/cpu.md "the bf16 row's peak, $(peak 2 "${d[@]}" "${bf[@]}" --bf16-products native) against $(peak 2 "${d[@]}" "${bf[@]}" --bf16-products f32) MiB)"
# planning.md: the refusal of a run that cannot fit (the available memory and
# the "(fits)" marks are the machine's; the needs are the plan's).
refusal=$("$train" --preset tiny --training.batch_size 4096 --training.seq_len 1024 2>&1 || true)
need=$(sed -n 's/.*each rank needs \([0-9.]* GiB\).*/\1/p' <<< "$refusal")
expect docs/planning.md "each rank needs $need ($need for the 1 rank(s) on this node)"
# The bf16 option's peak depends on the CPU (bf16 products native or on f32
# copies): the document gives both.
while read -r option; do
  case $option in
    *bfloat16*) expect docs/planning.md "bf16 option: ${option##*bfloat16 }" ;;
    *) expect docs/planning.md "$option" ;;
  esac
done < <(awk '/^Settings nearby:/ { on = 1; next } on && /GiB per rank/ { sub(/ *\(fits\)/, ""); $1 = $1; print }' <<< "$refusal")
echo "docs: $checked figures in the prose are what the code gives today"
