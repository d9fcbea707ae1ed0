"""The OpenAI-compatible server, tested as users meet it: a real `quickdraft serve` process on
127.0.0.1, driven by the official `openai` client and by raw HTTP; plus uvicorn on a thread
of this process where a fault has to be injected into the engine it serves."""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.llm import default_model_dirs
from server_util import (ServerProcess, ThreadServer, metric, speculating_args, sse_events, wait_healthy,
                         wait_metrics_zero)

MODEL = "tiny"
PROMPTS = [[0] + [(7 * i + 3 * j) % 360 + 2 for j in range(3 + i % 7)] for i in range(32)]


@pytest.fixture(scope="module")
def server(target_dir, draft_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # speculation figures: k every step
    s = ServerProcess(*speculating_args(target_dir, draft_dir, MODEL), "--policy", "fixed", log=log)
    yield s
    s.stop()


def greedy(max_tokens=16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(server.url + path, json=body, timeout=60, **kw)
    return httpx.post(server.url + path, content=body, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


# ---- endpoints -------------------------------------------------------------------------

def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_equals_offline_greedy_and_usage_is_exact(client, plain):
    for prompt in (PROMPTS[3], "def add(a, b):"):
        ref = plain.generate(prompt, greedy(20))[0]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids) == 20
        assert r.usage.total_tokens == r.usage.prompt_tokens + 20


def test_stop_string_and_eos(client, plain):
    ref = plain.generate(PROMPTS[5], greedy(30))[0]
    stop = ref.text[len(ref.text) // 2:][:3]
    assert stop.strip(), "the reference text is too short for a stop string"
    cut = plain.generate(PROMPTS[5], greedy(30, stop=(stop,)))[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=30, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == cut.text and stop not in r.choices[0].text
    assert r.usage.completion_tokens == len(cut.token_ids)


def test_streaming_equals_non_streaming(client):
    for prompt in PROMPTS[:4]:
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
        assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_chat_completion_streaming_and_not(client, plain):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    ids = plain.tokenizer.encode_chat(messages)
    ref = plain.generate(ids, greedy(12))[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.total_tokens == len(ids) + 12


def test_token_ids_beside_the_text(server):
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    full = post(server, "/v1/completions", body).json()
    ids = full["choices"][0]["token_ids"]
    assert len(ids) == full["usage"]["completion_tokens"] == 20
    events = sse_events(post(server, "/v1/completions", {**body, "stream": True}).text)
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == ids
    assert "".join(c["text"] for e in events for c in e["choices"]) == full["choices"][0]["text"]


def test_n_choices_and_seed(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, n=3, seed=7,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # choices get distinct seeds
    assert a.usage.completion_tokens == 36 and a.usage.prompt_tokens == len(PROMPTS[1])
    batch = client.completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=5, temperature=0,
                                      n=2, extra_body={"ignore_eos": True})
    assert len(batch.choices) == 4 and batch.choices[0].text == batch.choices[1].text
    assert batch.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[2])


def test_per_request_speculation_length_is_lossless(client):
    texts = {k: client.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True, "num_speculative_tokens": k}).choices[0].text
             for k in (0, 1, 4)}
    assert len(set(texts.values())) == 1


def test_unknown_fields_are_ignored(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
                                         "frobnicate": {"x": [1, 2]}, "user": "u1"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=16, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "num_requests_running", "num_requests_waiting"):
        assert re.search(rf"^{name} ", text, re.M), name
    assert metric(server, "spec_decode_num_draft_tokens_total") > 0
    assert metric(server, "spec_decode_num_drafts_total") > 0
    assert 'spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text
    per_pos = [float(v) for v in re.findall(r'^spec_decode_num_accepted_tokens_per_pos_total\{position="\d+"\} (\S+)',
                                            text, re.M)]
    assert sum(per_pos) == metric(server, "spec_decode_num_accepted_tokens_total")
    assert metric(server, 'request_success_total{finished_reason="length"}') >= 1


def test_second_chat_turn_reuses_the_first_ones_kv(server, client, plain):
    """Prefix caching is on by default: a conversation's second turn resends the first and gets its
    KV from the cache (usage.prompt_tokens_details.cached_tokens, the prefix_cache_* metrics), with
    the tokens plain decoding gives."""
    system = {"role": "system", "content": "You answer with Python code only. " * 4}
    messages = [system, {"role": "user", "content": "def add(a, b):"}]
    before = {n: metric(server, f"prefix_cache_{n}_total") for n in ("queries", "hits")}
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "class Point:"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})
    ids = plain.tokenizer.encode_chat(messages)
    assert second.usage.prompt_tokens == len(ids)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < len(ids)
    assert second.choices[0].message.content == plain.generate(ids, greedy(10))[0].text
    queries, hits = (metric(server, f"prefix_cache_{n}_total") - before[n] for n in ("queries", "hits"))
    assert queries == first.usage.prompt_tokens + len(ids) and hits >= cached
    assert metric(server, "prefix_cache_cached_tokens") >= cached and metric(server, "prefix_cache_memory_bytes") > 0


