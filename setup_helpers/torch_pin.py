"""scikit-build-core dynamic-metadata provider: a wheel holding fastawq._C requires exactly the
torch it was compiled against (a C++ extension links torch's unstable ABI).

Reads the same decision as CMakeLists.txt (build_env.probe), so the pin is there exactly when
_C is. pyproject.toml lists "dependencies" in [project].dynamic and gives the base list as this
provider's `base` setting; with kernels, the base `torch` requirement becomes `torch==<built>`.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import build_env  # noqa: E402


def pin_version(torch_version: str) -> str:
    """The public part of the version torch was built as ("2.14.1+cu130" -> "2.14.1").

    A local label in the pin makes pip look for that exact build in the index, and wheels
    installed from a mirror often carry metadata without it ("2.14.1"): the pin must match the
    installed torch. `fastawq._ext` still compares the full version before it loads `_C`, and
    falls back to Triton/torch with a warning when the local build differs."""
    return torch_version.split("+", 1)[0]


def dynamic_metadata(field: str, settings: dict[str, Any] | None = None) -> list[str]:
    if field != "dependencies":
        raise RuntimeError(f"torch_pin only provides 'dependencies', not {field!r}")
    base = list((settings or {}).get("base", []))
    info = build_env.probe()
    if not info["build"]:
        return base
    pin = f"torch=={pin_version(info['torch_version'])}"
    return [pin if re.match(r"^torch\s*([<>=!~;\[]|$)", req) else req for req in base] + (
        [] if any(re.match(r"^torch\s*([<>=!~;\[]|$)", req) for req in base) else [pin]
    )
