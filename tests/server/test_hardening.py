"""Issue 16's probes against a real `quickdraft serve` process: access control (API key, CORS,
JSON only), requests that can never fit, oversized and slow input, memory, disconnects while
uploading, and a big request beside a running stream."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest

from server_util import ServerProcess

MODEL = "tiny"
KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 2  # --request-timeout of the fixture's server
CAPACITY = 4  # --max-num-seqs 2 + --max-queue 2


@pytest.fixture(scope="module")
def hard(target_dir, draft_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("hard") / "server.log"
    s = ServerProcess("--target", str(target_dir), "--draft", str(draft_dir), "-k", "3", "--max-num-seqs", "2",
                      "--max-queue", "2", "--served-model-name", MODEL, "--request-timeout", str(TIMEOUT),
                      "--allowed-origins", "https://ok.example, https://also.example",
                      log=log, env={"QUICKDRAFT_API_KEY": KEY})
    s.log_path = log
    yield s
    s.stop()


def post(server, path, body, headers=None, **kw) -> httpx.Response:
    headers = {**AUTH, **(headers or {})}
    if isinstance(body, (dict, list)):
        return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)
    headers.setdefault("content-type", "application/json")
    return httpx.post(server.url + path, content=body, headers=headers, timeout=60, **kw)


def errors(server, status: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    m = re.search(rf'^request_errors_total{{status="{status}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def small(**kw) -> dict:
    return {"model": MODEL, "prompt": [0, 5, 9], "max_tokens": 4, "temperature": 0, **kw}


# ---- access control ---------------------------------------------------------------------

def test_api_key_guards_v1_and_leaves_health_and_metrics_open(hard):
    for path in ("/v1/models", "/v1/completions", "/v1/nothing", "/v1"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request("GET" if path != "/v1/completions" else "POST", hard.url + path, headers=headers,
                              json=small())
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert httpx.get(hard.url + "/v1/models", headers=AUTH).status_code == 200
    assert post(hard, "/v1/completions", small()).status_code == 200
    assert httpx.get(hard.url + "/health").status_code == 200
    assert httpx.get(hard.url + "/metrics").status_code == 200
    assert errors(hard, "401") >= 12


def test_api_key_from_the_flag(tmp_path):
    s = ServerProcess("--method", "none", "--api-key", "flag-key", "--max-num-seqs", "1", log=tmp_path / "log")
    try:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer flag-key"}).status_code == 200
    finally:
        s.stop()


def test_body_must_be_declared_json(hard):
    """A web page's cross-origin "simple" POST (text/plain, form) must not be served."""
    body = json.dumps(small()).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = dict(AUTH)
        if ctype:
            headers["content-type"] = ctype
        r = httpx.post(hard.url + "/v1/completions", content=body, headers=headers, timeout=30)
        assert r.status_code == 415, (ctype, r.text)
        assert "application/json" in r.json()["error"]["message"]
    r = post(hard, "/v1/completions", body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_cors_only_for_allowed_origins(hard):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(hard.url + "/v1/completions", headers={"Origin": "https://ok.example", **pre})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ok.example"
    r = httpx.options(hard.url + "/v1/completions", headers={"Origin": "https://evil.example", **pre})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(hard.url + "/v1/models", headers={"Origin": "https://evil.example", **AUTH})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.get(hard.url + "/v1/models", headers={"Origin": "https://also.example", **AUTH})
    assert r.headers["access-control-allow-origin"] == "https://also.example"


def test_no_cors_by_default(tmp_path):
    s = ServerProcess("--method", "none", "--max-num-seqs", "1", log=tmp_path / "log")
    try:
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "https://ok.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = httpx.options(s.url + "/v1/completions", headers={"Origin": "https://ok.example",
                                                                "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers
        r = httpx.post(s.url + "/v1/completions", content=b'{"model": "quickdraft-default", "prompt": "x"}',
                       headers={"content-type": "text/plain"})
        assert r.status_code == 415
    finally:
        s.stop()


# ---- requests that can never fit ---------------------------------------------------------

def test_more_sequences_than_the_server_holds_is_400_not_429(hard):
    r = post(hard, "/v1/completions", small(n=CAPACITY + 1))
    err = r.json()["error"]
    assert r.status_code == 400 and "retry-after" not in r.headers, r.text
    assert str(CAPACITY + 1) in err["message"] and str(CAPACITY) in err["message"] and err["param"] == "n"
    r = post(hard, "/v1/completions", small(prompt=[[0, 5]] * 3, n=2))
    assert r.status_code == 400 and "6" in r.json()["error"]["message"]
    r = post(hard, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                            "n": CAPACITY + 1, "max_tokens": 2})
    assert r.status_code == 400 and str(CAPACITY) in r.json()["error"]["message"]
    assert post(hard, "/v1/completions", small(n=CAPACITY)).status_code == 200


@pytest.mark.parametrize("case", ["10mb_prompt", "many_prompts", "many_messages", "long_token_list",
                                  "long_messages"])
