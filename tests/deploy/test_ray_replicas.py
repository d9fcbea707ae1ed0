"""Replicas behind Ray Serve on a local Ray cluster (real processes, the real openai client):
two replicas of the bundled pair answer like one engine (behind an API key), streaming included; killing one
under load fails only the requests it held (never a hang), the other keeps serving and Ray
starts a new replica."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from quickdraft import LLM, SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_util import ServerProcess  # noqa: E402

PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Point:", "for i in range(10):"]


def _replicas() -> set[int]:
    """Pids of the live Ray Serve replica processes of the quickdraft deployment."""
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith("ray::ServeReplica:quickdraft:quickdraft") and "initialize" not in cmd:
                pids.add(int(d.name))
    return pids


@pytest.mark.slow
def test_two_replicas_answer_like_one_engine_and_survive_a_killed_replica(tmp_path):
    import openai

    plain = LLM(method="none", compile=False)
    expected = [o.text for o in plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    server = ServerProcess("--replicas", "2", "--served-model-name", "qd", "--api-key", "K", log=tmp_path / "serve.log")
    try:
        # the server's options reach each replica's app: without the key, 401
        anonymous = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            anonymous.completions.create(model="qd", prompt=PROMPTS[0], max_tokens=4)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="K", max_retries=0, timeout=60)

        def complete(prompt: str) -> str:
            out = client.completions.create(model="qd", prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
            return out.choices[0].text

        with cf.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, PROMPTS)) == expected
        chunks = client.completions.create(model="qd", prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks) == expected[0]
        deadline = time.monotonic() + 60
        while len(_replicas()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        before = _replicas()
        assert len(before) == 2

        def attempt(i: int):
            try:
                return complete(PROMPTS[i % 4]) == expected[i % 4]
            except openai.APIStatusError as exc:  # a request the killed replica held
                return exc.status_code
            except openai.APIConnectionError as exc:
                return f"connection: {exc}"

        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(attempt, i) for i in range(16)]
            time.sleep(1.0)
            victim = sorted(before)[0]
            os.kill(victim, signal.SIGKILL)
            results = [f.result(timeout=120) for f in futures]  # none hangs
        assert all(r is True or r in (500, 502, 503) for r in results), results
        assert results.count(True) >= 8, results  # the other replica kept serving
        deadline = time.monotonic() + 90  # Ray's controller replaces the dead replica
        while time.monotonic() < deadline:
            now = _replicas()
            if len(now) == 2 and victim not in now:
                break
            time.sleep(0.5)
        assert len(_replicas()) == 2 and victim not in _replicas()
        with cf.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, PROMPTS)) == expected
    finally:
        server.stop()
        assert server.proc.returncode == 0
