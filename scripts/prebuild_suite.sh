#!/usr/bin/env bash
# Builds fastawq._C on this (CPU-only) machine against the device machine's torch, into
# build/prebuilt/{_C.so,_build_info.py}, for benchmarks/gpu_suite.sh's build stage to load instead
# of compiling on a cold device machine (~2 min of its time). Send it with the call:
#   run(command="bash benchmarks/gpu_suite.sh build ...", carry=["build/prebuilt"])
# The suite checks that it loads and holds the ops there (the torch pin of fastawq._ext included)
# and builds as before where it does not.
#
#   bash scripts/prebuild_suite.sh [TORCH_VERSION (default 2.11.0)] [CUDA archs (default 9.0a)]
#
# Needs nvcc (13.x) on the PATH and PyPI (torch and its CUDA wheels, ~3 GB, into a private venv
# under build/). The module is named plain `_C.so`: Python imports that name on any version, and _C uses
# only PyModule_Create, whose ABI the CPython versions share, so a build with this machine's Python
# loads under the device's.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=${1:-2.11.0}
archs=${2:-9.0a}
venv=build/prebuild-venv-$torch_version
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  python3 -m venv "$venv"
  # torch with its CUDA wheels (~3 GB): the build imports torch, and ATen's CUDA headers that a bare
  # toolkit lacks come from those wheels.
  "$venv/bin/pip" install -q "torch==$torch_version" numpy cmake ninja
fi
want=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
bdir=build/prebuild-$want
export FASTAWQ_CUDA_ARCHS=$archs FASTAWQ_BUILD_KERNELS=on
[[ -x /usr/bin/g++ ]] && export FASTAWQ_HOST_CXX=${FASTAWQ_HOST_CXX:-/usr/bin/g++}
PATH="$PWD/$venv/bin:$PATH" cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$PWD/$venv/bin/python"
PATH="$PWD/$venv/bin:$PATH" cmake --build "$bdir" -j "$(nproc)"
mkdir -p build/prebuilt
cp "$bdir"/_C*.so build/prebuilt/_C.so
cp "$bdir"/_build_info.py build/prebuilt/_build_info.py
# What it was built from: the suite builds instead where csrc/ or CMakeLists.txt differ.
bash benchmarks/gpu_suite.sh --sources-hash > build/prebuilt/SOURCES
strip --strip-debug build/prebuilt/_C.so 2>/dev/null || true
echo "build/prebuilt: _C.so $(du -h build/prebuilt/_C.so | cut -f1) for torch $want, archs $archs"
