"""Building and loading the kernel library: a build killed halfway (its lock left behind) never
makes a later process wait for ever, and a library in a folder others can write to is not loaded."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quickdraft import kernels
from quickdraft.paths import unsafe_to_load


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_lock(folder: Path, pid: int, age_s: float = 0.0) -> Path:
    import socket

    lock = folder / kernels._LOCK
    lock.write_text(f"{socket.gethostname()} {pid} {time.time() - age_s:.0f}\n")
    if age_s:
        os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_lock_is_stale_when_its_process_is_gone_or_it_is_old(tmp_path):
    assert kernels._stale(_write_lock(tmp_path, os.getpid())) is None  # a live build: wait for it
    pid = _dead_pid()
    assert kernels._stale(_write_lock(tmp_path, pid)) == f"its process {pid} is gone"
    assert kernels._stale(_write_lock(tmp_path, os.getpid(), age_s=kernels.BUILD_LOCK_STALE_S + 5)).startswith("held for")
    (tmp_path / kernels._LOCK).write_text("")  # just created, not yet written: wait
    assert kernels._stale(tmp_path / kernels._LOCK) is None
    assert kernels._stale(tmp_path / "none") is None


@pytest.fixture
def fake_compiler(monkeypatch):
    """cpp_extension.load replaced by one that writes a library file (the lock logic, without 30 s of C++)."""
    from torch.utils import cpp_extension

    calls = []

    def load(name, sources, extra_cflags, build_directory, is_python_module, verbose):
        calls.append(build_directory)
        Path(build_directory, kernels.LIBRARY).write_bytes(b"built")

    monkeypatch.setattr(cpp_extension, "load", load)
    return calls


def test_a_stale_lock_is_taken_over_with_one_line(tmp_path, fake_compiler, caplog):
    build = tmp_path / "tag"
    build.mkdir()
    pid = _dead_pid()
    _write_lock(build, pid)
    (build / "build-killed").mkdir()  # the killed build's folder
    with caplog.at_level(logging.WARNING, logger="quickdraft"):
        kernels._build(build)
    assert (build / kernels.LIBRARY).read_bytes() == b"built" and len(fake_compiler) == 1
    assert sorted(p.name for p in build.iterdir()) == [kernels.LIBRARY]  # no lock, no build folders left
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"is stale (its process {pid} is gone): removed; building the CPU kernels again" in lines[0]


def test_a_live_lock_is_waited_for_until_it_is_too_old(tmp_path, fake_compiler, monkeypatch, caplog):
    build = tmp_path / "tag"
    build.mkdir()
    _write_lock(build, os.getpid())  # alive (this process), so only its age ends the wait
    monkeypatch.setattr(kernels, "BUILD_LOCK_STALE_S", 2)
    t = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="quickdraft"):
        kernels._build(build)
    assert 2 <= time.monotonic() - t < 30 and (build / kernels.LIBRARY).exists()
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "waiting for another process's build of the CPU kernels" in messages and "held for" in messages


def test_a_library_built_meanwhile_ends_the_wait(tmp_path, fake_compiler):
    build = tmp_path / "tag"
    build.mkdir()
    _write_lock(build, os.getpid())
    (build / kernels.LIBRARY).write_bytes(b"theirs")
    kernels._build(build)
    assert (build / kernels.LIBRARY).read_bytes() == b"theirs" and not fake_compiler


def test_folders_and_files_others_can_write_to_are_unsafe(tmp_path):
    folder = tmp_path / "k"
    folder.mkdir(mode=0o700)
    lib = folder / "lib.so"
    lib.write_bytes(b"x")
    lib.chmod(0o644)
    assert unsafe_to_load(folder, lib, folder / "missing.so") is None
    folder.chmod(0o777)
    assert "writable by others" in unsafe_to_load(folder, lib)
    folder.chmod(0o770)
    assert "writable by others" in unsafe_to_load(folder, lib)
    folder.chmod(0o700)
    lib.chmod(0o666)
    assert f"{lib} is writable by others" in unsafe_to_load(folder, lib)
    lib.chmod(0o664)
    assert f"{lib} is writable by others" in unsafe_to_load(folder, lib)
    lib.chmod(0o644)
    if os.getuid() == 0:  # (root can give a folder away)
        os.chown(lib, 65534, 65534)
        assert "belongs to another user" in unsafe_to_load(folder, lib)


def _run_available(env_cache: Path, timeout_s: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, QUICKDRAFT_KERNEL_CACHE=str(env_cache))
    code = "from quickdraft import kernels\nprint('available', kernels.available())"
    return subprocess.run(["timeout", str(timeout_s), sys.executable, "-W", "always", "-c", code], env=env,
                          capture_output=True, text=True)


@pytest.mark.skipif(not kernels.available(), reason="the kernel library could not be built here")
def test_a_world_writable_cache_is_refused(tmp_path, monkeypatch):
    """The built library copied into a folder everyone can write to: not loaded, one warning."""
    library = _built_library()
    root = tmp_path / "k"
    monkeypatch.setenv("QUICKDRAFT_KERNEL_CACHE", str(root))
    tag = kernels._build_dir()
    shutil.copy(library, tag)
    root.chmod(0o777)
    out = _run_available(root, 300)
    assert out.returncode == 0 and "available False" in out.stdout, out
    assert out.stderr.count("not loaded from a folder or file others can change") == 1 and "writable by others" in out.stderr
    root.chmod(0o700)
    (tag / kernels.LIBRARY).chmod(0o666)  # a private folder, but a library file anyone can replace
    out = _run_available(root, 300)
    assert out.returncode == 0 and "available False" in out.stdout, out
    assert out.stderr.count("not loaded from a folder or file others can change") == 1, out.stderr
    (tag / kernels.LIBRARY).chmod(0o644)
    out = _run_available(root, 300)
    assert "available True" in out.stdout, out  # the same library, now private: loaded


def _built_library() -> Path:
    return kernels._build_dir() / kernels.LIBRARY


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="the kernel library could not be built here")
def test_a_build_killed_halfway_does_not_hang_the_next_process(tmp_path, monkeypatch):
    """A lock left by a killed build (its process gone): the next process builds within a bounded
    time instead of waiting for ever (the old builder's lock: `timeout 30` -> 124)."""
    root = tmp_path / "k"
    monkeypatch.setenv("QUICKDRAFT_KERNEL_CACHE", str(root))
    _write_lock(kernels._build_dir(), _dead_pid())
    out = _run_available(root, 400)  # a build: 15-40 s, more on a loaded machine
    assert out.returncode == 0 and "available True" in out.stdout, out
    assert "stale" in out.stderr and "is gone" in out.stderr
