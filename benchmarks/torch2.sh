#!/usr/bin/env bash
# Prints the python of a PyTorch 2.x for the side-by-side comparisons,
# installing it on demand: a virtual environment at $TORCH2_VENV (default
# /opt/torch2) with torch from PyPI. PyPI's Linux wheel brings its CUDA
# libraries (about 5 GB), so only the benchmark scripts call this, never CI.
#   python=$(benchmarks/torch2.sh)   # exits non-zero when it cannot install
set -eu
venv=${TORCH2_VENV:-/opt/torch2}
is_torch2() { "$venv/bin/python" -c 'import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null; }
if ! is_torch2; then
  echo "installing PyTorch 2.x from PyPI into $venv (once; about 5 GB)" >&2
  python3 -m venv "$venv" >&2
  # The venv's own pip may predate torch's wheels (pip 23.2 fails resolving them).
  "$venv/bin/pip" install --quiet --upgrade pip >&2
  "$venv/bin/pip" install --quiet torch numpy >&2
  is_torch2 || { echo "no PyTorch 2.x in $venv after installing" >&2; exit 1; }
fi
echo "$venv/bin/python"
