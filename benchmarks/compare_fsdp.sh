#!/usr/bin/env bash
# Tessera FSDP2 (and its DDP-style baseline) vs PyTorch on the same GPT and
# ranks, side by side in one run: W = 1, 2, 4 ranks on this machine.
#   benchmarks/compare_fsdp.sh [build-dir] [steps]
# PyTorch is optional: FSDP2 from a PyTorch 2.x at $TORCH2 (a venv's python,
# default /opt/torch2/bin/python), DDP from Debian's python3-torch.
set -u
build=${1:-build}
steps=${2:-10}
here=$(dirname "$0")
torch2=${TORCH2:-/opt/torch2/bin/python}
mpi="mpirun --oversubscribe --allow-run-as-root --bind-to none"
# Starts W copies of a torch script with the env torch.distributed expects
# (Debian's torch 1.13 launcher fails under Python 3.11).
spawn() {
  local py=$1 w=$2; shift 2
  for r in $(seq 0 $((w - 1))); do
    RANK=$r WORLD_SIZE=$w LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29600 + w)) "$py" "$@" 2>/dev/null &
  done
  wait
}
for w in 1 2 4; do
  threads=$(( 2 / w )); [ "$threads" -lt 1 ] && threads=1
  echo "=== $w rank(s), $threads thread(s) each"
  OMP_NUM_THREADS=$threads $mpi -np "$w" -x OMP_NUM_THREADS "$build/benchmarks/bench_fsdp" "$steps" | tail -n +2
  if [ -x "$torch2" ] && "$torch2" -c "import torch" 2>/dev/null; then
    spawn "$torch2" "$w" "$here/torch_fsdp.py" "$steps" fsdp | grep '^torch'
    spawn "$torch2" "$w" "$here/torch_fsdp.py" "$steps" ddp | grep '^torch'
  fi
  if /usr/bin/python3 -c "import torch" 2>/dev/null; then
    spawn /usr/bin/python3 "$w" "$here/torch_fsdp.py" "$steps" ddp | grep '^torch'
  fi
done
