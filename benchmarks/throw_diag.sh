#!/usr/bin/env bash
# Diagnose C++ exceptions from _C crashing the interpreter on the device image (see CUDA_NOTES.md).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export FASTAWQ_BUILD_KERNELS=on FASTAWQ_CUDA_ARCHS=9.0a
cmake -S . -B build/diag -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python)" > "$OUT/diag_build.log" 2>&1 && cmake --build build/diag -j 16 >> "$OUT/diag_build.log" 2>&1 || { tail -30 "$OUT/diag_build.log"; exit 1; }
mkdir -p /tmp/src && cp -r python/fastawq /tmp/src/ && cp build/diag/_C*.so build/diag/_build_info.py /tmp/src/fastawq/
cat > /tmp/smoke.py <<'PY'
import torch
from fastawq import _ext
print(_ext.status(), flush=True)
qw = torch.zeros(256, 16, dtype=torch.int32, device="cuda"); qz = torch.zeros(4, 16, dtype=torch.int32, device="cuda")
s = torch.ones(4, 128, dtype=torch.float16, device="cuda")
try:
    torch.ops.fastawq.awq_gemm(torch.ones(2, 256, device="cuda"), qw, s, qz, 64, None)
except RuntimeError as e:
    print("throw ok:", str(e).splitlines()[0])
PY
echo "== env: CXX=${CXX:-} LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; ldd build/diag/_C*.so | grep -E "gcc|stdc|cuda"
echo "== smoke"; PYTHONPATH=/tmp/src python /tmp/smoke.py 2>&1 | tail -3
echo "== smoke, TORCH_SHOW_CPP_STACKTRACES=0 TORCH_DISABLE_ADDR2LINE=1"; TORCH_DISABLE_ADDR2LINE=1 PYTHONPATH=/tmp/src python /tmp/smoke.py 2>&1 | tail -2
echo "== tiny extension, load_inline"
python - <<'PY' 2>&1 | tail -3
import torch, torch.utils.cpp_extension as ce
src = 'at::Tensor boom(at::Tensor x) { TORCH_CHECK(false, "boom"); return x; }'
m = ce.load_inline("boomext", cpp_sources=[src], functions=["boom"], verbose=False)
try: m.boom(torch.ones(2))
except RuntimeError as e: print("inline throw ok")
PY
echo "== cuda-gdb backtrace"
PYTHONPATH=/tmp/src timeout 120 cuda-gdb -batch -ex run -ex bt --args python /tmp/smoke.py 2>&1 | grep -E "^#|signal" | head -30
