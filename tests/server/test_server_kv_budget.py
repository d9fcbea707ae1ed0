"""A `quickdraft serve` under a KV memory budget (--kv-cache-memory): it holds no KV memory at
rest, derives max_model_len from the budget, answers a request that can never fit with a 400
naming both numbers, and makes requests that do not fit now wait (no 429)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from quickdraft import LLM, SamplingParams
from server_util import ServerProcess, metric, wait_metrics_zero

TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # the tiny target's KV per token: 2 x layers x kv_heads x head_dim x float32
BUDGET = TOKEN_BYTES * 201  # 199 tokens per request (+1 past the last token, +1 trash column), one at a time


def wait_at_rest(server) -> None:
    wait_metrics_zero(server, ("num_requests_running", "kv_cache_bytes"), "the server still holds KV memory at rest")


@pytest.fixture(scope="module")
def server(target_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("budget") / "server.log"
    s = ServerProcess("--target", str(target_dir), "--method", "none", "--served-model-name", "tiny",
                      "--kv-cache-memory", str(BUDGET), log=log)
    s.log_path = log
    yield s
    s.stop()


def test_start_up_names_the_budget_and_max_model_len_follows_it(server):
    text = server.log_path.read_text()
    assert f"{TOKEN_BYTES} bytes per token" in text and "max_model_len 199" in text, text
    assert "1 requests of that length at once" in text
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert models["data"][0]["max_model_len"] == 199
    assert metric(server, "kv_cache_budget_bytes") == BUDGET
    assert metric(server, "kv_cache_bytes") == 0  # nothing allocated before the first request


def test_a_request_that_can_never_fit_is_a_400_naming_both_numbers(server):
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": [0, 1, 2, 3, 4], "max_tokens": 195})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "200" in err["message"] and "199" in err["message"] and "KV cache budget" in err["message"], err


def test_requests_that_do_not_fit_now_wait_then_run(server, target_dir):
    """Three requests of 154 tokens each: the budget holds one at a time; the others wait in
    the queue (not 429), every answer equals offline greedy decoding, and at rest the server
    frees its KV memory again."""
    prompts = [[0, 5 + i, 7, 9] for i in range(3)]
    body = dict(model="tiny", max_tokens=150, temperature=0, ignore_eos=True)

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(f"{server.url}/v1/completions", json={**body, "prompt": p})
                                          for p in prompts))

    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 3
    ref = LLM(target_dir, method="none", policy="fixed").generate(prompts, SamplingParams(temperature=0, max_tokens=150,
                                                                           ignore_eos=True))
    assert [a.json()["choices"][0]["text"] for a in answers] == [o.text for o in ref]
    wait_at_rest(server)
