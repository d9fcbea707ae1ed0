"""Faults around the prefix cache, on a real `quickdraft serve` process: a client that disconnects
while its long prompt is being prefilled (in chunks) frees its row, and leaves the cache
consistent (a later identical request gets plain decoding's output, from the chunks the aborted one
computed); and the server's debug check (--prefix-cache-check) counts its checks in /metrics."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.bench.serve_load.stats import parse_prometheus
from server_util import ServerProcess

PROMPT_LEN = 480  # the tiny target's context is 512
CHUNK = 2  # prompt tokens per prefill step: the long prompt takes 240 steps


def metrics(server) -> dict[str, float]:
    """Every series, summed over its label sets."""
    return parse_prometheus(httpx.get(f"{server.url}/metrics", timeout=10).text)


def wait_for(server, test, timeout: float = 60.0, every: float = 0.005) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(server)
        if test(m):
            return m
        time.sleep(every)
    raise AssertionError(f"not reached in {timeout} s: {metrics(server)}")


def at_rest(m: dict[str, float]) -> bool:
    """No request held, and no KV memory but the prefix cache's blocks (the rows are freed)."""
    return (m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
            and m["kv_cache_bytes"] == m["prefix_cache_memory_bytes"])


@pytest.fixture(scope="module")
def server(target_dir, tmp_path_factory):
    s = ServerProcess("--target", str(target_dir), "--method", "none", "--served-model-name", "tiny",
                      "--max-num-batched-tokens", str(CHUNK), "--prefix-cache-check",
                      log=tmp_path_factory.mktemp("faults") / "server.log")
    yield s
    s.stop()


def test_disconnect_mid_prefill_frees_the_row_and_keeps_the_cache_consistent(server, target_dir):
    rng = random.Random(5)
    long_prompt = [rng.randrange(2, 300) for _ in range(PROMPT_LEN)]
    body = dict(model="tiny", prompt=long_prompt, max_tokens=8, temperature=0, ignore_eos=True)
    before = metrics(server)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            # admitted and prefilling: the server holds its row (KV beyond the cache's blocks), no token yet
            wait_for(server, lambda m: m["num_requests_waiting"] == 1
                     and m["kv_cache_bytes"] > m["prefix_cache_memory_bytes"])
        # leaving the block closes the connection before a byte of the answer arrived
    after = wait_for(server, at_rest)
    assert after["engine_step_seconds_count"] - before["engine_step_seconds_count"] < PROMPT_LEN / CHUNK, \
        "the prefill ran to its end: the disconnect came too late to test anything"
    assert after["e2e_request_latency_seconds_count"] == before["e2e_request_latency_seconds_count"]  # no answer
    kept = after["prefix_cache_cached_tokens"] - before["prefix_cache_cached_tokens"]
    assert 0 < kept < PROMPT_LEN - 16  # the chunks it computed before the disconnect, in whole blocks

    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    ref = LLM(target_dir, method="none", compile=False, policy="fixed").generate(
        [long_prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert r["choices"][0]["text"] == ref.text
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == kept  # it resumed from those chunks
    final = wait_for(server, at_rest)
    assert final["prefix_cache_checks_total"] > before["prefix_cache_checks_total"]  # that hit was checked
    assert final["prefix_cache_check_mismatches_total"] == 0
    assert final["kv_cache_bytes"] <= final["kv_cache_budget_bytes"]


def test_the_check_without_a_cache_is_a_one_line_error():
    from typer.testing import CliRunner

    from quickdraft.cli import app

    r = CliRunner().invoke(app, ["serve", "--no-enable-prefix-caching", "--prefix-cache-check"])
    assert r.exit_code == 2 and "needs prefix caching on" in r.output and "Traceback" not in r.output, r.output
