#!/usr/bin/env bash
# Runs the PyTorch CPU peer (scaled_dot_product_attention) and writes JSON rows to OUT_DIR.
# Usage: bench/peers/run_torch_cpu.sh OUT_DIR [extra args for torch_cpu.py]
# Makes its own virtual environment in bench/peers/.venv (git-ignored) on first use.
# PyPI has no CPU-only Linux torch wheel (the CPU wheels live on a separate index this
# workplace cannot reach), so the default wheel is installed, with its CUDA dependencies.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, numpy" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet torch numpy
fi
exec "$venv/bin/python" "$here/torch_cpu.py" "$@"
