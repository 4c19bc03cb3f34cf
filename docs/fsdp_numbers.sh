#!/usr/bin/env bash
# Prints the table of docs/fsdp-pictures.md (between its numbers
# markers): per rank and step of the default model (4 blocks, d=256, batch
# 16 x 128), the collectives each FSDP setting issues and the peak bytes held
# in tensors, from tessera-plan (whose counts and peaks the plan tests check
# against real runs, byte for byte). The test `docs-numbers` runs this and
# compares it with the document, so the figures there cannot drift; it runs
# on every CPU kind (and again under TESSERA_CPU_ISA=baseline), so nothing
# here may depend on the CPU it runs on.
#   docs/fsdp_numbers.sh [BUILD]
set -euo pipefail
# Planned on the baseline copy's libraries, the same on every CPU (docs/cpu.md).
export TESSERA_CPU_ISA=baseline
plan=${1:-build}/tools/tessera-plan
row() {  # LABEL RANKS ARGS...
  local label=$1 ranks=$2; shift 2
  "$plan" --preset default --ranks "$ranks" "$@" | awk -v label="$label" '
    /predicted peak/ { peak = $3 " " $4 }
    /^  (dp_shard|dp_replicate|world) / { c[$1] = sprintf("%s / %s / %s", $3, $5, $7); s[$1] = $8 " " $9; ar[$1] = $7 }
    END {
      ag = c["dp_shard"]; sent = s["dp_shard"]
      if ("dp_replicate" in c) {
        ag = ag " in the pair, " c["dp_replicate"] " across replicas, " ar["world"] " all-reduce over all"
        sent = sent " + " s["dp_replicate"]
      }
      printf "| %s | %s | %s | %s |\n", label, ag, sent, peak
    }'
}
echo "| run (default model) | all-gather / reduce-scatter / all-reduce per step | bytes handed to MPI per rank | peak per rank |"
echo "|---|---|---|---|"
row "FSDP, 2 ranks (prefetch on, reshard after forward)" 2
row "FSDP, 2 ranks, \`parallelism.prefetch false\`" 2 --parallelism.prefetch false
row "FSDP, 2 ranks, \`reshard_after_forward false\` (ZeRO-2)" 2 --parallelism.reshard_after_forward false
# bf16 products run in bf16 on CPUs whose oneDNN has bf16 kernels
# (AVX512-BF16 or AMX; on AMX Tessera's own kernel packs the operands of the
# wide products) and on AVX2 ones (Tessera's f32 kernel packs them widened to
# f32, a row block of A per thread: planned at one thread per rank); on f32
# copies elsewhere, which raise the peak. All four rows are planned
# explicitly, so the table is the same on every CPU.
row "FSDP, 2 ranks, bf16 parameters, f32 reduction (bf16 products: AVX512-BF16)" 2 \
  --mixed_precision.param_dtype bfloat16 --bf16-products native
row "FSDP, 2 ranks, bf16 parameters, f32 reduction (bf16 products: AMX)" 2 \
  --mixed_precision.param_dtype bfloat16 --bf16-products amx
OMP_NUM_THREADS=1 row "FSDP, 2 ranks, bf16 parameters, f32 reduction (bf16 products: Tessera's f32 kernel, AVX2 CPUs)" 2 \
  --mixed_precision.param_dtype bfloat16 --bf16-products own
row "FSDP, 2 ranks, bf16 parameters, f32 reduction (products on f32 copies: CPUs without AVX2)" 2 \
  --mixed_precision.param_dtype bfloat16 --bf16-products f32
row "FSDP, 2 ranks, activation checkpointing (\`full\`)" 2 --activation_checkpoint.mode full
row "FSDP, 4 ranks" 4
row "HSDP, 4 ranks: 2 replicas x 2 shards" 4 --parallelism.data_parallel_replicate_degree 2