def test_oversized_input_is_400_early_naming_the_limit(hard, case):
    body = {
        "10mb_prompt": {"model": MODEL, "prompt": "a" * 10_000_000},
        "many_prompts": {"model": MODEL, "prompt": ["ab"] * 1_670_000},
        "many_messages": {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 150_000},
        "long_token_list": {"model": MODEL, "prompt": [1] * 2_000_000},
        "long_messages": {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5_000_000}]},
    }[case]
    t = time.perf_counter()
    r = post(hard, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
    elapsed = time.perf_counter() - t
    err = r.json()["error"]
    assert r.status_code == 400, r.text[:300]
    assert re.search(r"\d+", err["message"]) and ("context length" in err["message"] or "at most" in err["message"])
    assert err["param"] in ("prompt", "messages", "n")
    assert elapsed < 30  # the probe took 35-47 s; what remains is mostly uploading and decoding JSON
    assert httpx.get(hard.url + "/health").status_code == 200


# ---- body size, memory, slow and broken uploads ------------------------------------------

def test_chunked_upload_past_the_limit_is_cut_off_and_memory_is_bounded(hard):
    """The limit was checked against Content-Length only: a chunked 300 MB body was read whole."""
    rss0, peak0 = hard.rss_mb()
    chunk = b"x" * (1 << 20)
    sent = 0

    def body():
        nonlocal sent
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(300):
            sent += len(chunk)
            yield chunk
        yield b'"}'

    try:
        r = httpx.post(hard.url + "/v1/completions", content=body(), timeout=60,
                       headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    except httpx.TransportError:
        pass  # the server answered 413 and closed the connection while we were still sending
    rss1, peak1 = hard.rss_mb()
    assert peak1 - peak0 < 150, (peak0, peak1)  # was +595 MB
    assert rss1 - rss0 < 100, (rss0, rss1)  # was +297 MB kept
    assert post(hard, "/v1/completions", small()).status_code == 200


def test_content_length_past_the_limit_is_413(hard):
    r = post(hard, "/v1/completions", b"{" + b" " * (33 << 20) + b"}")
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_memory_is_released_after_a_31mb_prompt(hard):
    """After one 31 MB prompt the process stayed at 3.4 GB (from 0.8 GB)."""
    rss0, _ = hard.rss_mb()
    for _ in range(2):
        r = post(hard, "/v1/completions", {"model": MODEL, "prompt": "é" * 15_000_000})
        assert r.status_code == 400
    rss1, _ = hard.rss_mb()
    assert rss1 - rss0 < 150, (rss0, rss1)


def test_client_hanging_up_mid_upload_is_a_disconnect_not_a_500(hard):
    before = errors(hard, "500")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", hard.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\n"
                         b'{"model": "tiny", "prompt": "')
            time.sleep(0.3)
    deadline = time.monotonic() + 10
    while errors(hard, "499") < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert errors(hard, "499") >= 3
    assert errors(hard, "500") == before
    assert "Traceback" not in hard.log_path.read_text()


def test_a_body_that_stalls_gets_408(hard):
    with socket.create_connection(("127.0.0.1", hard.port)) as sock:
        sock.settimeout(TIMEOUT + 20)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        t = time.monotonic()
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert time.monotonic() - t < TIMEOUT + 10


def test_slowloris_headers_are_closed(hard):
    """Headers sent a byte at a time, never finished: the connection is closed."""
    with socket.create_connection(("127.0.0.1", hard.port)) as sock:
        sock.settimeout(1)
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        t = time.monotonic()
        closed = False
        while time.monotonic() - t < TIMEOUT + 15:
            try:
                sock.sendall(b"X-a: b\r\n")
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.monotonic() - t >= TIMEOUT * 0.9


# ---- a big request beside a running stream ------------------------------------------------

def _stream_gaps(url: str, body: dict, during=None) -> list[float]:
    """Gaps between the SSE events of one stream; `during(client)` runs once it flows."""

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            gaps, last, task = [], None, None
            async with c.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    t = time.perf_counter()
                    if last is not None:
                        gaps.append(t - last)
                    last = t
                    if during is not None and task is None and len(gaps) == 20:
                        task = asyncio.create_task(during(c))
            if task is not None:
                await task
            return gaps

    return asyncio.run(run())


@pytest.mark.slow
def test_a_10mb_request_does_not_stall_a_running_stream(hard):
    """A 10 MB prompt froze /health and paused every stream for ~10 s. The stream's worst
    gap while big requests are handled stays within 2x its worst gap alone, + 0.5 s for
    scheduling noise on a shared CPU (both measured here, on the same server; windows of 5
    events). Tokenizing such a prompt on the event loop gave a 10.7 s window; with + 50 ms this
    test failed once in a CI run on 2 cores (a 92 ms window against 19 ms alone: noise, not a
    stall), so the margin is a twentieth of the stall it guards against."""
    body = {"model": MODEL, "prompt": [0, 5, 9], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True, "num_speculative_tokens": 0}
    big = json.dumps({"model": MODEL, "prompt": "ab " * 3_400_000}).encode()  # 10.2 MB
    statuses = []

    async def during(c: httpx.AsyncClient):
        for _ in range(2):
            r = await c.post(hard.url + "/v1/completions", content=big,
                             headers={**AUTH, "content-type": "application/json"})
            statuses.append(r.status_code)

    def windows(gaps):
        return [sum(gaps[i:i + 5]) for i in range(0, len(gaps) - 4, 5)]

    alone = max(windows(_stream_gaps(hard.url, body)[20:]))
    beside = _stream_gaps(hard.url, body, during)
    assert statuses == [400, 400]
    assert max(windows(beside[20:])) < 2 * alone + 0.5, (max(windows(beside[20:])), alone)
