"""The chat page in a real browser: headless Chromium (Debian's `chromium` package) driven by
playwright, against a real `quickdraft serve` of the bundled pair. The page's figures are
checked against the server's own answer to the same request, sent here without the browser.

Skips, saying why, where playwright's Python package or a system Chromium is missing
(.ci/run installs Chromium with apt-get; playwright's own browser download needs internet)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from server_util import ServerProcess

pytestmark = pytest.mark.slow

CHROMIUM = next((p for p in (os.environ.get("QUICKDRAFT_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser")) if p), None)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
if CHROMIUM is None:
    pytest.skip("no system Chromium (apt-get install chromium; or set QUICKDRAFT_CHROMIUM)", allow_module_level=True)

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 48
KEY = "page-test-key"
# ChatML, for the bundled code pair, which has no chat template of its own
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


class Page:
    """A page of the browser with every request it makes recorded."""

    def __init__(self, browser, url: str):
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.requests: list = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r))
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.goto(url + "/")

    def ask(self, prompt: str, **settings) -> dict:
        """Send `prompt` with the request settings given (the form's fields by id); the answer's
        figures (the stats' data-figures) once it finished."""
        p = self.page
        for field, value in settings.items():
            p.fill(f"#{field}", str(value))
        before = p.locator(".msg.assistant .stats").count()
        p.fill("#prompt", prompt)
        p.click("#send")
        p.locator(".msg.assistant .stats").nth(before).wait_for(timeout=120_000)
        return json.loads(p.locator(".msg.assistant .stats").nth(before).get_attribute("data-figures"))

    def last_answer(self):
        return self.page.locator(".msg.assistant").last

    def close(self) -> None:
        self.context.close()


def replay(url: str, path: str, body: dict, key: str | None = None) -> dict:
    """The server's own answer to the request the page sent (greedy, so the same tokens)."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + path, json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def sent(page: Page, path: str) -> dict:
    """The body of the last request the page posted to `path`."""
    posts = [r for r in page.requests if r.method == "POST" and r.url.endswith(path)]
    assert posts, f"the page posted nothing to {path}"
    return json.loads(posts[-1].post_data)


def check_answer(page: Page, figures: dict, answer: dict) -> None:
    """The page's tokens, origins and figures against the server's own answer."""
    choice, spec = answer["choices"][0], answer["usage"]["speculation"]
    spans = page.last_answer().locator(".body span.tok")
    origins = [spans.nth(i).get_attribute("data-origin") for i in range(spans.count())]
    assert origins == choice["token_origins"]  # token by token
    counts = Counter(origins)
    assert figures["counts"] == dict(counts)
    assert figures["tokens"] == figures["completion_tokens"] == answer["usage"]["completion_tokens"] == len(origins)
    assert counts["draft"] > 0 and counts["prefill"] == 1
    if choice["finish_reason"] == "length":
        assert counts["draft"] == spec["accepted_tokens"] and counts["target"] == spec["num_steps"]
    else:  # an eos may cut the last step's tokens short (docs/server.md): its drafts, its target token
        assert counts["draft"] <= spec["accepted_tokens"] and counts["target"] <= spec["num_steps"]
        assert counts["draft"] + counts["target"] >= spec["accepted_tokens"] + spec["num_steps"] - 1 - (
            max(len(spec["accepted_per_position"]), 1))  # only the last step's tokens
    for name in ("method", "num_drafts", "draft_tokens", "accepted_tokens", "acceptance_rate",
                 "mean_acceptance_length", "accepted_per_position", "num_steps"):
        assert figures[name] == spec[name], name
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert page.last_answer().locator(".body").inner_text() == text
    stats = page.last_answer().locator(".stats")
    assert stats.locator("[data-key=mean_acceptance_length] b").inner_text() == f"{spec['mean_acceptance_length']:.2f}"
    assert stats.locator("[data-key=acceptance_rate] b").inner_text() == f"{100 * spec['acceptance_rate']:.1f}%"
    assert stats.locator("svg rect").count() == len(spec["accepted_per_position"])  # the per-position chart
    assert figures["tokens_per_s"] > 0


def check_local(page: Page, url: str) -> None:
    """Every request the page made went to its own server; no script error."""
    assert page.requests
    outside = [r.url for r in page.requests if not (r.url.startswith(url + "/") or r.url.startswith("data:"))]
    assert not outside, outside
    assert not page.errors, page.errors


def test_page_chats_with_the_bundled_pair_and_shows_each_tokens_origin(browser, tmp_path):
    started = time.monotonic()
    server = ServerProcess("--no-compile", "--max-num-seqs", "4", log=tmp_path / "server.log")
    try:
        page = Page(browser, server.url)
        p = page.page
        p.locator("#model").filter(has_text="quickdraft-default").wait_for(timeout=30_000)
        figures = page.ask(PROMPT, temperature=0, max_tokens=MAX_TOKENS)
        # the bundled pair has no chat template: the page fell back to a completion
        body = sent(page, "/v1/completions")
        assert body["prompt"] == PROMPT and body["return_token_origins"] is True and body["max_tokens"] == MAX_TOKENS
        check_answer(page, figures, replay(server.url, "/v1/completions", body))
        # the server panel, from /metrics
        p.locator("#s-rate").filter(has_text="%").wait_for(timeout=10_000)
        p.locator("#s-running").filter(has_text=re.compile(r"^0$")).wait_for(timeout=10_000)
        assert p.locator("#s-step").inner_text().endswith(" ms")
        assert p.locator("#s-method").inner_text() == "draft"
        assert p.locator("#s-chart svg rect").count() > 0
        p.screenshot(path=str(tmp_path / "web.png"))
        assert (tmp_path / "web.png").stat().st_size > 10_000

        # k = 0 beside it: plain decoding, every token the target's but the first
        page.last_answer().locator(".actions button").click()
        p.locator(".msg.assistant .stats").nth(1).wait_for(timeout=120_000)
        plain = json.loads(p.locator(".msg.assistant .stats").nth(1).get_attribute("data-figures"))
        assert sent(page, "/v1/completions")["num_speculative_tokens"] == 0
        assert plain["counts"] == {"prefill": 1, "target": MAX_TOKENS - 1} and plain["num_drafts"] == 0
        speedup = p.locator(".msg.assistant").nth(1).locator("[data-key=speedup] b").inner_text()
        assert speedup == f"{figures['tokens_per_s'] / plain['tokens_per_s']:.2f}×"

        # stop: the answer ends where it was, the server drops the request
        p.fill("#max_tokens", "1000")
        p.fill("#prompt", "class Matrix:")
        p.click("#send")
        p.locator(".msg.assistant").nth(2).locator("span.tok").nth(3).wait_for(timeout=60_000)
        p.click("#stop")
        stopped = p.locator(".msg.assistant").nth(2).locator(".stats")
        stopped.wait_for(timeout=10_000)
        assert stopped.locator("[data-key=finish] b").inner_text() == "stopped"
        deadline = time.monotonic() + 20
        while httpx.get(server.url + "/metrics").text.count("\nnum_requests_running 0.0") == 0:
            assert time.monotonic() < deadline, "the stopped request still runs"
            time.sleep(0.2)

        # the conversation stays in the browser: a reload shows it again
        p.reload()
        p.locator(".msg.assistant .stats").nth(2).wait_for(timeout=10_000)
        assert p.locator(".msg").count() == 5  # 2 prompts, 3 answers
        page.close()
        check_local(page, server.url)
    finally:
        server.stop()
    print(f"browser test: {time.monotonic() - started:.1f} s")


def test_page_with_an_api_key(browser, tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = ServerProcess("--no-compile", "--max-num-seqs", "4", "--api-key", KEY, "--chat-template", str(template),
                           log=tmp_path / "server.log")
    try:
        assert httpx.get(server.url + "/").status_code == 200  # the page itself carries no data: open
        page = Page(browser, server.url)
        p = page.page
        dialog = p.locator("#key-dialog")
        dialog.wait_for(state="visible", timeout=30_000)  # /v1/models answered 401
        p.fill("#key", "wrong")
        p.click("#key-form button")
        p.locator("#key-error").filter(has_text="invalid API key").wait_for(timeout=10_000)
        p.fill("#key", KEY)
        p.click("#key-form button")
        p.locator("#model").filter(has_text="quickdraft-default").wait_for(timeout=10_000)
        p.fill("#system", "You write Python.")
        figures = page.ask(PROMPT, temperature=0, max_tokens=24)
        body = sent(page, "/v1/chat/completions")  # a chat template: chat, with the system prompt
        assert body["messages"] == [{"role": "system", "content": "You write Python."},
                                    {"role": "user", "content": PROMPT}]
        check_answer(page, figures, replay(server.url, "/v1/chat/completions", body, key=KEY))
        # the key went in the Authorization header of every API call, never in a URL or localStorage
        api = [r for r in page.requests if "/v1/" in r.url]
        assert all(KEY not in r.url for r in page.requests)
        assert api[-1].headers.get("authorization") == f"Bearer {KEY}"
        assert KEY not in json.dumps(p.evaluate("Object.assign({}, localStorage)"))
        assert p.evaluate("sessionStorage.getItem('quickdraft.apiKey')") == KEY
        page.close()
        check_local(page, server.url)
    finally:
        server.stop()


@pytest.mark.smollm2
def test_page_chats_with_smollm2_a_gguf_target(browser, tmp_path):
    """A chat model from a GGUF file (its own chat template), speculating with n-grams."""
    from conftest import need_smollm2

    need_smollm2()
    server = ServerProcess("--target", "smollm2", "--method", "ngram", "--no-compile", "--max-num-seqs", "2",
                           log=tmp_path / "server.log")
    try:
        page = Page(browser, server.url)
        page.page.locator("#model").filter(has_text="smollm2").wait_for(timeout=30_000)
        figures = page.ask("Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
                           temperature=0, max_tokens=48)
        body = sent(page, "/v1/chat/completions")
        assert [m["role"] for m in body["messages"]] == ["user"]
        check_answer(page, figures, replay(server.url, "/v1/chat/completions", body))
        assert figures["method"] == "ngram"
        page.close()
        check_local(page, server.url)
    finally:
        server.stop()
