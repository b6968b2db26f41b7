"""Model names: a local folder, or a Hugging Face Hub id ("org/name") fetched into the Hub cache.

Offline (`HF_HUB_OFFLINE=1`) only the cache is read and a missing id fails at once with the id
and the cache folder in the message. A string that looks like a path never reaches the Hub."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

# What fastawq reads: configs, safetensors weights, tokenizer files, chat templates. Never
# pickled weights (.bin / .pt), and remote code only when it is trusted.
DEFAULT_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "tokenizer*")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "on", "yes", "true")


def offline() -> bool:
    """Read at each call (huggingface_hub reads its variable once, at import)."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface" / "hub"


def looks_like_path(name: str) -> bool:
    """A string is a path when it starts like one, or has more separators than 'org/name' has."""
    if name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or name in (".", ".."):
        return True
    if os.sep != "/" and os.sep in name:
        return True
    return name.count("/") > 1 or (os.altsep is not None and os.altsep != "/" and os.altsep in name)


def resolve(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    allow_patterns: tuple[str, ...] | list[str] = DEFAULT_PATTERNS,
    *,
    trust_remote_code: bool = False,
) -> Path:
    """The local folder of a model: `name_or_path` itself when it exists, else the Hub cache's
    snapshot of the id (downloaded unless offline). Python files come only with trust_remote_code."""
    if not isinstance(name_or_path, str):
        p = Path(name_or_path)
        if not p.exists():
            raise FileNotFoundError(f"no such model folder: {p}")
        return p
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    if looks_like_path(name_or_path) or not _REPO_ID.fullmatch(name_or_path):
        raise FileNotFoundError(
            f"no such model folder: {name_or_path!r} (and it is not a Hub id of the form 'org/name')"
        )
    return _download(name_or_path, revision, list(allow_patterns) + (["*.py"] if trust_remote_code else []))


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as e:
        raise FileNotFoundError(
            f"{repo_id!r} is not a local folder, and Hub ids need huggingface_hub (pip install huggingface_hub)"
        ) from e
    cache = cache_dir()
    is_offline = offline()
    where = f"revision {revision!r} of " if revision else ""
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=str(cache), allow_patterns=patterns,
            local_files_only=is_offline,
        )
    except LocalEntryNotFoundError as e:
        if type(e).__name__ == "IncompleteSnapshotError":  # its own message names the missing files
            raise
        why = "HF_HUB_OFFLINE is set" if is_offline else f"the Hub could not be reached ({e.__class__.__name__})"
        raise FileNotFoundError(
            f"{where}{repo_id!r} is not a local folder and not in the Hugging Face cache {cache} ({why}); "
            f"fetch it where the Hub is reachable (`hf download {repo_id}` with the same HF_HUB_CACHE) or pass a folder"
        ) from None
    except HfHubHTTPError as e:
        msg = f"cannot fetch {where}{repo_id!r} from the Hugging Face Hub into {cache}: {e}"
        raise FileNotFoundError(msg) from None
    log.info("%s -> %s", repo_id, folder)
    return Path(folder)
