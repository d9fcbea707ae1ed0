"""`quickdraft bench-serve --workload chat` (quickdraft.bench.serve_load.chat): multi-turn
conversations against real servers, through httpx and through the official openai client, one
server with prefix caching and one without, paired turn by turn; and its pure aggregates."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from quickdraft.bench.serve_load.chat import TurnResult, paired, summary, system_prompt
from server_util import ServerProcess


@pytest.fixture(scope="module")
def servers(target_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("chat")
    common = ("--target", str(target_dir), "--method", "suffix", "-k", "3", "--served-model-name", "tiny")
    cached = ServerProcess(*common, "--prefix-cache-check", log=logs / "cached.log")
    try:
        plain = ServerProcess(*common, "--no-enable-prefix-caching", log=logs / "plain.log")
    except BaseException:
        cached.stop()
        raise
    yield cached, plain
    cached.stop()
    plain.stop()


def _app():
    from quickdraft.cli import app

    return app


@pytest.mark.parametrize("client, concurrency", [("httpx", 1), ("openai", 2)])
def test_chat_workload_against_a_cached_and_an_uncached_server(servers, client, concurrency, tmp_path):
    cached, plain = servers
    turns, conversations, max_tokens = 3, 2, 6
    r = CliRunner().invoke(_app(), [
        "bench-serve", "--workload", "chat", "--url", cached.url, "--compare-url", plain.url, "--client", client,
        "--turns", str(turns), "--conversations", str(conversations), "--concurrency", str(concurrency),
        "--system-words", "40",
        "--max-tokens", str(max_tokens), "--temperature", "0", "--out-dir", str(tmp_path), "--name", "chat",
        "--label", "cached", "--compare-label", "plain"])
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "chat.json").read_text())
    on, off = result["servers"]["url"], result["servers"]["compare_url"]
    for sv in (on, off):
        assert (sv["completed"], sv["errors"]) == (turns * conversations, 0), sv["error_samples"]
        assert sv["output_tokens"] == turns * conversations * max_tokens  # ignore_eos
        assert [t["completed"] for t in sv["turns"]] == [conversations] * turns
        assert sv["ttft"]["count"] == turns * conversations and sv["itl"]["count"] > 0
        assert sv["itl"]["median"] <= sv["itl"]["p99"]
    # every later turn resends the history: the cached server finds it; the other computes everything
    assert off["cached_tokens"] == 0 and off["hit_rate_metrics"] is None
    assert [t["cached_tokens"]["median"] > 0 for t in on["turns"][1:]] == [True] * (turns - 1)
    assert on["turns"][-1]["cached_tokens"]["median"] > on["turns"][1]["cached_tokens"]["median"]
    assert on["hit_rate_usage"] > 0.5
    # usage.cached_tokens and the server's /metrics counters tell the same hit rate (one client, one server)
    assert on["hit_rate_metrics"] == pytest.approx(on["hit_rate_usage"])
    assert on["speculation"]["draft_tokens"] == on["spec_metrics"]["num_draft_tokens"]
    # greedy: the cache changes nothing, so both servers answer every turn alike
    assert [t["same_text"] for t in result["paired"]["turns"]] == [conversations] * turns
    if concurrency == 1:  # the suffix proposer's tree holds every earlier answer: the same order, the same drafts
        assert on["speculation"]["accepted_tokens"] == off["speculation"]["accepted_tokens"]
    md = (tmp_path / "chat.md").read_text()
    assert "| turn | prompt tokens (median) |" in md and "plain TTFT /" in md and f"client {client}" in md


def test_chat_workload_bad_options_are_one_line_errors(tmp_path):
    for args, needle in ((["--client", "curl"], "--client"), (["--turns", "0"], "--turns"),
                         (["--request-rates", "2"], "--concurrency"), (["--concurrency", "1,2"], "one --concurrency")):
        r = CliRunner().invoke(_app(), ["bench-serve", "--workload", "chat", "--url", "http://127.0.0.1:9", *args,
                                        "--out-dir", str(tmp_path)])
        assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output
    assert not list(tmp_path.iterdir())


def _turn(c: int, t: int, server: str = "url", **kw) -> TurnResult:
    return TurnResult(conversation=c, turn=t, server=server, ok=True, **kw)


def test_summary_and_pairing_worked_example():
    rs = [_turn(0, 1, ttft=2.0, prompt_tokens=100, cached_tokens=0, itl=[0.1, 0.3], text="a",
                speculation={"draft_tokens": 4, "accepted_tokens": 2, "num_drafts": 2}),
          _turn(0, 2, ttft=0.5, prompt_tokens=150, cached_tokens=96, itl=[0.2], text="b",
                speculation={"draft_tokens": 4, "accepted_tokens": 3, "num_drafts": 1}),
          TurnResult(conversation=1, turn=1, server="url", error="HTTP 429: full")]
    s = summary(rs, 2, {"prefix_cache_queries_total": 10, "prefix_cache_hits_total": 0},
                {"prefix_cache_queries_total": 260, "prefix_cache_hits_total": 106}, duration=3.0)
    assert (s["completed"], s["errors"], s["error_samples"]) == (2, 1, ["HTTP 429: full"])
    assert s["hit_rate_usage"] == pytest.approx(96 / 250) and s["hit_rate_metrics"] == pytest.approx(106 / 250)
    assert s["speculation"]["acceptance_rate"] == pytest.approx(5 / 8)
    assert s["speculation"]["mean_acceptance_length"] == pytest.approx(1 + 5 / 3)
    assert s["itl"]["median"] == pytest.approx(0.2) and s["turns"][1]["ttft"]["median"] == 0.5
    other = [_turn(0, 1, "compare_url", ttft=4.0, text="a"), _turn(0, 2, "compare_url", ttft=2.0, text="c")]
    p = paired(rs + other, 2)["turns"]
    assert [(t["pairs"], t["ttft_ratio"]["median"], t["same_text"]) for t in p] == [(1, 2.0, 1), (1, 4.0, 0)]
    assert len(system_prompt(37).split()) == 37 and system_prompt(0) == ""
