#!/usr/bin/env bash
# CI: build the CPU-kernels wheel (scripts/build_wheels.py --cpu), install it with --no-deps into a
# fresh folder (its dependencies are the CI venv's own: torch, transformers, ...), and from there:
# `fastawq env`, one awq_gemm on the wheel's compiled CPU kernel against reference.py, and the
# shipped default calibration data. The build folder persists (build/wheel-*), so a rerun only
# relinks; a first build compiles csrc/cpu/ (about a minute on 2 free cores).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
python scripts/build_wheels.py --cpu --out "$work/dist" >"$work/build.log" 2>&1 || {
  tail -60 "$work/build.log" >&2; echo "ci_wheel_smoke: wheel build failed" >&2; exit 1; }
wheel=$(ls "$work"/dist/fastawq-*+torch*.cpu-*.whl)
echo "ci_wheel_smoke: built $(basename "$wheel") in $(( $(date +%s) - start )) s"
python -m pip install -q --no-deps --no-compile --target "$work/site" "$wheel"
cd "$work"   # away from the source tree: only the installed wheel can be imported
PYTHONPATH="$work/site" python -m fastawq env
PYTHONPATH="$work/site" WHEEL_SITE="$work/site" python - <<'PY'
import os
from importlib.metadata import distribution

import torch

import fastawq
from fastawq import _ext, cpu, ops, reference
from fastawq.calib import get_calib_dataset

site = os.environ["WHEEL_SITE"]
assert fastawq.__file__.startswith(site), f"imported {fastawq.__file__}, not the wheel in {site}"
dist = distribution("fastawq")
assert "+torch" in dist.version and dist.version.endswith(".cpu"), dist.version
pin = [r for r in dist.requires or [] if r.replace(" ", "").startswith("torch==")]
assert pin == [f"torch=={torch.__version__.split('+')[0]}"], (pin, torch.__version__)
assert _ext.status()["loaded"], _ext.status()
assert cpu.fast_kernel_available() is None, cpu.fast_kernel_available()

torch.manual_seed(0)
k, n, g, m = 256, 72, 64, 5
w = torch.randn(n, k)
qweight, scales, qzeros = reference.quantize_awq(w, g, dtype=torch.float32)
x = torch.randn(m, k)
ref = reference.awq_gemm(x, qweight, scales, qzeros, g)
# The exact kernels (FASTAWQ_CPU_ACT=exact) to fp32 accuracy; the default mode (int8 activations
# on AVX2-only CPUs) to the activations' int8 rounding.
os.environ["FASTAWQ_CPU_ACT"] = "exact"
out = ops.awq_gemm(x, qweight, scales, qzeros, g, backend="cpu")
err = (out - ref).abs().max().item()
assert torch.isfinite(out).all() and err <= 1e-3 * ref.abs().max().item(), err
del os.environ["FASTAWQ_CPU_ACT"]
out = ops.awq_gemm(x, qweight, scales, qzeros, g, backend="cpu")
rel = ((out - ref).norm() / ref.norm()).item()
assert torch.isfinite(out).all() and rel < 2e-2, (cpu.act_isa(), rel)


class Chars:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % 100 for c in text]}


blocks = get_calib_dataset(None, Chars(), n_samples=8, max_seq_len=256)
assert tuple(blocks.shape) == (8, 256)
print(f"ci_wheel_smoke: fastawq {dist.version} from the wheel: awq_gemm on the compiled CPU kernel "
      f"matches reference.py (max err {err:.2e}); default calibration data loads")
PY
echo "ci_wheel_smoke: ok in $(( $(date +%s) - start )) s"