def per_pos_metric(server) -> list[float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = {int(p): float(v) for p, v in re.findall(
        r'^spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)$', text, re.M)}
    return [found.get(i, 0.0) for i in range(max(found, default=-1) + 1)]


def check_speculation(spec: dict, completion_tokens: int, n: int = 1) -> None:
    """The figures agree with each other and with the tokens the request got: every step commits
    its accepted drafts plus one token of its own, and each choice's prefill gives its first."""
    assert spec["method"] == "draft"
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"] <= 4 * spec["num_drafts"]
    assert spec["num_drafts"] <= spec["num_steps"]
    assert completion_tokens == n + spec["num_steps"] + spec["accepted_tokens"]
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
    assert len(spec["accepted_per_position"]) <= 4
    assert spec["accepted_per_position"] == sorted(spec["accepted_per_position"], reverse=True)  # a chain
    if spec["num_drafts"]:
        assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["num_drafts"])
        assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"])
    else:
        assert spec["mean_acceptance_length"] == spec["acceptance_rate"] == 0


def test_usage_carries_the_requests_own_speculation_figures(server, client):
    before = {name: metric(server, f"spec_decode_num_{name}_total") for name in ("drafts", "draft_tokens",
                                                                                 "accepted_tokens")}
    pos_before = per_pos_metric(server)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40 and r.usage.total_tokens == r.usage.prompt_tokens + 40
    spec = r.usage.speculation  # the openai client keeps the extra field
    check_speculation(spec, 40)
    assert spec["num_drafts"] > 0 and spec["draft_tokens"] > 0
    # this request alone ran: the server's counters grew by exactly its figures, position by position
    assert metric(server, "spec_decode_num_drafts_total") - before["drafts"] == spec["num_drafts"]
    assert metric(server, "spec_decode_num_draft_tokens_total") - before["draft_tokens"] == spec["draft_tokens"]
    assert (metric(server, "spec_decode_num_accepted_tokens_total") - before["accepted_tokens"]
            == spec["accepted_tokens"])
    pos_after = per_pos_metric(server)
    grown = [a - (pos_before[i] if i < len(pos_before) else 0) for i, a in enumerate(pos_after)]
    assert grown[: len(spec["accepted_per_position"])] == spec["accepted_per_position"]
    assert sum(grown) == spec["accepted_tokens"]
    # chat, n > 1: summed over the choices
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def add"}],
                                          max_completion_tokens=15, temperature=1.0, seed=3, n=3,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 45
    check_speculation(chat.usage.speculation, 45, n=3)
    # no drafts asked for: zeros, same shape
    off = client.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True, "num_speculative_tokens": 0}).usage.speculation
    assert off == {"method": "draft", "num_drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                   "acceptance_rate": 0.0, "mean_acceptance_length": 0.0, "accepted_per_position": [], "forced_tokens": 0,
                   "num_steps": 9}


def test_streamed_usage_carries_the_speculation_figures(server, client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "for i"}],
                                                 max_tokens=30, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert usage.completion_tokens == 30
    check_speculation(usage.speculation, 30)
    events = sse_events(post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 25,
                                                         "temperature": 0, "ignore_eos": True, "n": 2, "stream": True,
                                                         "stream_options": {"include_usage": True}}).text)
    assert "usage" not in events[0] or events[0]["usage"] is None
    check_speculation(events[-1]["usage"]["speculation"], 50, n=2)


