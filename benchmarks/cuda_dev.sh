#!/usr/bin/env bash
# One device call: build the extension editable, run the GPU tests, time the kernels.
#   run: bash benchmarks/cuda_dev.sh [tests|bench|all] [extra bench args...]
# Logs go to $OUT (or ./cuda_dev_out). Build dir build/ persists between calls on a warm machine.
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/cuda_dev_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FASTAWQ_BUILD_KERNELS=on FASTAWQ_CUDA_ARCHS=${FASTAWQ_CUDA_ARCHS:-9.0a}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv > "$OUT/gpu.txt" 2>&1
start=$(date +%s)
if ! pip install --no-build-isolation --no-deps -e . -Cbuild.verbose=true > "$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40; tail -40 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
python -c "from fastawq import _ext; print(_ext.status())"
rc=0
if [[ $what == tests || $what == all ]]; then
  python -m pytest tests/test_cuda_ops.py tests/test_build.py -q -x --durations=5 -p no:cacheprovider \
    > "$OUT/tests.log" 2>&1 || rc=1
  tail -15 "$OUT/tests.log"
fi
if [[ $what == bench || $what == all ]]; then
  python benchmarks/bench_cuda.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
exit $rc
