"""Summarize Nsight Compute's source page (SASS, CSV) by where the warps stall.

    ncu -i report.ncu-rep --page source --csv --print-source sass > report.sass.csv
    python benchmarks/ncu_stalls.py report.sass.csv [--top 30]

Prints the instructions with the most stall samples (address, share of all samples, the SASS) and
the samples summed by opcode (HGMMA, LDGSTS, BAR, ...), so a kernel's bound reads at a glance: a
`WARPGROUP.DEPBAR` on top is the wgmma wait, `LDGDEPBAR` / `DEPBAR` the cp.async ring, `BAR.SYNC`
the block barrier, an ALU op after a load the load's latency. Column names differ between ncu
versions: the sample column is the first whose name has "Warp Stall Sampling (All", else the first
with "Sampling"; the instruction is the "Source" column. A report of several kernels gives a summary
each, headed by the name line ncu prints before its rows.

Where the report has the source counters' memory columns (`--section SourceCounters`: "L1 Wavefronts
Shared", "L1 Wavefronts Shared Excessive", "L2 Theoretical Sectors Global", "... Excessive"), it
also prints their totals, the excess share, and the instructions with the most excess: session 35
found the 16-token wgmma tile's weight copies taking 8x the shared wavefronts they need that way.
"""
from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict


def _number(text: str) -> float:
    try:
        return float(text.replace(",", "")) if text.strip() else 0.0
    except ValueError:
        return 0.0


def read_sections(path: str) -> list[tuple[str, list[dict], str, str]]:
    """(title, rows, sample column, source column) for each kernel of an ncu source-page CSV: ncu
    prints a kernel's name line, then its header and rows, then the next kernel's."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if "Source" in line and "Sampling" in line]
    if not starts:
        raise SystemExit(f"{path}: no header with 'Source' and a 'Sampling' column (is it --page source --csv?)")
    sections = []
    for j, start in enumerate(starts):
        end = starts[j + 1] - 1 if j + 1 < len(starts) else len(lines)
        header = next(csv.reader([lines[start]]))
        rows = list(csv.DictReader(lines[start:end]))
        samples = next((c for c in header if "Warp Stall Sampling (All" in c), None) \
            or next(c for c in header if "Sampling" in c)
        source = next(c for c in header if c.strip() == "Source")
        title = lines[start - 1].strip() if start > 0 else path
        sections.append((title, [r for r in rows if r.get(source)], samples, source))
    return sections


def opcode(sass: str) -> str:
    """The opcode of a SASS line: the first word after an optional predicate, without its modifiers
    after the first dot beyond two (HGMMA.64x16x16.F32 -> HGMMA.64x16x16)."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return ".".join(words[0].rstrip(";").split(".")[:2]) if words else "?"


def summarize(rows: list[dict], samples: str, source: str, top: int) -> None:
    total = sum(_number(r[samples]) for r in rows)
    if total <= 0:
        print(f"no stall samples in column {samples!r}")
        return
    address = next((c for c in rows[0] if c.strip() == "Address"), None)
    print(f"{len(rows)} instructions, {total:.0f} samples ({samples})")
    print("| address | share | SASS |")
    print("|---|---|---|")
    for r in sorted(rows, key=lambda r: -_number(r[samples]))[:top]:
        where = r[address] if address else "-"
        print(f"| {where} | {100 * _number(r[samples]) / total:.1f} % | `{r[source].strip()}` |")
    by_op: dict[str, float] = defaultdict(float)
    for r in rows:
        by_op[opcode(r[source])] += _number(r[samples])
    print("| opcode | share |")
    print("|---|---|")
    for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {op} | {100 * n / total:.1f} % |")


# (total column, its excess column, what they count) of the source counters' memory columns.
ACCESS = (("L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive", "shared wavefronts"),
          ("L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Excessive", "L2 sectors (global)"))


def summarize_access(rows: list[dict], source: str, top: int) -> None:
    """Totals and excess of the memory columns present, and the instructions with the most excess."""
    columns = {c.strip(): c for c in rows[0]} if rows else {}
    for total_name, excess_name, what in ACCESS:
        if total_name not in columns or excess_name not in columns:
            continue
        total_col, excess_col = columns[total_name], columns[excess_name]
        total = sum(_number(r[total_col]) for r in rows)
        excess = sum(_number(r[excess_col]) for r in rows)
        if total <= 0:
            continue
        print(f"{what}: {total:.0f}, {excess:.0f} excess ({100 * excess / total:.0f} %)")
        worst = [r for r in sorted(rows, key=lambda r: -_number(r[excess_col])) if _number(r[excess_col]) > 0]
        if not worst:
            continue
        print(f"| {what}: excess | total | SASS |")
        print("|---|---|---|")
        for r in worst[:top]:
            print(f"| {_number(r[excess_col]):.0f} | {_number(r[total_col]):.0f} | `{r[source].strip()}` |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    sections = read_sections(args.csv)
    for title, rows, samples, source in sections:
        if len(sections) > 1:
            print(f"### {title}")
        summarize(rows, samples, source, args.top)
        summarize_access(rows, source, args.top)


if __name__ == "__main__":
    main(sys.argv[1:])