def test_concurrent_requests_get_their_own_speculation_figures(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=60) as c:
            def ask(prompt, max_tokens, k=None):
                return c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True, **({} if k is None else
                                                                               {"num_speculative_tokens": k})})
            return await asyncio.gather(ask(PROMPTS[11], 48), ask(PROMPTS[12], 12), ask(PROMPTS[13], 30, k=0))

    long, short, plain_one = asyncio.run(run())
    check_speculation(long.usage.speculation, 48)
    check_speculation(short.usage.speculation, 12)
    check_speculation(plain_one.usage.speculation, 30)
    assert plain_one.usage.speculation["num_drafts"] == 0 and plain_one.usage.speculation["num_steps"] == 29
    assert long.usage.speculation["num_drafts"] > 0 and short.usage.speculation["num_drafts"] > 0
    assert long.usage.speculation != short.usage.speculation


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_speculation_figures_of_other_methods(target_dir, method):
    from quickdraft.server.app import ServerState

    ts = ThreadServer(ServerState(lambda: LLM(target_dir, method=method, num_speculative_tokens=3, policy="fixed"), MODEL))
    try:
        prompt = [0] + [5, 6, 7, 8] * 6  # repeats: something for the n-gram proposer to match
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        spec = httpx.post(f"{ts.url}/v1/completions", json=body, timeout=60).json()["usage"]["speculation"]
        assert spec["method"] == method
        assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"] <= 3 * spec["num_drafts"]
        assert 30 == 1 + spec["num_steps"] + spec["accepted_tokens"]
        assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
        if method == "none":
            assert spec["num_drafts"] == spec["draft_tokens"] == 0 and spec["num_steps"] == 29
            assert spec["mean_acceptance_length"] == 0 and spec["accepted_per_position"] == []
        else:
            assert spec["num_drafts"] > 0
            assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["num_drafts"])
    finally:
        ts.stop()


# ---- bad input ---------------------------------------------------------------------------

BAD = [
    # (body, status, param)
    (b"{not json", 400, None),
    (b"", 400, None),
    (b"[1, 2, 3]", 400, None),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"model": MODEL, "prompt": "x", "min_p": 2}, 400, "min_p"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "n": 10**6}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "seed": 2**70}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "stop": ""}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": [1, 2]}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"-3": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": "up"}}, 400, "logit_bias.5"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"model": MODEL, "prompt": "x", "suffix": "end"}, 400, "suffix"),
    ({"model": MODEL, "prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ({"model": MODEL, "prompt": "x", "num_speculative_tokens": 99}, 400, "num_speculative_tokens"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": [0, 5, 100000]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [0, -1]}, 400, "prompt"),
    ({"model": "gpt-4o", "prompt": "x"}, 404, "model"),
    # wrong types are 400 (strict: no string or boolean as a number)
    ({"model": MODEL, "prompt": "x", "temperature": "0"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": True}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": True}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "min_p": True}, 400, "min_p"),
    ({"model": MODEL, "prompt": "x", "top_k": 2.0}, 400, "top_k"),
    ({"model": MODEL, "prompt": [0, 1.5, 2]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [[0, 1], [2, 3.0]]}, 400, "prompt"),
    # lone surrogates (JSON "\ud800" escapes) are not text
    (b'{"model": "tiny", "prompt": "ab\\ud800"}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": ["ok", "\\udc00"]}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": "x", "stop": "\\ud800"}', 400, "stop"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=range(len(BAD)))
