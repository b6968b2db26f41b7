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


def dynamic_metadata(field: str, settings: dict[str, Any] | None = None) -> list[str]:
    if field != "dependencies":
        raise RuntimeError(f"torch_pin only provides 'dependencies', not {field!r}")
    base = list((settings or {}).get("base", []))
    info = build_env.probe()
    if not info["build"]:
        return base
    pin = f"torch=={info['torch_version']}"
    return [pin if re.match(r"^torch\s*([<>=!~;\[]|$)", req) else req for req in base] + (
        [] if any(re.match(r"^torch\s*([<>=!~;\[]|$)", req) for req in base) else [pin]
    )
