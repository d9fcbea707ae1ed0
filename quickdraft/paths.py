"""Where quickdraft keeps what it fetches and builds: the bottom layer (it imports nothing of
quickdraft's), so the kernels and the model sources can both use it."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def cache_dir() -> Path:
    """The folder catalogue models, GGUF conversions, compiled kernels and AOT packages are kept in
    (`QUICKDRAFT_CACHE`, else ~/.cache/quickdraft)."""
    env = os.environ.get("QUICKDRAFT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quickdraft"


def unsafe_to_load(*paths: Path) -> str | None:
    """Why loading code (a kernel library, an AOT package) from these folders and files is
    unsafe, or None: one of them belongs to another user, or others (group or world) can write
    to it, so someone else could replace what this process runs. Paths that do not exist are
    skipped (a file not built yet); on systems without uids (Windows) nothing is checked."""
    if not hasattr(os, "getuid"):
        return None
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if st.st_uid != os.getuid():
            return f"{path} belongs to another user (uid {st.st_uid})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{path} is writable by others (mode {stat.filemode(st.st_mode)}; `chmod go-w {path}` fixes it)"
    return None