def test_bad_completion_requests(server, body, status, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    assert "Traceback" not in err["message"]


def test_messages_of_probes_name_the_problem(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [0, 1.5, 2]})
    assert "integers" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", b'{"model": "tiny", "prompt": "ab\\ud800"}')
    assert "surrogate" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions",
             b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    assert "surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_top_k_past_int64_is_served_as_off(server, stream):
    """top_k >= 2**63 passed validation and failed inside the engine (500, or an error event)."""
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    ref = post(server, "/v1/completions", body).json()["choices"][0]["token_ids"]
    for top_k in (2**63, 2**64 + 5):
        r = post(server, "/v1/completions", {**body, "top_k": top_k, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r.text)
            assert not any("error" in e for e in events)
            assert sum((c["token_ids"] for e in events for c in e["choices"]), []) == ref
        else:
            assert r.json()["choices"][0]["token_ids"] == ref
    r = post(server, "/v1/completions", {**body, "temperature": 0.8, "top_k": 2**63, "seed": 3, "stream": stream})
    assert r.status_code == 200 and "error" not in r.text


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-300])
def test_tiny_temperatures_are_greedy(server, temperature):
    """From ~1e-45 to 1e-38 the output was token 0 repeated; 1e-300 was sampled at temperature 1."""
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
    ref = post(server, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["token_ids"]
    assert set(ref) != {0}
    for seed in (1, 2):
        r = post(server, "/v1/completions", {**body, "temperature": temperature, "seed": seed})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref


def test_nan_and_infinity_are_rejected(server):
    for raw in (b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
                b'{"model": "tiny", "prompt": "x", "top_p": Infinity}'):
        r = post(server, "/v1/completions", raw)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("temperature", "top_p")


def test_bad_chat_requests(server):
    cases = [({"model": MODEL, "messages": []}, "messages"),
             ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
             ({"model": MODEL, "messages": "hello"}, "messages"),
             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
              "max_completion_tokens"),
             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
              "top_logprobs"),
             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs")]
    for body, param in cases:
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_context_length_errors_give_both_numbers(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [0] * 600, "max_tokens": 4})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "600" in msg and "512" in msg and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [0] * 500, "max_tokens": 100})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "500" in msg and "100" in msg and "512" in msg
    assert r.json()["error"]["param"] == "max_tokens" and r.json()["error"]["code"] == "context_length_exceeded"
    # a chat names the limit field its body used
    for field in ("max_tokens", "max_completion_tokens"):
        r = post(server, "/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": "x"}], field: 600})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and err["code"] == "context_length_exceeded", err
    r = post(server, "/v1/chat/completions",
             {"model": MODEL, "messages": [{"role": "user", "content": "x " * 600}]})
    assert r.status_code == 400 and "512" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"
    # a message that alone overflows names the messages, not max_tokens
    r = post(server, "/v1/chat/completions",
             {"model": MODEL, "messages": [{"role": "user", "content": "x " * 600}], "max_tokens": 5})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and "512" in err["message"], err
    assert err["code"] == "context_length_exceeded"
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [0] * 512, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_engine_errors_name_their_field(ckpt_factory):
    """Errors Engine.check_request raises carry their field, which the 400 names as the body spells it
    (here the ones the module's server cannot raise: it has a tokenizer and the whole lm_head)."""
    from quickdraft.server.app import ServerState

    def load():
        llm = LLM(ckpt_factory("notok", tokenizer=False), method="none")
        llm.engine.target.split_head = True  # as a tensor-parallel target with lm_head='vocab'
        return llm

    ts = ThreadServer(ServerState(load, MODEL))
    try:
        base = {"model": MODEL, "prompt": [0, 5, 7], "max_tokens": 4}
        for extra, param in [({"stop": "x"}, "stop"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
                             ({"echo": True, "logprobs": 1}, "echo"), ({"num_speculative_tokens": 1},
                                                                       "num_speculative_tokens")]:
            r = post(ts, "/v1/completions", {**base, **extra})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and err["code"] is None, (extra, err)
    finally:
        ts.stop()


def test_unknown_route_and_method(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


# ---- load, concurrency, disconnects ---------------------------------------------------

def test_32_concurrent_greedy_requests_equal_one_at_a_time(server):
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True} for p in PROMPTS]

    async def concurrent():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            rs = await asyncio.gather(*(c.post(f"{server.url}/v1/completions", json=b) for b in bodies))
        return [r.json()["choices"][0]["text"] for r in rs]

    together = asyncio.run(concurrent())
    alone = [post(server, "/v1/completions", b).json()["choices"][0]["text"] for b in bodies]
    assert together == alone


def _wait_idle(server):
    wait_metrics_zero(server, ("num_requests_running", "num_requests_waiting"),
                      "requests still held after their clients left")


def test_disconnect_storm_then_a_normal_request(server, plain):
    rng = random.Random(0)

    async def one(c: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": PROMPTS[i % 32], "max_tokens": 200, "temperature": 0.7 * (i % 2),
                "ignore_eos": True, "stream": True}
        cut = rng.randint(0, 6)
        async with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for _ in r.aiter_raw():
                seen += 1
                if seen >= cut:
                    break  # leaving the block closes the connection mid-stream

    async def storm():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as c:
            await asyncio.gather(*(one(c, i) for i in range(100)))

    asyncio.run(storm())
    _wait_idle(server)  # every cut-off request was aborted and its slot freed
    ref = plain.generate(PROMPTS[9], greedy(20))[0]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[9], "max_tokens": 20, "temperature": 0,
                                         "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text


def test_non_streaming_client_that_leaves_is_aborted(server):
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.05)
    _wait_idle(server)


def test_queue_full_is_429_with_retry_after(tmp_path):
    target, draft = default_model_dirs()
    s = ServerProcess("--max-num-seqs", "1", "--max-queue", "1", "--method", "none", log=tmp_path / "log")
    try:
        long = {"model": "quickdraft-default", "prompt": "import os\n", "max_tokens": 600, "temperature": 0,
                "ignore_eos": True, "stream": True}

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                async with c.stream("POST", f"{s.url}/v1/completions", json=long) as a, \
                        c.stream("POST", f"{s.url}/v1/completions", json=long) as b:
                    assert a.status_code == b.status_code == 200
                    r = await c.post(f"{s.url}/v1/completions", json={**long, "stream": False})
                    return r

        r = asyncio.run(run())
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        _wait_idle(s)
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"model": "quickdraft-default", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
    finally:
        s.stop()


