#!/usr/bin/env bash
# The GPU suite: build, GPU tests, benchmarks, in one call on the H200 (device tool).
#   bash benchmarks/gpu_suite.sh [stage ...]      stages: build tests gemm e2e quantize (default: all)
# Writes logs and JSON under $OUT (default ./out). Needs no network: installs with --no-deps.
# FASTAWQ_SUITE_INSTALL=copy skips the CMake build and runs the Python sources from a copy
# (Triton/torch backends only), for quick kernel iterations.
# One device call may run 10 minutes: all stages together take longer, so split them over calls
# on the warm machine (the CMake build dir stays there): `build tests`, then `build gemm`, then
# `build e2e quantize`. Triton tunes each (M bucket, shape) on first use: ~1-2 min in `gemm`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-build tests gemm e2e quantize}
status=0
step() { echo "=== $1 ($(date +%T))"; }

if [[ " $stages " == *" build "* ]]; then
  step build
  if [ "${FASTAWQ_SUITE_INSTALL:-pip}" = copy ]; then
    rm -rf /tmp/fastawq_src && mkdir -p /tmp/fastawq_src && cp -r python/fastawq /tmp/fastawq_src/ \
      && cp -r triton_kernels /tmp/fastawq_src/fastawq/triton_kernels
    export PYTHONPATH=/tmp/fastawq_src
  else
    # The device image may lack scikit-build-core: build _C with CMake directly and lay the
    # package out as the wheel would (sources + _C + _build_info) on PYTHONPATH.
    export FASTAWQ_CUDA_ARCHS=${FASTAWQ_CUDA_ARCHS:-9.0a} FASTAWQ_BUILD_KERNELS=on
    # The image's default $CXX builds a _C whose exceptions crash (benchmarks/CUDA_NOTES.md).
    [[ -x /usr/bin/g++ ]] && export FASTAWQ_HOST_CXX=${FASTAWQ_HOST_CXX:-/usr/bin/g++}
    bdir=build/suite
    { cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python)" \
        && cmake --build "$bdir" -j "$(nproc)"; } > "$OUT/build.log" 2>&1 \
      || { echo "build failed"; grep -E -A5 "error|Error" "$OUT/build.log" | head -60; exit 1; }
    rm -rf /tmp/fastawq_src && mkdir -p /tmp/fastawq_src && cp -r python/fastawq /tmp/fastawq_src/ \
      && cp -r triton_kernels /tmp/fastawq_src/fastawq/triton_kernels \
      && cp "$bdir"/_C*.so "$bdir"/_build_info.py /tmp/fastawq_src/fastawq/
    export PYTHONPATH=/tmp/fastawq_src
  fi
  python -m fastawq env | tee "$OUT/env.txt"
fi
if [[ " $stages " == *" tests "* ]]; then
  step tests
  python -m pytest -q -x -p no:cacheprovider ${FASTAWQ_SUITE_TESTS:-tests} -m "not slow" 2>&1 | tail -25 | tee "$OUT/tests.log" || status=1
fi
if [[ " $stages " == *" gemm "* ]]; then
  step gemm
  python benchmarks/gemm_table.py --out "$OUT" ${FASTAWQ_SUITE_GEMM_ARGS:-} 2>&1 | tee "$OUT/gemm_table.md" || status=1
fi
if [[ " $stages " == *" e2e "* ]] && [ -f benchmarks/bench_e2e.py ]; then
  step e2e
  python benchmarks/bench_e2e.py --out "$OUT" 2>&1 | tee "$OUT/e2e.log" || status=1
fi
if [[ " $stages " == *" quantize "* ]] && [ -f benchmarks/bench_quantize.py ]; then
  step quantize
  python benchmarks/bench_quantize.py --shape llama-3-8b --json "$OUT/bench_quantize.json" 2>&1 | tee "$OUT/quantize.log" || status=1
fi
step done
exit $status
