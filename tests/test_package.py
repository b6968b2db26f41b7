"""The top-level package: `import fastawq` stays light, and its public names load on first use."""
from __future__ import annotations

import os
import subprocess
import sys


def _run(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_import_fastawq_loads_no_torch():
    code = "import sys, fastawq\nprint('torch' in sys.modules, 'fastawq.quantize' in sys.modules)\n"
    assert _run(code) == ["False", "False"]


def test_public_names_resolve_lazily():
    # fastawq.quantize is the function whether the subpackage of that name was loaded before or after.
    code = (
        "import fastawq\n"
        "from fastawq.quantize.config import QuantConfig\n"
        "print(callable(fastawq.quantize), fastawq.quantize.__module__)\n"
        "from fastawq import AutoAWQForCausalLM, AwqQuantizer, quantize\n"
        "print(quantize is fastawq.quantize, fastawq.QuantConfig is QuantConfig, AwqQuantizer.__name__)\n"
        "print(AutoAWQForCausalLM.__module__, fastawq.ops.__name__)\n"
    )
    assert _run(code) == ["True", "fastawq.quantize", "True", "True", "AwqQuantizer", "fastawq.auto", "fastawq.ops"]
    code = "import fastawq\nf = fastawq.quantize\nimport fastawq.quantize.stream\nprint(fastawq.quantize is f)\n"
    assert _run(code) == ["True"]