# ---- start-up, faults -------------------------------------------------------------------

def test_health_is_503_while_loading_then_200(target_dir):
    from quickdraft.server.app import ServerState

    release = threading.Event()

    def load():
        release.wait(30)
        return LLM(target_dir, method="none")

    ts = ThreadServer(ServerState(load, MODEL), wait=False)
    try:
        assert httpx.get(f"{ts.url}/health").status_code == 503
        r = httpx.post(f"{ts.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        release.set()
        wait_healthy(ts.url, timeout=30)
    finally:
        release.set()
        ts.stop()


POISON_PREFILL, POISON_DECODE = 300, 301


@pytest.fixture
def faulty_server(target_dir, draft_dir):
    """A real engine with faults injected: a prefill containing token 300 raises, and a
    decode step raises once a running request with token 301 in its prompt has 3 tokens."""
    from quickdraft.server.app import ServerState

    def load():
        llm = LLM(target_dir, draft_dir, num_speculative_tokens=3, policy="fixed")
        engine = llm.engine
        plan, decode = engine._plan_prefill, engine._decode

        def bad_prefill(budget):  # the chunks a prefill (alone, or in a mixed step) computes
            requests, chunks, starts = plan(budget)
            if any(POISON_PREFILL in r.prompt for r in requests):
                raise ValueError("injected prefill fault")
            return requests, chunks, starts

        def bad_decode():
            if any(POISON_DECODE in r.prompt and len(r.output) >= 3 for r in engine.running):
                raise RuntimeError("injected decode fault")
            return decode()

        engine._plan_prefill, engine._decode = bad_prefill, bad_decode
        return llm

    ts = ThreadServer(ServerState(load, MODEL))
    yield ts
    ts.stop()


def test_error_after_streaming_started_is_an_event_then_done(faulty_server):
    body = {"model": MODEL, "prompt": [0, POISON_DECODE, 5], "max_tokens": 50, "temperature": 0,
            "ignore_eos": True, "stream": True}
    r = post(faulty_server, "/v1/completions", body)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert any(e.get("choices") for e in events[:-1])  # tokens came first
    assert "error" in events[-1] and "injected decode fault" in events[-1]["error"]["message"]
    # the server goes on
    ok = post(faulty_server, "/v1/completions", {"model": MODEL, "prompt": [0, 5], "max_tokens": 4})
    assert ok.status_code == 200


def test_a_failing_request_does_not_lose_the_others(faulty_server, plain):
    good = [PROMPTS[i] for i in range(6)]
    refs = [o.text for o in plain.generate(good, greedy(24))]

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            reqs = [c.post(f"{faulty_server.url}/v1/completions",
                           json={"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
                    for p in good]
            reqs.insert(3, c.post(f"{faulty_server.url}/v1/completions",
                                  json={"model": MODEL, "prompt": [0, POISON_PREFILL], "max_tokens": 24}))
            return await asyncio.gather(*reqs)

    rs = asyncio.run(run())
    bad = rs.pop(3)
    assert bad.status_code == 500 and "injected prefill fault" in bad.json()["error"]["message"]
    assert [r.status_code for r in rs] == [200] * 6
    assert [r.json()["choices"][0]["text"] for r in rs] == refs
    assert httpx.get(f"{faulty_server.url}/health").status_code == 200


def test_engine_death_turns_health_503(target_dir):
    from quickdraft.server.app import ServerState

    def load():
        llm = LLM(target_dir, method="none")

        def die():
            raise SystemExit("injected engine death")

        llm.engine.step = die
        return llm

    ts = ThreadServer(ServerState(load, MODEL))
    try:
        r = httpx.post(f"{ts.url}/v1/completions", json={"model": MODEL, "prompt": [0, 5], "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 500 and "injected engine death" in r.json()["error"]["message"]
        assert httpx.get(f"{ts.url}/health").status_code == 503
        r = httpx.post(f"{ts.url}/v1/completions", json={"model": MODEL, "prompt": [0, 5], "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        ts.stop()


def test_serve_cli_errors_are_one_line(tmp_path):
    for args in (["--target", str(tmp_path / "missing")], ["--port", "70000"], ["--max-num-seqs", "0"]):
        p = subprocess.run([sys.executable, "-m", "quickdraft.cli", "serve", *args], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().startswith("error:") and "Traceback" not in p.stderr
    (tmp_path / "empty").mkdir()
    p = subprocess.run([sys.executable, "-m", "quickdraft.cli", "serve", "--target", str(tmp_path / "empty"),
                        "--port", "0"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "error:" in p.stderr


# ---- property-based: nothing a client sends gets a 5xx or a dropped connection ----------

def _fuzz_strategies():
    """Bodies that are mostly well formed (each field valid two times in three, junk JSON
    otherwise), so that requests get through to generation as well as to every check;
    plus arbitrary JSON and bytes."""
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
    junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                        max_leaves=12)

    def mostly(valid):
        return st.one_of(valid, valid, junk)

    token = st.one_of(st.integers(min_value=-2, max_value=400), st.floats(0, 400))
    odd_text = st.sampled_from(["\ud800", "a\udc00b", "\x00", "\u202e", "<|im_start|>", "{{ 7*7 }}"])
    prompt = st.one_of(st.text(max_size=30), odd_text, st.lists(odd_text, min_size=1, max_size=3),
                       st.lists(token, min_size=0, max_size=20),
                       st.lists(st.lists(st.integers(0, 383), min_size=1, max_size=5), max_size=3))
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                     "content": mostly(st.one_of(st.text(max_size=20), odd_text))})
    optional = {
        "max_tokens": mostly(st.integers(-2, 40)), "max_completion_tokens": mostly(st.integers(-2, 40)),
        "n": mostly(st.one_of(st.integers(-1, 4), st.integers(60, 300))),
        "temperature": mostly(st.one_of(st.floats(-1, 3), st.sampled_from([1e-45, 1e-38, 1e-300, 5e-324, "0", True]))),
        "top_p": mostly(st.one_of(st.floats(-0.5, 1.5), st.booleans())),
        "top_k": mostly(st.one_of(st.integers(-3, 50), st.integers(2**62, 2**70))),
        "min_p": mostly(st.one_of(st.floats(-0.5, 1.5), st.booleans())), "seed": mostly(st.integers()),
        "stop": mostly(st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=20))),
        "stream": mostly(st.booleans()), "ignore_eos": mostly(st.booleans()),
        "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "num_speculative_tokens": mostly(st.integers(-2, 6)), "logprobs": junk, "echo": junk,
        "top_logprobs": mostly(st.integers(-2, 25)), "presence_penalty": mostly(st.floats(-3, 3)),
        "frequency_penalty": mostly(st.floats(-3, 3)), "repetition_penalty": mostly(st.floats(-1, 3)),
        "logit_bias": mostly(st.dictionaries(st.one_of(st.integers(-5, 500).map(str), st.text(max_size=3)),
                                             st.one_of(st.floats(-200, 200), st.integers(-10**9, 10**9)), max_size=3)),
        "prompt_logprobs": mostly(st.integers(-2, 25)),
        "surprise": junk,
    }
    model = st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL), junk)
    completions = st.fixed_dictionaries({"model": model, "prompt": mostly(prompt)}, optional=optional)
    chats = st.fixed_dictionaries({"model": model, "messages": mostly(st.lists(message, max_size=3))},
                                  optional=optional)
    valid = {  # every field in range: these reach generation with random parameters
        "max_tokens": st.integers(1, 40), "n": st.integers(1, 3),
        "temperature": st.one_of(st.floats(0, 2), st.floats(0, 1e-4), st.just(5e-324)),
        "top_p": st.floats(0.05, 1), "top_k": st.one_of(st.integers(-1, 50), st.integers(2**62, 2**64)),
        "min_p": st.floats(0, 1),
        "seed": st.integers(-(2**63), 2**64 - 1), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
        "stream": st.booleans(), "ignore_eos": st.booleans(), "num_speculative_tokens": st.integers(0, 4),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.01, 3), "prompt_logprobs": st.integers(0, 20),
        "logit_bias": st.dictionaries(st.integers(0, 383).map(str), st.floats(-1e6, 1e6), max_size=3),
    }
    good_prompt = st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 383), min_size=1, max_size=20))
    good_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                    "content": st.text(max_size=20)}), min_size=1, max_size=3)
    valid_completions = st.fixed_dictionaries({"model": st.just(MODEL), "prompt": good_prompt},
                                              optional=dict(valid, logprobs=st.integers(0, 20), echo=st.booleans()))
    valid_chats = st.fixed_dictionaries({"model": st.just(MODEL), "messages": good_messages},
                                        optional=dict(valid, logprobs=st.just(True), top_logprobs=st.integers(0, 20)))
    return st.one_of(completions, chats, valid_completions, valid_chats, junk, st.binary(max_size=40))


