"""The cache directory (`$BRISK_CACHE`, default `~/.cache/brisk`).

Checked writable at start: in containers the home directory is often read-only or
ephemeral (the article's `HF_HOME` trap), and finding out after a 20-minute
conversion is the worst time to learn it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from brisk.errors import CacheDirError

ENV_VAR = "BRISK_CACHE"


def cache_dir() -> Path:
    """The cache directory, created if needed and verified writable."""
    configured = os.environ.get(ENV_VAR)
    path = Path(configured).expanduser() if configured else Path.home() / ".cache" / "brisk"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise CacheDirError(
            f"cache directory {path} is not writable ({e.strerror or e}); "
            f"set {ENV_VAR} to a writable directory, e.g. {ENV_VAR}=/tmp/brisk-cache"
        ) from None
    return path
