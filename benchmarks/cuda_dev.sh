#!/usr/bin/env bash
# One device call: build the extension, run the GPU tests, time the kernels.
#   bash benchmarks/cuda_dev.sh [tests|bench|all] [extra bench_cuda.py args...]
# Logs go to $OUT (or ./cuda_dev_out). Env: FASTAWQ_CUDA_ARCHS (default 9.0a), FASTAWQ_HOST_CXX
# picks the host compiler, DEV_PIP=1 installs editable with pip (else CMake into build/dev + a copy).
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/cuda_dev_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FASTAWQ_BUILD_KERNELS=on FASTAWQ_CUDA_ARCHS=${FASTAWQ_CUDA_ARCHS:-9.0a}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv > "$OUT/gpu.txt" 2>&1
start=$(date +%s)
# The image's $CXX (/opt/gcc) builds a _C whose std::ostream crashes; use the system compiler.
[[ -x /usr/bin/g++ ]] && export FASTAWQ_HOST_CXX=${FASTAWQ_HOST_CXX:-/usr/bin/g++}
bdir=build/dev-$(basename "${FASTAWQ_HOST_CXX:-${CXX:-default}}")
if [[ ${DEV_PIP:-0} == 1 ]]; then
  # `pip` on PATH may belong to another interpreter than `python`: always `python -m pip`.
  python -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { grep -E -A5 "error|Error" "$OUT/build.log" | head -60; exit 1; }
else
  { cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python)" \
      && cmake --build "$bdir" -j 16; } > "$OUT/build.log" 2>&1 \
    || { grep -E -A5 "error|Error" "$OUT/build.log" | head -60; exit 1; }
  rm -rf /tmp/fastawq_src && mkdir -p /tmp/fastawq_src && cp -r python/fastawq /tmp/fastawq_src/ \
    && cp -r triton_kernels /tmp/fastawq_src/fastawq/triton_kernels \
    && cp "$bdir"/_C*.so "$bdir"/_build_info.py /tmp/fastawq_src/fastawq/
  export PYTHONPATH=/tmp/fastawq_src
fi
echo "build ($bdir): $(( $(date +%s) - start )) s; $(grep -m1 'CXX compiler identification' "$OUT/build.log")"
# A TORCH_CHECK thrown from _C must reach Python as RuntimeError (not crash the interpreter).
python - <<'PY'
import torch
from fastawq import _ext
print(_ext.status())
qw = torch.zeros(256, 16, dtype=torch.int32, device="cuda"); qz = torch.zeros(4, 16, dtype=torch.int32, device="cuda")
s = torch.ones(4, 128, dtype=torch.float16, device="cuda")
try:
    torch.ops.fastawq.awq_gemm(torch.ones(2, 256, device="cuda"), qw, s, qz, 64, None)
except RuntimeError as e:
    print("throw ok:", str(e).splitlines()[0])
PY
[[ $? == 0 ]] || { echo "THROW CRASHED"; exit 2; }
rc=0
if [[ $what == tests || $what == all ]]; then
  python -m pytest tests/test_cuda_ops.py tests/test_build.py -q -x --durations=5 -p no:cacheprovider ${DEV_PYTEST_K:+-k "$DEV_PYTEST_K"} \
    > "$OUT/tests.log" 2>&1 || rc=1
  tail -12 "$OUT/tests.log"
fi
if [[ $what == bench || $what == all ]]; then
  python benchmarks/bench_cuda.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -45
fi
exit $rc
