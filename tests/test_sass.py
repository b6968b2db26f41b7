"""The compiled kernels' SASS against a known ptxas miscompile (CPU only: reads the built _C).

ptxas 13.x can drop the `createpolicy` that feeds a `cp.async ... L2::cache_hint` and keep the copy,
which then reads a uniform register nothing wrote as its memory descriptor (`desc[URn]`): the GPU
traps with cudaErrorIllegalInstruction, on some shapes only (awq_gemm_packed's cp.async ring hit
it in session 13; benchmarks/CUDA_NOTES.md, session 14). Every memory instruction's descriptor
register must be written somewhere in its function.

A wgmma (HGMMA) names its descriptors by the first of four uniform registers, gdesc[URn]: URn:URn+1
hold A's shared-memory descriptor and URn+2:URn+3 B's. With A in registers (HGMMA Rd, Ra, gdesc[URn],
...; awq_wgmma_packed) only B's pair is read, so only URn+2 must be written (ptxas leaves URn as it
finds it: in session 22's warp-specialized form nothing else happened to write it).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

_INSTR = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s*(.*?)\s*;")
_OP = re.compile(r"^(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)\s*(.*)$")
_DESC = re.compile(r"(?<!g)desc\[UR(\d+)\]")
_GDESC = re.compile(r"gdesc\[UR(\d+)\]")


def undefined_descriptors(sass: str) -> dict[str, list[int]]:
    """{function: uniform registers used as desc[URn] and written nowhere in that function}."""
    bad: dict[str, list[int]] = {}
    name, body = None, []

    def close():
        if name is None:
            return
        written: set[int] = set()
        used: set[int] = set()
        for instr in body:
            m = _OP.match(instr)
            if m is None:
                continue
            opcode, args = m.groups()
            dest = args.split(",")[0].strip()
            if re.fullmatch(r"UR\d+", dest):
                r = int(dest[2:])
                written.add(r)
                if ".64" in opcode:
                    written.add(r + 1)
            used.update(int(d) for d in _DESC.findall(args))
            for d in _GDESC.findall(args):  # a wgmma's descriptors: A's pair at URn, B's at URn + 2
                operands = [a.strip() for a in args.split(",")]
                a_in_registers = len(operands) > 1 and re.fullmatch(r"R\d+", operands[1]) is not None
                used.update({int(d) + 2} if a_in_registers else {int(d), int(d) + 2})
        missing = sorted(used - written)
        if missing:
            bad[name] = missing

    for line in sass.splitlines():
        if "Function :" in line:
            close()
            name, body = line.split("Function :", 1)[1].strip(), []
            continue
        m = _INSTR.match(line)
        if m is not None and name is not None:
            body.append(m.group(1))
    close()
    return bad


# A trimmed excerpt of the miscompiled kernel (cuobjdump -sass of session 13's cp.async ring):
# UR8/UR9 hold the policy for the prologue's copies, the loop's copy reads UR1, never written.
_MISCOMPILED = """
\tFunction : ring_kernel
        /*0180*/                   UMOV UR8, 0xf0 ;                      /* 0x000000f000087882 */
        /*0190*/                   UMOV UR9, 0x120 ;                     /* 0x0000012000097882 */
        /*01a0*/                   ULDC.64 UR4, c[0x0][0x208] ;          /* 0x0000820000047ab9 */
        /*01b0*/              @!P1 LDGSTS.E.BYPASS.128 [R90], desc[UR8][R96.64], !P3 ;   /* 0x0 */
        /*01c0*/                   LDG.E R2, desc[UR4][R2.64] ;          /* 0x0 */
        /*01d0*/                   LDGSTS.E.BYPASS.128 [R90+UR0], desc[UR1][R96.64], !P0 ;  /* 0x0 */
\tFunction : fine_kernel
        /*0000*/                   ULDC.64 UR4, c[0x0][0x208] ;          /* 0x0 */
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;      /* 0x0 */
        /*0020*/                   STG.E desc[UR4][R6.64], R4 ;          /* 0x0 */
"""


def test_checker_finds_the_unset_descriptor():
    assert undefined_descriptors(_MISCOMPILED) == {"ring_kernel": [1]}


# wgmma with A in registers reads only B's descriptor pair (URn+2:URn+3) of gdesc[URn]; with A from
# shared memory both pairs.
_WGMMA = """
	Function : b_only
        /*0010*/                   UMOV UR19, 0x8 ;                      /* 0x0 */
        /*0020*/                   UMOV UR18, UR4 ;                      /* 0x0 */
        /*0030*/                   HGMMA.64x32x16.F32 R24, R56, gdesc[UR16], R24 ;   /* 0x0 */
	Function : b_unset
        /*0010*/                   UMOV UR7, 0x8 ;                       /* 0x0 */
        /*0030*/                   HGMMA.64x32x16.F32 R24, R56, gdesc[UR4], R24 ;    /* 0x0 */
	Function : a_from_smem
        /*0010*/                   UMOV UR10, UR4 ;                      /* 0x0 */
        /*0020*/                   UMOV UR11, 0x8 ;                      /* 0x0 */
        /*0030*/                   HGMMA.64x32x16.F32 R24, gdesc[UR8], R24 ;         /* 0x0 */
"""


def test_checker_reads_wgmma_descriptors():
    assert undefined_descriptors(_WGMMA) == {"b_unset": [6], "a_from_smem": [8]}


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton  # ships cuobjdump with its NVIDIA backend
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else None


def test_compiled_kernels_have_no_unset_descriptor():
    from fastawq import _ext

    status = _ext.status()
    if not status["loaded"] or not status["archs"]:
        pytest.skip("no compiled CUDA kernels in this install")
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (PATH or triton's NVIDIA backend)")
    import fastawq._C as compiled

    run = subprocess.run([tool, "-sass", compiled.__file__], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"cuobjdump -sass {compiled.__file__} failed: {run.stderr[-2000:]}"
    assert "Function :" in run.stdout, f"cuobjdump found no kernels in {compiled.__file__}"
    bad = undefined_descriptors(run.stdout)
    assert not bad, "memory descriptors read from unset uniform registers (ptxas cache-hint miscompile): " + \
        "; ".join(f"{fn}: UR{regs}" for fn, regs in sorted(bad.items()))
