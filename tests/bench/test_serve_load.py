"""`quickdraft bench-serve`: the pure parts on worked examples (percentiles, Poisson arrivals,
SSE parsing, Prometheus parsing, per-request timings, aggregates), one-line errors, and an
end-to-end run against a real `quickdraft serve` process."""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from quickdraft.errors import QuickdraftError
from quickdraft.bench.serve_load.client import base_url
from quickdraft.bench.serve_load.launch import free_port, served
from quickdraft.bench.serve_load.stats import (Chunk, RequestResult, SSEDecoder, aggregate, apportion, crossover,
                                               meets_slo, parse_prometheus, percentile, poisson_schedule,
                                               request_timings, spec_counters, spec_summary, summarize)
from quickdraft.cli.bench_serve import bench_serve_command
from quickdraft.cli.common import parse_values

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- percentiles

def test_percentile_interpolates_between_order_statistics():
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([10.0, 20.0], 99) == pytest.approx(19.9)  # rank 0.99 of the way from 10 to 20
    assert percentile([10.0, 20.0, 30.0], 75) == pytest.approx(25.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_worked_example():
    s = summarize([1.0, 2.0, 3.0, 10.0])
    assert s["mean"] == pytest.approx(4.0)
    assert s["median"] == pytest.approx(2.5)
    assert s["p99"] == pytest.approx(3.0 + 7.0 * 0.97)  # rank 2.97
    assert s["count"] == 4
    assert summarize([]) == {"mean": None, "median": None, "p99": None, "count": 0}


# ---------------------------------------------------------------------------- arrivals

def test_poisson_schedule_is_seeded_starts_at_zero_and_increases():
    a = poisson_schedule(50, 3.0, seed=1)
    assert a == poisson_schedule(50, 3.0, seed=1)
    assert a != poisson_schedule(50, 3.0, seed=2)
    assert a[0] == 0.0 and len(a) == 50
    assert all(x < y for x, y in zip(a, a[1:]))


def test_poisson_gaps_are_exponential_with_mean_one_over_rate():
    rate = 4.0
    t = poisson_schedule(20001, rate, seed=0)
    gaps = [y - x for x, y in zip(t, t[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.03)  # not rate itself, not a fixed gap
    # exponential: standard deviation = mean, and P(gap > mean) = 1/e
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)
    assert sum(g > 1 / rate for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)


def test_poisson_schedule_infinite_rate_and_bad_rates():
    assert poisson_schedule(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(QuickdraftError):
            poisson_schedule(3, bad, seed=0)


def test_parse_values():
    assert parse_values("1, 2 4,inf", "--request-rates") == [1.0, 2.0, 4.0, math.inf]
    assert parse_values("8,2", "--concurrency", integer=True) == [8, 2]
    for text, integer in (("0", False), ("-1", False), ("x", False), ("2.5", True), ("", False), ("nan", False)):
        with pytest.raises(QuickdraftError):
            parse_values(text, "--request-rates", integer)


def test_base_url():
    assert base_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert base_url(" http://localhost:8000/v1/ ") == "http://localhost:8000"
    assert base_url("https://example.org/prefix") == "https://example.org/prefix"
    for bad in ("localhost:8000", "ftp://host", "http://", "not a url", "http://[::1"):
        with pytest.raises(QuickdraftError):
            base_url(bad)


# ---------------------------------------------------------------------------- parsing

def test_sse_decoder_across_split_reads():
    d = SSEDecoder()
    assert d.feed('data: {"a": 1}\n') == []
    assert d.feed('\nda') == ['{"a": 1}']
    assert d.feed('ta: [DONE]\n\n') == ["[DONE]"]


def test_sse_decoder_line_ends_comments_and_multiline_data():
    d = SSEDecoder()
    text = ": keep-alive\r\n\r\nevent: x\r\ndata:first\r\ndata: second\r\nid: 3\r\n\r\ndata: z\n\n"
    assert d.feed(text) == ["first\nsecond", "z"]
    # CRLF split between reads must not end the event early
    d = SSEDecoder()
    assert d.feed("data: a\r") == []
    assert d.feed("\n\r\n") == ["a"]


def test_parse_prometheus_sums_label_sets():
    text = """# HELP spec_decode_num_drafts_total Steps.
# TYPE spec_decode_num_drafts_total counter
spec_decode_num_drafts_total 12.0
spec_decode_num_draft_tokens_total 40
spec_decode_num_accepted_tokens_total{model="m"} 25.0
spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0
spec_decode_num_accepted_tokens_per_pos_total{position="1"} 7.0
generation_tokens_total 100.0
weird_total{a="x y} z"} 3.0
"""
    m = parse_prometheus(text)
    assert m["spec_decode_num_drafts_total"] == 12.0
    assert m["spec_decode_num_accepted_tokens_per_pos_total"] == 16.0
    assert m["weird_total"] == 3.0
    assert spec_counters(m) == {"spec_decode_num_drafts": 12.0, "spec_decode_num_draft_tokens": 40.0,
                                "spec_decode_num_accepted_tokens": 25.0, "generation_tokens": 100.0}
    assert spec_counters(parse_prometheus("up 1\n")) is None


def test_parse_prometheus_reads_prometheus_client_output():
    pc = pytest.importorskip("prometheus_client")
    from prometheus_client.core import CounterMetricFamily

    class C:
        def collect(self):
            yield CounterMetricFamily("spec_decode_num_drafts", "d", value=7)
            yield CounterMetricFamily("spec_decode_num_draft_tokens", "d", value=21)
            yield CounterMetricFamily("spec_decode_num_accepted_tokens", "d", value=14)

    reg = pc.CollectorRegistry()
    reg.register(C())
    counters = spec_counters(parse_prometheus(pc.generate_latest(reg).decode()))
    assert counters == {"spec_decode_num_drafts": 7.0, "spec_decode_num_draft_tokens": 21.0,
                        "spec_decode_num_accepted_tokens": 14.0}


def test_spec_summary_worked_example():
    before = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
              "spec_decode_num_accepted_tokens": 20, "generation_tokens": 100}
    after = {"spec_decode_num_drafts": 30, "spec_decode_num_draft_tokens": 120,
             "spec_decode_num_accepted_tokens": 80, "generation_tokens": 250}
    s = spec_summary(before, after)
    assert (s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (20, 80, 60)
    assert s["acceptance_rate"] == pytest.approx(0.75)  # 60 / 80
    assert s["mean_acceptance_length"] == pytest.approx(4.0)  # 1 + 60 / 20
    assert s["server_generation_tokens"] == 150
    flat = spec_summary(after, after)
    assert flat["acceptance_rate"] is None and flat["mean_acceptance_length"] is None
    assert spec_summary(None, after)["acceptance_rate"] is None


# ---------------------------------------------------------------------------- per request

def test_apportion_worked_examples():
    assert apportion(5, [1, 3, 1]) == [1, 3, 1]
    assert apportion(7, [2, 2, 4]) == [2, 2, 3]  # 1 each, then 4 more in proportion 1:1:2
    assert apportion(3, [0, 5, 0, 5]) == [0, 2, 0, 1]  # the tie goes to the earlier chunk
    assert apportion(1, [3, 3]) == [1, 0]
    assert apportion(0, [3, 3]) == [0, 0]
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([0, 1, 2, 5, 17]) for _ in range(rng.randint(1, 9))]
        total = rng.randint(0, 40)
        c = apportion(total, lengths)
        m = sum(n > 0 for n in lengths)
        assert sum(c) == min(total, total if m else 0)
        assert all(x == 0 for x, n in zip(c, lengths) if n == 0)
        if total >= m:
            assert all(x >= 1 for x, n in zip(c, lengths) if n > 0)


def test_request_timings_with_chunk_token_counts():
    chunks = [Chunk(0.5, "a", 1), Chunk(0.6, "bcd", 3), Chunk(0.9, "e", 1), Chunk(0.95, "", 0)]
    t = request_timings(chunks, end=1.0, usage_tokens=5)
    assert t["ttft"] == pytest.approx(0.5)
    assert t["itl"] == pytest.approx([0.1 / 3] * 3 + [0.3])  # a 3-token chunk's gap split 3 ways
    assert t["tpot"] == pytest.approx((1.0 - 0.5) / 4)
    assert t["e2e"] == 1.0 and t["output_tokens"] == 5 and t["token_source"] == "chunk"


def test_request_timings_apportions_usage_without_chunk_counts():
    chunks = [Chunk(0.2, "", None), Chunk(0.5, "ab", None), Chunk(0.7, "cdef", None), Chunk(0.8, "", None)]
    t = request_timings(chunks, end=0.8, usage_tokens=5)  # 1 each, then 3 more by characters 2:4 -> [2, 3]
    assert t["ttft"] == pytest.approx(0.5)  # the first chunk with text, not the first chunk
    assert t["itl"] == pytest.approx([0.2 / 3] * 3)  # the first chunk's 2 tokens arrive within TTFT
    assert t["output_tokens"] == 5 and t["token_source"] == "usage-apportioned"
    assert t["tpot"] == pytest.approx(0.3 / 4)


def test_request_timings_single_token_and_unknown_counts():
    t = request_timings([Chunk(0.25, "x", None)], end=0.3, usage_tokens=1)
    assert t["ttft"] == 0.25 and t["tpot"] is None and t["itl"] == []
    with pytest.raises(ValueError):
        request_timings([Chunk(0.25, "x", None)], end=0.3, usage_tokens=None)


def _req(i, ttft, tpot, n, itl, ok=True):
    return RequestResult(index=i, prompt_index=i, send_s=0.0, ok=ok, ttft=ttft, tpot=tpot, e2e=ttft + tpot * (n - 1),
                         itl=itl, output_tokens=n, prompt_tokens=10, usage_tokens=n, token_source="chunk")


def test_aggregate_worked_example():
    rs = [_req(0, 0.1, 0.02, 11, [0.02] * 10), _req(1, 0.3, 0.05, 11, [0.05] * 10),
          _req(2, 0.2, 0.01, 21, [0.01] * 20),
          RequestResult(index=3, prompt_index=3, send_s=0.0, error="HTTP 500: boom")]
    a = aggregate(rs, duration=2.0, slo_ttft_ms=250, slo_tpot_ms=30)
    assert (a["num_requests"], a["completed"], a["errors"]) == (4, 3, 1)
    assert a["request_throughput"] == pytest.approx(1.5)
    assert a["output_throughput"] == pytest.approx(43 / 2.0)
    assert a["total_prompt_tokens"] == 30
    assert a["ttft"]["mean"] == pytest.approx(0.2) and a["ttft"]["median"] == pytest.approx(0.2)
    assert a["tpot"]["median"] == pytest.approx(0.02)
    # pooled over all 40 tokens (20 at 10 ms, 10 at 20 ms, 10 at 50 ms), not a median of medians (20 ms)
    assert a["itl"]["count"] == 40 and a["itl"]["median"] == pytest.approx(0.015)
    assert a["itl"]["p99"] == pytest.approx(0.05)
    assert a["itl"]["mean"] == pytest.approx((0.2 + 0.5 + 0.2) / 40)
    assert a["e2e"]["median"] == pytest.approx(0.4)  # 0.3, 0.4, 0.8
    assert a["slo_met"] == 2 and a["goodput"] == pytest.approx(1.0)  # request 1 misses both SLOs
    assert aggregate(rs, 2.0)["goodput"] is None


def test_slo_edge_cases():
    one = RequestResult(index=0, prompt_index=0, send_s=0, ok=True, ttft=0.1, tpot=None, e2e=0.1, output_tokens=1)
    assert meets_slo(one, 200, 1)  # one token: no TPOT to miss
    assert not meets_slo(one, 50, None)
    assert not meets_slo(RequestResult(index=1, prompt_index=0, send_s=0, error="x"), None, None)


def test_crossover_interpolates_where_speculation_stops_paying():
    rates = [1, 2, 4, 8]
    plain = [10.0, 10.0, 12.0, 20.0]
    spec = [6.0, 7.0, 10.0, 26.0]  # 2 ms better at 4 req/s, 6 ms worse at 8: crosses a quarter of the way
    assert crossover(rates, plain, spec) == {"status": "crossed", "rate": pytest.approx(5.0), "pays_again_at": []}
    assert crossover(rates[::-1], plain[::-1], spec[::-1])["rate"] == pytest.approx(5.0)  # order does not matter
    assert crossover(rates, plain, [5, 5, 5, 5]) == {"status": "still-pays", "rate": None, "pays_again_at": []}
    assert crossover(rates, plain, [10, 5, 5, 5]) == {"status": "never-paid", "rate": None, "pays_again_at": []}
    c = crossover(rates, plain, [6, 10, 12, 19])  # equal at 2 req/s = stopped paying; below again at 8
    assert c == {"status": "crossed", "rate": pytest.approx(2.0), "pays_again_at": [8]}
    assert crossover(rates, [None] * 4, spec)["status"] is None


# ---------------------------------------------------------------------------- the command

def _app():
    app = typer.Typer()
    app.command()(bench_serve_command)
    return app


@pytest.mark.parametrize("args, needle", [
    (["--url", "http://127.0.0.1:{port}"], "not reachable"),
    (["--url", "localhost"], "--url"),
    (["--url", "http://127.0.0.1:{port}", "--request-rates", "1", "--concurrency", "2"], "not both"),
    (["--url", "http://127.0.0.1:{port}", "--request-rates", "0"], "> 0"),
    (["--url", "http://127.0.0.1:{port}", "--num-requests", "0"], "--num-requests"),
    (["--url", "http://127.0.0.1:{port}", "--slo-tpot-ms", "-3"], "--slo-tpot-ms"),
])
def test_errors_are_one_line_exit_2(args, needle, tmp_path):
    port = free_port()  # nothing listens there
    args = [a.format(port=port) for a in args]
    r = CliRunner().invoke(_app(), [*args, "--out-dir", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------- end to end

@contextlib.contextmanager
def serve(*args, timeout: float = 240):
    """A real `quickdraft serve` process on a free port; yields its base URL."""
    with served(list(args), timeout=timeout) as (url, _):
        yield url


@pytest.mark.skipif(not (ROOT / "quickdraft" / "server" / "app.py").exists(),
                    reason="quickdraft/server/app.py (the server) is not written yet")
@pytest.mark.slow
def test_end_to_end_against_a_real_server(tmp_path):
    max_tokens, k = 12, 3
    with serve("--method", "draft", "-k", str(k)) as url:
        r = CliRunner().invoke(_app(), ["--url", url, "--request-rates", "8", "--num-requests", "6",
                                        "--max-tokens", str(max_tokens), "--slo-ttft-ms", "60000",
                                        "--slo-tpot-ms", "60000", "--out-dir", str(tmp_path), "--name", "e2e",
                                        "--label", "draft k=3"])
        conc = CliRunner().invoke(_app(), ["--url", url + "/v1/", "--concurrency", "2", "--num-requests", "3",
                                           "--max-tokens", "4", "--warmup", "0", "--out-dir", str(tmp_path),
                                           "--name", "conc"])
        bad_model = CliRunner().invoke(_app(), ["--url", url, "--model", "nope", "--num-requests", "1",
                                                "--out-dir", str(tmp_path / "bad")])
        too_long = CliRunner().invoke(_app(), ["--url", url, "--warmup", "0", "--num-requests", "2",
                                               "--max-tokens", "100000", "--out-dir", str(tmp_path / "bad")])
    assert bad_model.exit_code == 2 and "warm-up request failed: HTTP 404" in bad_model.output, bad_model.output
    assert too_long.exit_code == 2 and "every request failed, e.g. HTTP 400" in too_long.output, too_long.output
    assert not (tmp_path / "bad").exists()
    assert conc.exit_code == 0, conc.output
    (c,) = json.loads((tmp_path / "conc.json").read_text())["runs"]
    assert c["concurrency"] == 2 and c["request_rate"] is None and c["completed"] == 3
    assert c["total_output_tokens"] == 12
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert "| draft k=3 | 8 req/s | 6/0 |" in (tmp_path / "e2e.md").read_text()
    (run,) = result["runs"]
    assert (run["num_requests"], run["completed"], run["errors"]) == (6, 6, 0)
    reqs = run["requests"]
    assert [q["index"] for q in reqs] == list(range(6))
    for q in reqs:
        assert q["ok"] and q["error"] is None
        assert q["output_tokens"] == q["usage_tokens"] == max_tokens  # ignore_eos: exactly max_tokens
        assert q["prompt_tokens"] > 0
        assert 0 < q["ttft"] <= q["e2e"]
        assert q["tpot"] * (max_tokens - 1) == pytest.approx(q["e2e"] - q["ttft"])
        assert 1 <= len(q["itl"]) <= max_tokens - 1 and min(q["itl"]) >= 0
        assert sum(q["itl"]) <= q["e2e"] - q["ttft"] + 1e-9
    assert run["total_output_tokens"] == 6 * max_tokens
    assert run["token_count_mismatches"] == 0
    assert run["slo_met"] == 6 and run["goodput"] == pytest.approx(run["request_throughput"])
    for m in ("ttft", "tpot", "itl", "e2e"):
        s = run[m]
        assert s["median"] <= s["p99"], m
        assert s["count"] == (sum(len(q["itl"]) for q in reqs) if m == "itl" else 6)
    assert run["ttft"]["median"] <= run["e2e"]["median"]
    assert run["output_throughput"] == pytest.approx(6 * max_tokens / run["duration_s"])
    spec = run["spec"]
    assert spec["num_draft_tokens"] > 0 and 0 <= spec["acceptance_rate"] <= 1
    assert 1 <= spec["mean_acceptance_length"] <= k + 1
    # the server's own count of generated tokens over the run matches the usage it reported
    if spec["server_generation_tokens"] is not None:
        assert spec["server_generation_tokens"] == 6 * max_tokens
