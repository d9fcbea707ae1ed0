"""Where quickdraft keeps what it fetches and builds: the bottom layer (it imports nothing of
quickdraft's), so the kernels and the model sources can both use it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The folder catalogue models, GGUF conversions, compiled kernels and AOT packages are kept in
    (`QUICKDRAFT_CACHE`, else ~/.cache/quickdraft)."""
    env = os.environ.get("QUICKDRAFT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quickdraft"
