"""Start real quickdraft servers for tests: a `quickdraft serve` process, or uvicorn on a
thread of the test process (for fault injection into the engine it serves)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx

from quickdraft.bench.serve_load.launch import free_port, start_server, wait_ready


def wait_healthy(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    wait_ready(url, proc, timeout, poll=0.2)


def metric(server, name: str) -> float:
    """The value of an unlabelled series on the server's /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_metrics_zero(server, names: tuple[str, ...], what: str, timeout: float = 30.0) -> None:
    """Wait until every metric in `names` reads 0; else fail saying `what` is still held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(metric(server, n) == 0 for n in names):
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} after {timeout} s")


def sse_events(text: str) -> list:
    """The data payloads of an SSE body, JSON-decoded except the final [DONE]."""
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    return [json.loads(e) for e in events[:-1]]


def speculating_args(target_dir, draft_dir, model: str) -> tuple[str, ...]:
    """The `serve` arguments of the module servers that speculate with the test draft (k = 4, 8 rows)."""
    return ("--target", str(target_dir), "--draft", str(draft_dir), "-k", "4", "--max-num-seqs", "8",
            "--served-model-name", model)


class ServerProcess:
    """`python -m quickdraft.cli serve ARGS --port P` on 127.0.0.1; `.url` once healthy."""

    def __init__(self, *args: str, log: Path | None = None, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.log = open(log, "w") if log is not None else subprocess.DEVNULL
        if "--policy" not in args and "--profile" not in args:
            # k as asked every step: the tests compare figures and outputs across requests, which the
            # default (auto: k from this machine's timed steps) would make depend on timing
            args = (*args, "--policy", "fixed")
        self.proc = start_server(["--log-level", "warning", *args], self.port, log=self.log, env=env)
        try:
            wait_healthy(self.url, proc=self.proc)
        except BaseException:
            self.stop()
            raise

    def rss_mb(self) -> tuple[float, float]:
        """(resident, peak resident) memory of the server process in MB (Linux /proc)."""
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
                      if ":" in line)
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self.log, "close"):
            self.log.close()


class ThreadServer:
    """uvicorn serving build_app(state) on a thread of this process."""

    def __init__(self, state, wait: bool = True):
        import uvicorn

        from quickdraft.server.app import build_app

        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        if wait:
            wait_healthy(self.url)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
