"""`fastawq env`: versions, the compiled extension's state, and the backend each op would use."""
from __future__ import annotations

import os
import platform

import torch

import fastawq
from fastawq import _ext, backend

# Every op of fastawq.ops that dispatches (prefill attention is plain SDPA).
OPS = ("awq_gemm", "awq_dequantize", "packed_gemm", "packed_dequantize", "add_rms_norm", "act_mul", "rope_kv_cache",
       "decode_attention")


def collect() -> list[tuple[str, str]]:
    rows = [
        ("fastawq", fastawq.__version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("torch CUDA", str(torch.version.cuda)),
    ]
    try:
        import triton

        rows.append(("triton", triton.__version__ + (" (interpreter)" if backend.triton_interpreting() else "")))
    except ImportError:
        rows.append(("triton", "not installed"))
    st = _ext.status()
    rows.append(("compiled kernels (_C)", "loaded" if st["loaded"] else f"not loaded: {st['reason']}"))
    rows.append(("compiled CUDA archs", ", ".join(st["archs"]) or ("none (CPU-only build)" if st["loaded"] else "-")))
    from fastawq import cpu

    why = cpu.fast_kernel_available()
    rows.append(("CPU kernel (fastawq)", ", ".join(cpu.fast_kernel_isas()) if why is None else f"absent: {why}"))
    if why is None:
        try:
            act = "int8 (AVX2 integer dots)" if cpu.act_isa() == "int8" else "exact"
        except ValueError as e:
            act = f"invalid: {e}"
        rows.append(("CPU activation mode", f"{act}; FASTAWQ_CPU_ACT={os.environ.get('FASTAWQ_CPU_ACT', '') or 'auto'}"))
    why = cpu.kernel_available()
    rows.append(("CPU kernel (torch int4)", "present" if why is None else f"absent: {why}"))
    rows.append(("CPU kernel preference", ", ".join(cpu.preference())))
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            dev = torch.device("cuda", i)
            cap = ".".join(map(str, torch.cuda.get_device_capability(dev)))
            rows.append((f"{dev}", f"{torch.cuda.get_device_name(dev)} (sm {cap})"))
            devices.append(dev)
    else:
        rows.append(("GPU", "none visible"))
    for dev in devices:
        for op, be in backend.report(dev, OPS).items():
            rows.append((f"{op} on {dev.type}", be))
    return rows


def run(args) -> int:
    rows = collect()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="versions, compiled kernels, and the backend each op would use here")
    p.set_defaults(func=run)
