#!/usr/bin/env bash
# The main job on a fresh machine: make a venv, install fastawq, run `fastawq demo`.
#   scripts/demo.sh [fastawq demo options]      e.g. --calib-samples 64
# FASTAWQ_VENV picks the venv (default: ~/.cache/fastawq/venv, outside the repository); one that
# already has torch is reused, so the second run starts at once. Needs PyPI, nothing else.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FASTAWQ_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/fastawq/venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "== installing torch"
    "$VENV/bin/python" -m pip install -q torch
fi
if ! "$VENV/bin/python" -c "import fastawq.commands.demo, gguf, accelerate" 2>/dev/null; then
    # Build fastawq._C against this venv's torch: the CPU kernels always, the CUDA ones only when
    # torch sees a GPU (a CPU-only machine need not spend minutes compiling them). If the build
    # fails (no C++ compiler, say), install the pure-Python package: Triton/torch kernels serve.
    if [ -z "${FASTAWQ_BUILD_KERNELS:-}" ]; then
        if "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
            export FASTAWQ_BUILD_KERNELS=auto
        else
            export FASTAWQ_BUILD_KERNELS=cpu
        fi
    fi
    echo "== installing fastawq (kernels: $FASTAWQ_BUILD_KERNELS; with the GGUF reader for the default model)"
    "$VENV/bin/python" -m pip install -q scikit-build-core cmake ninja
    if ! "$VENV/bin/python" -m pip install -q --no-build-isolation "$ROOT[gguf]"; then
        echo "== building fastawq's kernels failed; installing without them"
        FASTAWQ_BUILD_KERNELS=off "$VENV/bin/python" -m pip install -q "$ROOT[gguf]"
    fi
fi
echo "== fastawq demo $*"
exec "$VENV/bin/fastawq" demo "$@"
