"""Token origins (the `return_token_origins` extension) and the chat page's files: every generated
token says whether the draft proposed it (accepted), the target sampled it (recovered, bonus or a
step without drafts) or the prefill gave it, and the counts agree with the response's own
`usage.speculation` figures. The page in a real browser: test_web_browser.py."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import httpx
import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.engine import DRAFT, ORIGINS, PREFILL, TARGET
from quickdraft.server.app import ServerState, build_app
from quickdraft.server.web import WEB_DIR
from server_util import ThreadServer, sse_events

MODEL = "tiny"
PROMPT = [0] + [(7 * j) % 300 + 2 for j in range(9)]


@pytest.fixture(scope="module")
def server(target_dir, noisy_draft):
    # a draft that agrees with the target often, not always: drafts accepted and rejected both
    ts = ThreadServer(ServerState(lambda: LLM(target_dir, draft=noisy_draft, num_speculative_tokens=4,
                                              preallocate=True, compile=False, policy="fixed"), MODEL))
    yield ts
    ts.stop()


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60, **kw)


def check_counts(origins: list[str], usage: dict, choices: int = 1, cut: bool = False) -> None:
    """Origins against the request's own figures: one prefill token per choice, one target token
    per step, one draft token per accepted draft (an eos or stop string may cut the last step)."""
    counts = Counter(origins)
    spec = usage["speculation"]
    assert set(counts) <= set(ORIGINS)
    assert len(origins) == usage["completion_tokens"]
    assert counts[PREFILL] == choices
    if cut:
        assert counts[DRAFT] <= spec["accepted_tokens"] and counts[TARGET] <= spec["num_steps"]
    else:
        assert counts[DRAFT] == spec["accepted_tokens"] and counts[TARGET] == spec["num_steps"]


def test_engine_records_each_tokens_origin(target_dir, noisy_draft):
    llm = LLM(target_dir, draft=noisy_draft, num_speculative_tokens=4, compile=False, policy="fixed")
    out, = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert len(out.token_origins) == len(out.token_ids) == 40
    counts = Counter(out.token_origins)
    assert out.token_origins[0] == PREFILL and counts[PREFILL] == 1
    assert counts[DRAFT] == out.stats.num_accepted_tokens > 0  # accepted and rejected drafts both happened
    assert counts[TARGET] == out.stats.num_steps and out.stats.num_accepted_tokens < out.stats.num_draft_tokens


def test_non_streaming_origins_equal_the_speculation_figures(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                                         "return_token_origins": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert len(choice["token_origins"]) == len(choice["token_ids"]) == len(choice["token_texts"]) == 40
    check_counts(choice["token_origins"], body["usage"])
    assert body["usage"]["speculation"]["accepted_tokens"] > 0
    assert "".join(choice["token_texts"]) == choice["text"]
    # without the flag, no extension fields
    plain = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                             "ignore_eos": True}).json()["choices"][0]
    assert "token_origins" not in plain and "token_texts" not in plain
    assert plain["text"] == choice["text"]


def test_streamed_origins_equal_the_non_streamed_ones_and_the_figures(server):
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "return_token_origins": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    events = sse_events(post(server, "/v1/completions", {**body, "stream": True,
                                                 "stream_options": {"include_usage": True}}).text)
    origins, texts = [], []
    for e in events[:-1]:
        c = e["choices"][0]
        assert len(c["token_origins"]) == len(c["token_texts"])
        origins += c["token_origins"]
        texts += c["token_texts"]
    assert origins == whole["token_origins"] and texts == whole["token_texts"]
    check_counts(origins, events[-1]["usage"])


def test_chat_with_n_choices_counts_over_the_choices(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "def add(a, b):"}],
                                              "max_tokens": 20, "temperature": 1.0, "seed": 5, "n": 3,
                                              "ignore_eos": True, "return_token_origins": True, "stream": True,
                                              "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    origins: list[str] = []
    for e in events[:-1]:
        for c in e["choices"]:
            origins += c.get("token_origins", [])
    check_counts(origins, events[-1]["usage"], choices=3)


def test_without_speculation_every_token_is_the_targets(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                         "num_speculative_tokens": 0, "return_token_origins": True}).json()
    assert r["choices"][0]["token_origins"] == [PREFILL] + [TARGET] * 11
    check_counts(r["choices"][0]["token_origins"], r["usage"])


def test_a_stop_string_cut_keeps_tokens_and_counts_consistent(server):
    whole = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                             "ignore_eos": True}).json()["choices"][0]["text"]
    stop = whole[len(whole) // 2: len(whole) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                                         "stop": [stop], "return_token_origins": True}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop"
    check_counts(choice["token_origins"], r["usage"], cut=True)
    assert "".join(choice["token_texts"]).startswith(choice["text"])  # the text ends inside the last token


def test_origins_flag_is_a_strict_boolean(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "return_token_origins": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_origins"


# ---- the page's files ---------------------------------------------------------------------

def test_page_is_served_open_with_a_strict_policy_and_off_with_no_web(target_dir):
    from starlette.testclient import TestClient

    state = ServerState(lambda: LLM(target_dir, method="none", compile=False, policy="fixed"), MODEL)
    with TestClient(build_app(state, api_key="sekret")) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
        for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):
            if not src.startswith("data:"):
                assert client.get("/" + src).status_code == 200, src
        assert client.get("/web/app.js").headers["content-type"].startswith("text/javascript")
        assert client.get("/web/nothing.js").status_code == 404
        assert client.get("/metrics").status_code == 200  # the server panel reads it without the key
        assert client.get("/v1/models").status_code == 401  # the API needs the key, page or not
    with TestClient(build_app(state, web=False)) as client:
        assert client.get("/").status_code == 404 and client.get("/web/app.js").status_code == 404


# the one absolute URL the page may name: the SVG namespace, an identifier that nothing fetches
NAMESPACES = {"http://www.w3.org/2000/svg"}


def test_the_page_names_no_outside_url():
    files = sorted(WEB_DIR.iterdir())
    assert {f.name for f in files} == {"index.html", "app.js", "style.css"}
    for f in files:
        text = f.read_text()
        for url in re.findall(r"(?i)(?:https?:)?//[^\s\"'`)<>]+", text):
            if url.startswith("//") and not re.match(r"//[\w.-]+\.[a-z]{2,}", url):
                continue  # a // comment, not a protocol-relative URL
            assert url in NAMESPACES, f"{f.name} names {url}"
        assert not re.search(r"(?i)@import|url\(\s*['\"]?(?!data:)", text), f"{f.name} loads a resource"
        # the page reaches the server by relative paths only
        for path in re.findall(r"""fetch\(\s*["'`]([^"'`]+)""", text):
            assert not path.startswith(("/", "http")), path


def test_the_page_is_package_data():
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '"server/web/*"' in text  # an installed wheel carries the page
