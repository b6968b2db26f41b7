"""Clear, early errors: a local path that does not exist (no hub retries), an empty prompt,
out-of-vocabulary ids; and the CLI's one-line errors, source folder protection included."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastawq import cli
from fastawq.auto import AutoAWQForCausalLM
from fastawq.checkpoint import load_quantized
from fastawq.generate import generate
from relhelp import assert_intact, snapshot
from test_models import VOCAB

MISSING = ["./no-such-model", "no/such/model/dir", "/nonexistent/awq", "~/no-such-fastawq-model", Path("no-such")]


@pytest.mark.parametrize("path", MISSING, ids=[str(p) for p in MISSING])
@pytest.mark.parametrize("entry", ["from_pretrained", "from_quantized", "load_quantized"])
def test_missing_local_path_fails_at_once(entry, path):
    fn = {"from_pretrained": AutoAWQForCausalLM.from_pretrained,
          "from_quantized": lambda p: AutoAWQForCausalLM.from_quantized(p, device_map="cpu"),
          "load_quantized": load_quantized}[entry]
    t = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=str(path).replace(".", r"\.")):
        fn(path)
    assert time.perf_counter() - t < 2.0


BAD_PROMPTS = {
    "empty-list": ([], "empty"),
    "empty-tensor": (torch.zeros(0, dtype=torch.long), "empty"),
    "empty-batch": (torch.zeros(2, 0, dtype=torch.long), "empty"),
    "id-at-vocab": ([1, VOCAB], f"token id {VOCAB}"),
    "id-negative": (torch.tensor([[3, -1]]), "token id -1"),
    "float-ids": (torch.rand(1, 4), "integer"),
    "3d-ids": (torch.zeros(1, 2, 3, dtype=torch.long), "shape"),
    "empty-string": ("", "empty"),
    "list-of-floats": ([1.0, 2.0], "token ids"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt_is_refused_before_the_model_runs(packed, case):
    prompt, match = BAD_PROMPTS[case]
    with pytest.raises((ValueError, TypeError), match=match):
        generate(packed.model, None, prompt, 4)


@pytest.mark.parametrize("n", [0, -1, "3"])
def test_bad_max_new_tokens(packed, n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(packed.model, None, [1, 2], n)


def test_hf_style_generate_checks_ids(packed):
    with pytest.raises(ValueError, match=f"token id {VOCAB + 5}"):
        packed.generate(torch.tensor([[1, VOCAB + 5]]), max_new_tokens=2)


# ---------------------------------------------------------------- CLI
def _cli(capsys, *argv):
    """As from a shell: `fastawq ARGV` (cli.main(None) reads sys.argv)."""
    saved = sys.argv
    sys.argv = ["fastawq", *map(str, argv)]
    try:
        code = cli.main()
    finally:
        sys.argv = saved
    return code, capsys.readouterr().err


def test_cli_quantize_refuses_source_as_output(float_dir, capsys):
    snap = snapshot(float_dir)
    for out in (float_dir, float_dir / "awq"):
        code, err = _cli(capsys, "quantize", float_dir, out, "--overwrite")
        assert code == 1 and "loaded from" in err
    assert snapshot(float_dir) == snap


@pytest.mark.parametrize("argv", [
    ["quantize", "./no/such/float-model", "{tmp}/out"],
    ["quantize", "{float}", "{tmp}/out", "--shard-size", "lots"],
    ["generate", "./no/such/ckpt", "hello"],
    ["generate", "{ckpt}", ""],
    ["ppl", "./no/such/ckpt"],
    ["ppl", "{ckpt}", "--text", "./no/such/text.txt"],
])
def test_cli_errors_are_one_line(argv, capsys, tmp_path, float_dir, saved):
    argv = [a.format(tmp=tmp_path, float=float_dir, ckpt=saved["one"]) for a in argv]
    t = time.perf_counter()
    code, err = _cli(capsys, *argv)
    assert code == 1 and err.startswith(f"fastawq {argv[0]}: error:") and err.count("\n") == 1
    assert time.perf_counter() - t < 5.0


def test_cli_from_python_raises(float_dir):
    with pytest.raises(ValueError, match="loaded from"):
        cli.main(["quantize", str(float_dir), str(float_dir), "--overwrite"])


def test_cli_quantize_non_empty_output_untouched(float_dir, saved, copy_of, capsys):
    target = copy_of("old")
    snap = snapshot(target)
    code, err = _cli(capsys, "quantize", float_dir, target)
    assert code == 1 and "not empty" in err
    assert_intact(target, snap)


def test_fresh_interpreter_killed_mid_save(copy_of, saved, tmp_path):
    """One end-to-end run in a new Python process: SIGKILL while the third shard is written."""
    target = copy_of("old")
    snap = snapshot(target)
    code = ("from fastawq.auto import AutoAWQForCausalLM as A; import sys; "
            "A.from_quantized(sys.argv[1], device_map='cpu').save_quantized(sys.argv[2], shard_size='20KB', "
            "overwrite=True)")
    env = dict(os.environ, FASTAWQ_FAULT_AT="save:shard:3", FASTAWQ_FAULT_ACTION="kill",
               PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code, str(saved["one"]), str(target)], env=env, timeout=300,
                       capture_output=True)
    assert r.returncode == -9, r.stderr.decode()[-2000:]
    assert_intact(target, snap)
