#!/usr/bin/env bash
# CI: prove csrc/ compiles on a machine without a GPU, and leave fastawq installed (with _C: the
# CUDA kernels and the CPU kernels of csrc/cpu/) in the environment of the `python` on PATH (a
# CUDA build of torch must be installed there). FASTAWQ_BUILD_KERNELS=cpu builds the CPU kernels
# alone (what a machine without nvcc gets with the default `auto`).
# Archs: 8.0 covers every *_sm80 source and the generic ones, 9.0a the Hopper-only ones.
# About 3-4 minutes on 2 cores. Any compile error fails the script (and prints the compiler output).
set -euo pipefail
cd "$(dirname "$0")/.."
export FASTAWQ_BUILD_KERNELS="${FASTAWQ_BUILD_KERNELS:-on}"
export FASTAWQ_CUDA_ARCHS="${FASTAWQ_CUDA_ARCHS:-8.0;9.0a}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
log=$(mktemp)
start=$(date +%s)
if ! python -m pip install --no-build-isolation --no-deps -v . >"$log" 2>&1; then
  echo "ci_compile: building fastawq._C failed; compiler output:" >&2
  grep -E -B2 -A8 "error|FAILED" "$log" | head -200 >&2 || tail -100 "$log" >&2
  exit 1
fi
[ "$FASTAWQ_BUILD_KERNELS" = cpu ] && archs="none" || archs="$FASTAWQ_CUDA_ARCHS"
echo "ci_compile: built and installed in $(( $(date +%s) - start )) s (FASTAWQ_BUILD_KERNELS=${FASTAWQ_BUILD_KERNELS}, CUDA archs ${archs})"
cd /   # import the installed package, not the source tree
python - <<'PY'
from fastawq import _ext
status = _ext.status()
assert status["loaded"], f"fastawq._C did not load after the build: {status}"
import os
import torch
mode = os.environ["FASTAWQ_BUILD_KERNELS"]
ops = ("awq_cpu_repack", "awq_cpu_gemm", "awq_cpu_isas")
if mode == "on":
    ops += ("awq_dequantize", "awq_gemm", "awq_gemm_declines", "awq_gemv_packed", "awq_mma_packed", "awq_gemm_packed", "awq_wgmma_packed", "moe_gemv_w4", "moe_mma_w4", "moe_mma_packed_w4", "moe_gemv_packed_w4", "moe_gemv_packed_w4_sums", "decode_attention",
            "decode_attention_out")
if mode == "cpu":
    assert not hasattr(torch.ops.fastawq, "awq_gemm") and not status["archs"], "a CPU-only build holds CUDA code"
missing = [op for op in ops if not hasattr(torch.ops.fastawq, op)]
assert not missing, f"ops not registered: {missing}"
if mode == "on":  # the fit rules need no GPU
    assert torch.ops.fastawq.awq_gemm_declines("gemv", 1, 4096, 4096, 128) == ""
isas = list(torch.ops.fastawq.awq_cpu_isas())
print(f"ci_compile: fastawq._C loads (archs {status['archs']}, torch {status['built_torch']}; CPU kernels {isas})")
PY
