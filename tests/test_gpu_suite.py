"""benchmarks/gpu_suite.sh, checked on the CPU before it spends device time.

A device call is scarce (minutes a session, starts that fail): a stage that dies on a typo'd flag, a
script that moved or a stage name the dispatcher never matches wastes one. Every `python
benchmarks/X.py ...` the suite runs is parsed by that script's own argparse (stopped right after
parsing: nothing runs), the A/B names and shapes it passes are checked against the scripts' tables,
the test files it names exist, every pytest selection (`-k`) it makes selects some test, and the
stages its header lists are the stages it dispatches.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
TEXT = SUITE.read_text()
JOINED = TEXT.replace("\\\n", " ")  # continuation lines joined

# Shell variables set outside a `for` loop, with a value the suite gives them; and every plain
# `NAME="value"` line of the suite (a stage's shared arguments), as the suite sets it.
_VARS = {"OUT": "out", "kernels": "gemm,wgmma", "name": "s45_wg16",  # name: ncu_source's argument
         **dict(re.findall(r'^\s*(\w+)="([^"$]*)"\s*$', TEXT, re.MULTILINE))}


def _invocations() -> list[tuple[str, list[str]]]:
    """(script, argv) of every `python benchmarks/X.py ...` in the suite, with each loop variable at
    its loop's first value."""
    found = []
    values = dict(_VARS)
    for line in JOINED.splitlines():
        loop = re.search(r"\bfor (\w+) in (\S+)[^;]*; do", line)
        if loop:
            values[loop.group(1)] = loop.group(2)
        helper = re.match(r"\s*table_by_env (.*?)( \|\| status=1)?\s*$", line)
        if helper:  # table_by_env NAME "VALUES" PREFIX "PATTERN" ARGS...: gemm_table.py ARGS --out ...
            _, vals, prefix, _, *argv = shlex.split(helper.group(1))
            found.append(("benchmarks/gemm_table.py", argv + ["--out", f"out/{prefix}_{vals.split()[0]}"]))
        for m in re.finditer(r"python (benchmarks/[\w.]+\.py)([^|;&>]*)", line):
            if '"$@"' in m.group(2):  # the helper's own body: its callers are parsed above
                continue
            args = re.sub(r"\$\{[^}]*\}", "", m.group(2))  # ${FASTAWQ_SUITE_GEMM_ARGS:-} and the like
            args = re.sub(r"\$(\w+)", lambda v: values.get(v.group(1), v.group(0)), args)
            argv = shlex.split(args)
            if argv and argv[-1] == "2":  # the "2" of a following 2>&1
                argv = argv[:-1]
            assert "$" not in " ".join(argv), f"gpu_suite.sh: an unknown variable in {m.group(0)!r}"
            found.append((m.group(1), argv))
    return found


INVOCATIONS = _invocations()