@pytest.mark.slow
def test_random_requests_never_get_a_5xx(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=_fuzz_strategies(), data=st.data())
    def check(body, data):
        chat = isinstance(body, dict) and "messages" in body
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if data.draw(st.integers(0, 9)) == 0:  # sometimes the other endpoint
            path = "/v1/completions" if chat else "/v1/chat/completions"
        if isinstance(body, bytes):
            content = body
        else:
            content = json.dumps(body).encode()  # NaN / Infinity go out as JSON's extensions
        r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=120)
        assert r.status_code < 500, (content[:300], r.status_code, r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and "Traceback" not in err["message"]
        elif r.headers["content-type"].startswith("text/event-stream"):
            events = sse_events(r.text)
            assert not any("error" in e for e in events)
        else:
            assert r.json()["choices"]

    check()
    assert httpx.get(f"{server.url}/health").status_code == 200


# ---- logprobs, echo, penalties, logit_bias (issue 18) -----------------------------------------

LP_PROMPT = PROMPTS[5]


def _close(a, b, tol=1e-5):
    return all(abs(x - y) < tol for x, y in zip(a, b)) and len(a) == len(b)


def test_completion_logprobs_equal_the_library_and_plain_decoding(client, plain):
    """The speculative server's logprobs (openai client, legacy shape) equal plain decoding's
    in the library, token for token."""
    ref = plain.generate([LP_PROMPT], greedy(12, logprobs=3))[0]
    r = client.completions.create(model=MODEL, prompt=LP_PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.token_ids == ref.token_ids
    lp = choice.logprobs
    assert _close(lp.token_logprobs, [x.logprob for x in ref.logprobs])
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    tok = plain.tokenizer
    for top, x in zip(lp.top_logprobs, ref.logprobs):
        want = {tok.token_text(i): v for i, v in x.top}
        want.setdefault(tok.token_text(x.token_id), x.logprob)
        assert top.keys() == want.keys() and _close([top[k] for k in want], list(want.values()))
    assert lp.tokens == [tok.token_text(t) for t in ref.token_ids]
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(12)]


def test_echo_with_logprobs_scores_the_prompt(client, plain):
    """echo + logprobs (what evaluation harnesses send): the prompt comes back first, with the
    target's logprob of each of its tokens (null for the first), then the completion."""
    text = "the cat sat on the mat"
    ids = plain.tokenizer.encode(text)
    ref = plain.generate([ids], greedy(3, logprobs=1, prompt_logprobs=1))[0]
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, logprobs=1, echo=True,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.text == text + ref.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert _close(lp.token_logprobs[1:len(ids)], [x.logprob for x in ref.prompt_logprobs[1:]])
    assert _close(lp.token_logprobs[len(ids):], [x.logprob for x in ref.logprobs])
    # echo without logprobs: text only
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == text + ref.text and r.choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs(client, plain):
    messages = [{"role": "user", "content": "hello there"}]
    ids = plain.encode_chat(messages)
    ref = plain.generate([ids], greedy(8, logprobs=2))[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [plain.tokenizer.token_text(t) for t in ref.token_ids]
    assert _close([c.logprob for c in content], [x.logprob for x in ref.logprobs])
    for c, x in zip(content, ref.logprobs):
        assert bytes(c.bytes) == plain.tokenizer.token_bytes(x.token_id)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for _, v in x.top], abs=1e-5)
    no = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert no.choices[0].logprobs is None


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_logprobs_add_up_to_the_whole(server, chat):
    body = {"model": MODEL, "max_tokens": 14, "temperature": 0, "ignore_eos": True}
    if chat:
        body.update(messages=[{"role": "user", "content": "count"}], logprobs=True, top_logprobs=1)
        path = "/v1/chat/completions"
    else:
        body.update(prompt="one two three", logprobs=1, echo=True)
        path = "/v1/completions"
    whole = post(server, path, body).json()["choices"][0]
    events = sse_events(post(server, path, dict(body, stream=True)).text)
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    if chat:
        streamed = [c for p in parts for c in p["content"]]
        assert [c["token"] for c in streamed] == [c["token"] for c in whole["logprobs"]["content"]]
        assert _close([c["logprob"] for c in streamed], [c["logprob"] for c in whole["logprobs"]["content"]])
    else:
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert text == whole["text"]
        for key in ("tokens", "text_offset"):
            assert [x for p in parts for x in p[key]] == whole["logprobs"][key]
        streamed = [x for p in parts for x in p["token_logprobs"]]
        assert streamed[0] is None and _close(streamed[1:], whole["logprobs"]["token_logprobs"][1:])


