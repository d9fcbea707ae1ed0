"""Tensor parallelism as users start it: `torchrun ... quickdraft generate`, and `quickdraft
serve --tensor-parallel-size 2` answering the openai client; a rank that dies makes the server
fail its requests with a clear error and exit non-zero (never hang)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quickdraft import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_util import ServerProcess, free_port  # noqa: E402

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def expected():
    plain = LLM(method="none", compile=False)
    return plain.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is `pid` (Linux /proc)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.slow
def test_torchrun_generate_equals_the_single_process(expected):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "quickdraft.cli", "generate", PROMPT, "--max-tokens", "24", "--ignore-eos", "--json", "--temperature", "0",
           "--tensor-parallel-size", "2", "--no-compile"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    assert len(line) == 1, run.stdout  # only rank 0 prints
    assert json.loads(line[0])["token_ids"] == expected.token_ids


@pytest.mark.slow
def test_server_answers_the_openai_client_and_exits_when_a_rank_dies(expected, tmp_path):
    import openai

    server = ServerProcess("--tensor-parallel-size", "2", "--tensor-parallel-timeout", "10",
                           "--served-model-name", "tp", log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        out = client.completions.create(model="tp", prompt=PROMPT, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected.text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tp", prompt=PROMPT, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert streamed == expected.text

        workers = [pid for pid, cmd in _children(server.proc.pid) if "spawn_main" in cmd]
        assert len(workers) == 1, _children(server.proc.pid)
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model="tp", prompt=PROMPT, max_tokens=24, temperature=0)
        assert failed.value.status_code in (500, 503)
        assert "tensor-parallel rank" in str(failed.value.body) or "engine" in str(failed.value.body)
        code = server.proc.wait(timeout=60)  # the server exits on its own, non-zero
        assert code != 0
        assert time.monotonic() - start < 60
        assert "tensor-parallel rank failed" in (tmp_path / "server.log").read_text()
    finally:
        server.stop()