def test_the_suite_is_valid_bash():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    r = subprocess.run(["bash", "-n", str(SUITE)], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_header_lists_the_stages_the_suite_dispatches():
    header = re.search(r"#   stages: (.*?)\n#   \(default", TEXT, re.DOTALL)
    assert header, "gpu_suite.sh: the header's stage list moved"
    listed = set(header.group(1).replace("#", " ").split())
    dispatched = set(re.findall(r'== \*" (\w+) "\*', TEXT))
    assert dispatched, "no stage dispatch found"
    assert listed == dispatched, (f"listed, not dispatched: {sorted(listed - dispatched)}; "
                                  f"dispatched, not listed: {sorted(dispatched - listed)}")


def test_the_suite_runs_every_script_it_names():
    scripts = {s for s, _ in INVOCATIONS}
    assert len(INVOCATIONS) > 40 and "benchmarks/bench_ab.py" in scripts, "the parser of the suite found too few"
    for s in scripts:
        assert (ROOT / s).is_file(), f"gpu_suite.sh runs {s}, which does not exist"
    for path in set(re.findall(r"\btests/\w+\.py", TEXT)):
        assert (ROOT / path).is_file(), f"gpu_suite.sh runs {path}, which does not exist"


class _Parsed(Exception):
    def __init__(self, ns: argparse.Namespace):
        super().__init__()
        self.ns = ns


def _parse(script: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """The script's own argparse namespace for argv; nothing past the parse runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(ROOT / script), *argv])
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    try:
        with mock.patch.dict(os.environ):  # what a script's module level sets stays out of the other tests
            runpy.run_path(str(ROOT / script), run_name="__main__")
    except _Parsed as p:
        return p.ns
    except SystemExit as e:  # argparse's error exit, usage already printed
        pytest.fail(f"gpu_suite.sh: {script} {shlex.join(argv)}: the arguments do not parse (exit {e.code})")
    pytest.fail(f"{script} ran to its end without parsing arguments")


@functools.cache
def _globals(script: str) -> dict:
    """A benchmark script's module globals (its A/B and shape tables), read once."""
    return runpy.run_path(str(ROOT / script))


def _check_names(script: str, ns: argparse.Namespace) -> None:
    """The A/B names and shapes an invocation passes exist in the tables its script reads."""
    from fastawq.shapes import SHAPES as engine_shapes

    name = Path(script).name
    if name == "bench_ab.py":
        ab = _globals(script)
        for compare in ns.compare or []:
            assert ab["env_switch"](compare) is not None or compare in ab["CHOICES"], \
                f"gpu_suite.sh: bench_ab.py --compare {compare!r} is neither an A/B name nor env:NAME=OFF,ON"
    if name in ("bench_ab.py", "bench_e2e.py") and ns.shape is not None:
        assert ns.shape in engine_shapes, f"gpu_suite.sh: {name} --shape {ns.shape!r}"
    if name == "sanitize.py":
        sections = _globals(script)["SECTIONS"]
        for section in ns.only.split(","):
            assert section in sections, f"gpu_suite.sh: sanitize.py --only {section!r}"
    if name == "profile_step.py":
        for spec in ns.specs:
            assert spec.split(":")[0] in engine_shapes, f"gpu_suite.sh: profile_step.py {spec!r}"
    if name == "bench_moe.py":
        moe_shapes = _globals(script)["SHAPES"]
        for shape in ns.shapes.split(","):
            assert shape in moe_shapes, f"gpu_suite.sh: bench_moe.py --shapes {shape!r}"


@pytest.mark.parametrize("script", sorted({s for s, _ in INVOCATIONS}))
def test_every_invocation_parses_and_names_what_exists(script, monkeypatch):
    calls = [argv for s, argv in INVOCATIONS if s == script and argv]  # no arguments: nothing to parse
    if not calls:
        pytest.skip(f"the suite runs {script} without arguments")
    for argv in calls:
        _check_names(script, _parse(script, argv, monkeypatch))


def _pytest_selections() -> list[tuple[list[str], str | None]]:
    """(test files, -k expression or None) of every pytest run the suite makes (`python -m pytest` and
    pytest_gate), with shell redirections and pipes cut off."""
    found = []
    for line in JOINED.splitlines():
        m = re.search(r"(?:-m pytest|pytest_gate)\s(.*)", line)
        if not m or line.lstrip().startswith(("#", "pytest_gate()")):
            continue
        argv = shlex.split(re.split(r"2>&1|\||;|\s>", m.group(1))[0])
        files = [a for a in argv if a.startswith("tests/") and a.endswith(".py")]
        if not files:
            continue  # the tests stage's ${FASTAWQ_SUITE_TESTS:-tests}: the whole suite
        k = argv[argv.index("-k") + 1] if "-k" in argv else None
        found.append((files, k))
    return found


def test_every_pytest_selection_of_the_suite_selects_tests():
    # A -k that matches nothing makes a stage's tests pass vacuously (or exit 5) on the GPU. The
    # test ids come from one collection here (GPU tests are collected, then skipped); -k is
    # evaluated with pytest's own expression grammar on each id's names (file, test, parameters).
    Expression = getattr(pytest.importorskip("_pytest.mark.expression"), "Expression", None)
    if Expression is None or not hasattr(Expression, "compile"):
        pytest.skip("this pytest has no _pytest.mark.expression.Expression.compile")
    selections = _pytest_selections()
    assert len(selections) > 20, "the parser of the suite found too few pytest runs"
    files = sorted({f for fs, _ in selections for f in fs})
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    assert run.returncode == 0 and ids, f"collecting {files} failed:\n{run.stdout[-3000:]}{run.stderr[-2000:]}"

    def selected(expr, node_id: str) -> bool:
        """-k's match: a term is a substring of the file's name or of a test's (parameters included)."""
        names = [Path(node_id.split("::")[0]).name.lower(), *(n.lower() for n in node_id.split("::")[1:])]
        return expr.evaluate(lambda sub: any(sub.lower() in n for n in names))

    for fs, k in selections:
        chosen = [i for i in ids if i.split("::")[0] in fs]
        assert chosen, f"gpu_suite.sh: {fs} hold no tests"
        if k is not None:
            expr = Expression.compile(k)
            assert any(selected(expr, i) for i in chosen), \
                f"gpu_suite.sh: pytest {' '.join(fs)} -k {k!r} selects no test"


def test_sources_hash_names_what_c_is_built_from(tmp_path):
    """`gpu_suite.sh --sources-hash` (what scripts/prebuild_suite.sh records beside a prebuilt _C and
    the build stage compares) hashes csrc/ and CMakeLists.txt, prints only that, writes nothing, and
    changes when a source does."""
    def digest(root: Path) -> str:
        out = subprocess.run(["bash", str(root / "benchmarks" / "gpu_suite.sh"), "--sources-hash"], cwd=tmp_path,
                             capture_output=True, text=True, check=True)
        assert out.stderr == ""
        return out.stdout.strip()

    first = digest(ROOT)
    assert re.fullmatch(r"[0-9a-f]{16}", first), first
    assert digest(ROOT) == first and not (tmp_path / "out").exists()
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "csrc", copy / "csrc")
    shutil.copy(ROOT / "CMakeLists.txt", copy / "CMakeLists.txt")
    (copy / "benchmarks").mkdir()
    shutil.copy(SUITE, copy / "benchmarks" / "gpu_suite.sh")
    assert digest(copy) == first
    (copy / "csrc" / "ops.h").write_text((copy / "csrc" / "ops.h").read_text() + "\n// changed\n")
    assert digest(copy) != first
    assert 'carry=["build/prebuilt"]' in (ROOT / "scripts" / "prebuild_suite.sh").read_text()
