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
# pip + scikit-build-core first (the supported way); if the image's pip cannot load the backend,
# build with CMake directly into build/dev and run from a copy of the sources with _C beside them.
if pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  echo "build (pip -e): $(( $(date +%s) - start )) s"
else
  python -c "import scikit_build_core, sys; print('skbuild', scikit_build_core.__version__, sys.executable); import scikit_build_core.build" \
    > "$OUT/skbuild_diag.txt" 2>&1; tail -3 "$OUT/skbuild_diag.txt"
  { cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python)" \
      && cmake --build build/dev -j 16; } > "$OUT/build.log" 2>&1 \
    || { grep -E -A5 "error|Error" "$OUT/build.log" | head -60; exit 1; }
  rm -rf /tmp/fastawq_src && mkdir -p /tmp/fastawq_src && cp -r python/fastawq /tmp/fastawq_src/ \
    && cp -r triton_kernels /tmp/fastawq_src/fastawq/triton_kernels \
    && cp build/dev/_C*.so build/dev/_build_info.py /tmp/fastawq_src/fastawq/
  export PYTHONPATH=/tmp/fastawq_src
  echo "build (cmake): $(( $(date +%s) - start )) s"
fi
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