def test_penalties_and_logit_bias_equal_plain_decoding(client, plain):
    fields = dict(presence_penalty=0.6, frequency_penalty=0.9)
    extra = {"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.2}
    base = plain.generate([LP_PROMPT], greedy(20))[0].token_ids
    bias = {str(base[0]): -100, "7": 5.5}
    ref = plain.generate([LP_PROMPT], greedy(20, repetition_penalty=1.2, logit_bias={base[0]: -100, 7: 5.5},
                                             **fields))[0]
    assert ref.token_ids != base and base[0] not in ref.token_ids[:1]
    r = client.completions.create(model=MODEL, prompt=LP_PROMPT, max_tokens=20, temperature=0, logit_bias=bias,
                                  extra_body=extra, **fields)
    assert r.choices[0].token_ids == ref.token_ids
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                       temperature=0, logit_bias=bias, extra_body=extra, **fields)
    ids = plain.encode_chat([{"role": "user", "content": "hi"}])
    want = plain.generate([ids], greedy(10, repetition_penalty=1.2, logit_bias={base[0]: -100, 7: 5.5}, **fields))[0]
    assert r.choices[0].message.content == want.text


def test_vllm_prompt_logprobs_field(server, plain):
    ref = plain.generate([LP_PROMPT], greedy(2, prompt_logprobs=2))[0]
    body = {"model": MODEL, "prompt": LP_PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2,
            "ignore_eos": True}
    got = post(server, "/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(LP_PROMPT)
    for entry, x, t in zip(got[1:], ref.prompt_logprobs[1:], LP_PROMPT[1:]):
        assert abs(entry[str(t)]["logprob"] - x.logprob) < 1e-5 and entry[str(t)]["rank"] == x.rank
        assert len(entry) in (2, 3)


def test_openai_client_parses_streamed_logprobs(client):
    messages = [{"role": "user", "content": "abc"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True,
                                                extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, len(c.top_logprobs)) for c in streamed] == [(c.token, 3) for c in whole.choices[0].logprobs.content]
    text = ""
    tokens = []
    for chunk in client.completions.create(model=MODEL, prompt="x y", max_tokens=6, temperature=0, logprobs=2,
                                           stream=True, extra_body={"ignore_eos": True}):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
    assert len(tokens) == 6


def test_the_grammar_vocabulary_is_built_while_loading(target_dir):
    """Building llguidance's vocabulary holds the GIL for seconds on a 50k vocabulary: the server does
    it before it is ready, not at the first constrained request while other requests stream."""
    from quickdraft.server.app import ServerState

    ts = ThreadServer(ServerState(lambda: LLM(target_dir, method="none"), MODEL))
    try:
        assert ts.state.llm.engine._grammar._vocab is not None  # no request has been sent
        body = {"model": MODEL, "prompt": "def f(", "max_tokens": 4, "temperature": 0,
                "guided_choice": ["x)", "y)"]}
        r = httpx.post(f"{ts.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("x)", "y)")
    finally:
        ts.stop()


