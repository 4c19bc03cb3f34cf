#!/usr/bin/env bash
# Prints the tables of docs/fsdp-why.md (between its numbers markers): the
# default model's memory and communication per rank at 1, 2 and 4 ranks, from
# tessera-plan (whose peaks, optimizer state and collectives the plan tests
# check against real runs, byte for byte). The test docs-numbers compares.
#   docs/fsdp_why_numbers.sh [BUILD]
set -euo pipefail
# Planned on the baseline copy's libraries, the same on every CPU (docs/cpu.md).
export TESSERA_CPU_ISA=baseline
plan=${1:-build}/tools/tessera-plan
declare -A v
for w in 1 2 4; do
  while IFS='=' read -r k val; do v[$w,$k]=$val; done < <("$plan" --preset default --ranks $w | awk '
    /^plan:/ { print "params=" $3; print "micro=" $10 }
    /sharded parameters/ { print "shards=" $3 " " $4 }
    /optimizer state/ { print "adam=" $3 " " $4 }
    /sharded gradients/ { print "grads=" $3 " " $4 }
    /forward \+ backward, above/ { print "above=" $5 " " $6 }
    /held after each block/ { sub(/.*forward: /, ""); print "blocks=" $0 }
    /predicted peak/ { print "peak=" $3 " " $4 }
    /^  dp_shard / { print "counts=" $3 " / " $5 " / " $7; print "sent=" $8 " " $9; print "ring=" $11 " " $12 }
    /ZeRO-3.s estimate/ { print "zero3=" $(NF-4) " " $(NF-3) }')
done
# tessera-train's summary line counts as nanoGPT does, without the position
# embeddings (seq_len x n_embd of the default configuration): say both.
config=$("${1:-build}/tools/tessera-train" --print-config)
seq_len=$(sed -n 's/^seq_len = //p' <<< "$config")
n_embd=$(sed -n 's/^n_embd = //p' <<< "$config")
echo "The default model has ${v[1,params]} parameters (12.4 MiB in f32; tessera-train's summary line says" \
  "$(( ${v[1,params]} - seq_len * n_embd )), leaving out the position embeddings as nanoGPT does); batch 16 x $seq_len tokens per step."
echo
echo "| per rank | 1 rank | 2 ranks | 4 ranks |"
echo "|---|---|---|---|"
echo "| sequences per rank | ${v[1,micro]} | ${v[2,micro]} | ${v[4,micro]} |"
echo "| parameters (its shards) | ${v[1,shards]} | ${v[2,shards]} | ${v[4,shards]} |"
echo "| AdamW's two moments | ${v[1,adam]} | ${v[2,adam]} | ${v[4,adam]} |"
echo "| gradients (its shards) | ${v[1,grads]} | ${v[2,grads]} | ${v[4,grads]} |"
echo "| forward + backward, above the parameters and moments | ${v[1,above]} | ${v[2,above]} | ${v[4,above]} |"
echo "| held after each block's forward (above what was held before it) | ${v[1,blocks]} | ${v[2,blocks]} | ${v[4,blocks]} |"
echo "| **peak** (predicted = measured) | **${v[1,peak]}** | **${v[2,peak]}** | **${v[4,peak]}** |"
echo "| all-gather / reduce-scatter / all-reduce per step | ${v[1,counts]} (a group of one: no communication) | ${v[2,counts]} | ${v[4,counts]} |"
echo "| bytes handed to MPI per step | ${v[1,sent]} | ${v[2,sent]} | ${v[4,sent]} |"
echo "| bytes a ring algorithm sends per rank, for those collectives | ${v[1,ring]} | ${v[2,ring]} | ${v[4,ring]} |"
echo "| ZeRO-3's estimate, every parameter gathered twice: (W-1)/W x params x 12 | ${v[1,zero3]} | ${v[2,zero3]} | ${v[4,zero3]} |"
