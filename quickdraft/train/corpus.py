"""The training corpus: the running interpreter's standard library, or any folder of text.

Files are split into `train` and `heldout` by a hash of their relative path, so the split
does not depend on the order files are found in, on the machine, or on which other files
exist: a file is held out when sha256(path) mod 1000 < 60 (about 6%). Small corpora are
topped up with the files of smallest hash until at least 5% (and at least one file) is
held out, and the train split always keeps at least one file.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..errors import QuickdraftError

MAX_FILE_BYTES = 1_000_000  # larger files are skipped: generated data, not code people write
HELDOUT_PER_MILLE = 60  # a file is held out when its path hash mod 1000 is below this
MIN_HELDOUT_FRACTION = 0.05
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}

Document = tuple[str, str]  # (relative posix path, text)


@dataclass(frozen=True)
class Corpus:
    source: str  # "stdlib" or the corpus folder
    train: list[Document]
    heldout: list[Document]
    skipped: int = 0  # files left out: not UTF-8 text, NUL bytes, empty or too large

    @property
    def num_bytes(self) -> int:
        return sum(len(t.encode()) for _, t in self.train + self.heldout)

    def summary(self) -> dict:
        return {"source": self.source, "files_train": len(self.train), "files_heldout": len(self.heldout),
                "files_skipped": self.skipped, "bytes": self.num_bytes}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The `.py` files of the running interpreter's standard library, sorted; installed
    packages (site-packages, dist-packages) are left out, the test suites kept (code too)."""
    root = stdlib_root()
    if not root.is_dir():
        raise QuickdraftError(f"the standard library folder {root} does not exist; pass --corpus DIR")
    return sorted(p for p in root.rglob("*.py")
                  if p.is_file() and not _EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1]))


def read_text(path: Path) -> str | None:
    """The file's text, or None when it is not usable: larger than MAX_FILE_BYTES, empty,
    not valid UTF-8, or containing a NUL byte (binary)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        data = path.read_bytes()
    except OSError:
        return None
    if not data or b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")


def split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """Deterministic train / held-out split by path hash (see the module docstring)."""
    if len(docs) < 2:
        return list(docs), []
    # Ranked by the same key the threshold reads, so topping up takes the next files in line.
    by_key = sorted(docs, key=lambda d: (path_hash(d[0]) % 1000, path_hash(d[0]), d[0]))
    minimum = max(1, math.ceil(MIN_HELDOUT_FRACTION * len(docs)))
    held = {d[0] for i, d in enumerate(by_key)
            if path_hash(d[0]) % 1000 < HELDOUT_PER_MILLE or i < minimum}
    if len(held) == len(docs):  # tiny corpora: keep something to train on
        held.discard(by_key[-1][0])
    train = [d for d in docs if d[0] not in held]
    heldout = [d for d in docs if d[0] in held]
    return train, heldout


def _folder_files(root: Path) -> list[Path]:
    # Hidden files and folders (.git, .venv, ...) are tooling, not corpus.
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
                  and "__pycache__" not in p.relative_to(root).parts)


def load_corpus(corpus_dir: str | Path | None = None) -> Corpus:
    """The stdlib corpus (None), or every UTF-8 text file under `corpus_dir`."""
    if corpus_dir is None:
        root, files, source = stdlib_root(), stdlib_files(), "stdlib"
    else:
        root = Path(corpus_dir).expanduser()
        if not root.exists():
            raise QuickdraftError(f"corpus folder not found: {root}")
        if not root.is_dir():
            raise QuickdraftError(f"--corpus must be a folder, not a file: {root}")
        files, source = _folder_files(root), str(root)
        if not files:
            raise QuickdraftError(f"corpus folder {root} has no files")
    docs: list[Document] = []
    for path in files:
        text = read_text(path)
        if text is not None and text.strip():
            docs.append((path.relative_to(root).as_posix(), text))
    if not docs:
        raise QuickdraftError(
            f"corpus folder {root} has no usable text files: all {len(files)} are binary, not UTF-8, "
            f"empty or larger than {MAX_FILE_BYTES // 1_000_000} MB")
    train, heldout = split(docs)
    return Corpus(source=source, train=train, heldout=heldout, skipped=len(files) - len(docs))