def test_a_requests_choices_share_one_compiled_constraint(target_dir, monkeypatch):
    """n choices (and several prompts) of one request compile its schema once, not once each."""
    from quickdraft import constraints
    from quickdraft.server.app import ServerState

    compiles = []
    real = constraints._compile_matcher
    monkeypatch.setattr(constraints, "_compile_matcher", lambda *a, **kw: compiles.append(1) or real(*a, **kw))
    ts = ThreadServer(ServerState(lambda: LLM(target_dir, method="none"), MODEL))
    try:
        body = {"model": MODEL, "prompt": ["def f(", "x = "], "max_tokens": 4, "temperature": 0.8, "n": 3,
                "seed": 1, "guided_choice": ["a)", "b)"]}
        r = httpx.post(f"{ts.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        assert len(r.json()["choices"]) == 6 and {c["text"] for c in r.json()["choices"]} <= {"a)", "b)"}
        assert len(compiles) == 1
    finally:
        ts.stop()


def test_a_server_process_freezes_its_heap_once_loaded(target_dir):
    """`quickdraft serve` (freeze_gc): what is alive once the model is loaded leaves the garbage
    collector's generations, so a full collection, which holds the GIL while the streams wait,
    no longer walks it; a server in a process of someone else's (the default) leaves them."""
    import gc

    from quickdraft.server.app import ServerState

    gc.unfreeze()
    for freeze in (False, True):
        ts = ThreadServer(ServerState(lambda: LLM(target_dir, method="none"), MODEL, freeze_gc=freeze))
        try:
            assert (gc.get_freeze_count() > 10_000) == freeze
            body = {"model": MODEL, "prompt": "def f(", "max_tokens": 4, "temperature": 0}
            assert httpx.post(f"{ts.url}/v1/completions", json=body, timeout=60).status_code == 200
        finally:
            ts.stop()
            gc.unfreeze()
