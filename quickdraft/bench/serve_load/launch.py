"""Start a `quickdraft serve` process on a free port and wait until it answers /health: one
helper for the serving benchmarks (benchmarks/multi_turn.py, benchmarks/chunked_prefill.py)
and the tests that start real servers."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Iterator

import httpx

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    """A TCP port nothing listens on now: a random one in 20000-59999 that binds. Between the pick
    and the server's own bind another process may take it, and the operating system's pick
    (binding port 0) made that likely: two test workers starting servers at once were handed the
    same port (one server's bind failed with "address already in use" while the other answered its
    /health); a random pick makes it a 1 in 40,000 chance per pair."""
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(20000, 60000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # (a crowded range: the operating system's pick)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], port: int, log: IO | int | None = None, threads: int | None = None,
                 env: dict | None = None) -> subprocess.Popen:
    """`python -m quickdraft.cli serve --port PORT *args` from the repository root, its output to
    `log` (a file, subprocess.PIPE, or None for /dev/null); `threads` sets OMP_NUM_THREADS."""
    env = dict(os.environ if env is None else env)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "quickdraft.cli", "serve", "--port", str(port), *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL if log is None else log,
                            stderr=subprocess.STDOUT, env=env, text=log is subprocess.PIPE or None)


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 600, poll: float = 0.5) -> None:
    """Wait until `url`/health answers 200; RuntimeError if `proc` exits first (with its output when
    it was piped) or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"the server at {url} exited with {proc.returncode}" + (f":\n{out}" if out else ""))
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise RuntimeError(f"the server at {url} was not ready after {timeout} s")


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Terminate, then kill if it has not exited after `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def served(args: list[str], log: IO | int | None = None, threads: int | None = None,
           timeout: float = 600) -> Iterator[tuple[str, subprocess.Popen]]:
    """A running server for the `with` block: yields (base URL, process); stopped at the end."""
    port = free_port()
    proc = start_server(args, port, log=log, threads=threads)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout)
        yield url, proc
    finally:
        stop_server(proc)
