"""`quickdraft bench-serve`: a load generator for a running OpenAI-compatible server.

Requests go to POST /v1/completions with `stream: true` and `stream_options.include_usage`,
either as a Poisson process at a request rate (exponential gaps from a seeded RNG; `inf`
sends all at once) or from a fixed number of clients sending back to back. Prompts are the
built-in held-out workloads of `quickdraft bench` or a JSONL file of {"prompt": ...}.

Per request: time to first token (TTFT: arrival of the first chunk with non-empty text),
end-to-end latency (E2E: until `data: [DONE]`), time per output token
(TPOT = (E2E - TTFT) / (n - 1)), and inter-token latencies (ITL). Speculative decoding
sends several tokens in one chunk, so one chunk's gap is split evenly over its tokens: a
chunk of 3 tokens 30 ms after the previous one gives three ITLs of 10 ms (the sum of the
ITLs is then the time from the first chunk to the last, and TPOT and mean ITL agree).
Tokens in the first chunk arrive within TTFT and have no ITL. Tokens per chunk are read
from the chunk when the server sends them (`token_ids` in the choice, which vLLM sends
for the extra field `return_token_ids: true`; requested unless --no-return-token-ids, and
ignored by servers that do not know it); otherwise the request's `usage.completion_tokens`
is apportioned over the chunks by their text length (each chunk with text gets at least
one token), an estimate that the results name (`token_source`). Output token counts
always come from `usage` when the server sends it.

Aggregates per run: mean, median and p99 of TTFT, TPOT, ITL and E2E; request and output
token throughput over the run's wall time; goodput, the requests per second that met every
SLO given (--slo-ttft-ms, --slo-tpot-ms). /metrics is scraped before and after each run:
acceptance rate = accepted / drafted tokens and mean acceptance length = 1 + accepted /
drafts (per drafting step, as vLLM reports it) over the run.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import typer

from ..errors import QuickdraftError

SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
GENERATION_TOKENS = "generation_tokens"  # the server's count of tokens it generated, to check usage against
METRICS = ("ttft", "tpot", "itl", "e2e")  # seconds in the results, milliseconds in the tables


# ----------------------------------------------------------------------------- pure functions

def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default); None for no values."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: list[float]) -> dict:
    """mean, median and p99 (None each when there are no values) and the count."""
    return {"mean": statistics.fmean(values) if values else None, "median": percentile(values, 50),
            "p99": percentile(values, 99), "count": len(values)}


def poisson_schedule(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of `n` requests arriving as a Poisson process at
    `rate` requests/s: the first at 0, then exponential gaps of mean 1 / rate. `inf` = all at 0."""
    if n < 0 or not rate > 0:
        raise QuickdraftError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


class SSEDecoder:
    """Incremental server-sent events parser: feed text as it arrives, get the `data`
    payloads of the events it completed (multi-line data joined by newlines; comments and
    other fields ignored; LF, CRLF or CR line ends)."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []

    def feed(self, text: str) -> list[str]:
        self._buf += text
        out = []
        while True:
            cut = min((i for i in (self._buf.find("\r"), self._buf.find("\n")) if i >= 0), default=-1)
            if cut < 0 or (self._buf[cut] == "\r" and cut == len(self._buf) - 1):
                break  # no full line yet (a lone trailing CR may be half of a CRLF)
            line = self._buf[:cut]
            self._buf = self._buf[cut + (2 if self._buf.startswith("\r\n", cut) else 1):]
            if line == "":
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: value summed over its label sets}."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            rest = rest.rsplit("}", 1)[-1]
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            v = float(parts[0])
        except ValueError:
            continue
        values[name.strip()] = values.get(name.strip(), 0.0) + v
    return values


def spec_counters(metrics: dict[str, float]) -> dict[str, float] | None:
    """The speculative decoding counters and generation_tokens (with or without the
    `_total` suffix) that the server exports, or None when it exports none of them."""
    out = {}
    for name in (*SPEC_COUNTERS, GENERATION_TOKENS):
        for key in (name + "_total", name):
            if key in metrics:
                out[name] = metrics[key]
                break
    return out if out else None


def spec_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """Acceptance over a run from two counter snapshots; rates are None when nothing was drafted."""
    if before is None or after is None:
        return {"num_drafts": None, "num_draft_tokens": None, "num_accepted_tokens": None,
                "acceptance_rate": None, "mean_acceptance_length": None, "server_generation_tokens": None}
    d = {name: after[name] - before[name] if name in before and name in after else None
         for name in (*SPEC_COUNTERS, GENERATION_TOKENS)}
    drafts, drafted, accepted = (d[n] for n in SPEC_COUNTERS)
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted and accepted is not None else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts and accepted is not None else None,
            "server_generation_tokens": d[GENERATION_TOKENS]}


def chunk_token_count(choice: dict) -> int | None:
    """Tokens carried by one streamed choice when the server says (`token_ids`), else None."""
    ids = choice.get("token_ids")
    return len(ids) if isinstance(ids, list) else None


def apportion(total: int, lengths: list[int]) -> list[int]:
    """Split `total` tokens over chunks of text `lengths` (characters) in proportion to
    length, rounded so the counts add up to `total` (largest remainder, ties to the earlier
    chunk), every non-empty chunk getting at least one and empty chunks none. With fewer
    tokens than non-empty chunks the earliest chunks get one each."""
    counts = [0] * len(lengths)
    nonempty = [i for i, n in enumerate(lengths) if n > 0]
    if total <= 0 or not nonempty:
        return counts
    if total < len(nonempty):
        for i in nonempty[:total]:
            counts[i] = 1
        return counts
    chars = sum(lengths)
    ideal = {i: total * lengths[i] / chars for i in nonempty}
    for i in nonempty:
        counts[i] = max(1, math.floor(ideal[i]))
    left = total - sum(counts)
    while left > 0:  # the most under-served chunk gets the next token
        i = min(nonempty, key=lambda i: (counts[i] - ideal[i], i))
        counts[i] += 1
        left -= 1
    while left < 0:  # the floor of one per chunk overshot: take from the most over-served
        i = max((i for i in nonempty if counts[i] > 1), key=lambda i: (counts[i] - ideal[i], -i))
        counts[i] -= 1
        left += 1
    return counts


@dataclass
class Chunk:
    t: float  # seconds since the request was sent
    text: str  # the text delta
    tokens: int | None  # tokens it carries, when the server says


@dataclass
class RequestResult:
    index: int  # request number in the run
    prompt_index: int
    send_s: float  # when it was sent, seconds from the run's start
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds
    e2e: float | None = None
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_tokens: int | None = None  # usage.completion_tokens as the server reported it
    chunk_tokens: int | None = None  # sum of per-chunk token counts, when the server sends them
    num_chunks: int = 0
    token_source: str | None = None  # "chunk" (counts sent per chunk) or "usage-apportioned"


def request_timings(chunks: list[Chunk], end: float, usage_tokens: int | None) -> dict:
    """TTFT, ITLs, TPOT, E2E and the output token count of one streamed request from its
    chunks (in arrival order, each with a choice), the time the stream ended and
    `usage.completion_tokens`. See the module docstring for the conventions."""
    if all(c.tokens is not None for c in chunks) and chunks:
        counts, source = [c.tokens for c in chunks], "chunk"
    elif usage_tokens is not None:
        counts, source = apportion(usage_tokens, [len(c.text) for c in chunks]), "usage-apportioned"
    else:
        raise ValueError("token counts unknown: the server sent neither per-chunk counts nor usage")
    n = usage_tokens if usage_tokens is not None else sum(counts)
    first = next((i for i, c in enumerate(chunks) if c.text), None)
    if first is None:
        return {"ttft": None, "itl": [], "tpot": None, "e2e": end, "output_tokens": n, "token_source": source}
    ttft = chunks[first].t
    itl: list[float] = []
    prev = ttft
    for c, k in zip(chunks[first + 1:], counts[first + 1:]):
        if k > 0:
            itl.extend([(c.t - prev) / k] * k)
            prev = c.t
    tpot = (end - ttft) / (n - 1) if n > 1 else None
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "e2e": end, "output_tokens": n, "token_source": source}


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A successful request within every SLO given (a one-token request has no TPOT: met)."""
    if not r.ok:
        return False
    if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1e3 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1e3 > slo_tpot_ms:
        return False
    return True


def aggregate(results: list[RequestResult], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """Run-level figures over the successful requests; throughputs over `duration` seconds."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    agg = {
        "num_requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "goodput": None, "slo_met": None,
        "error_samples": sorted({r.error for r in results if r.error})[:3],
        "token_sources": sorted({r.token_source for r in ok if r.token_source}),
        "token_count_mismatches": sum(1 for r in ok if r.chunk_tokens is not None and r.usage_tokens is not None
                                      and r.chunk_tokens != r.usage_tokens),
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        met = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
        agg["slo_met"] = met
        agg["goodput"] = met / duration if duration > 0 else None
    agg["ttft"] = summarize([r.ttft for r in ok if r.ttft is not None])
    agg["tpot"] = summarize([r.tpot for r in ok if r.tpot is not None])
    agg["itl"] = summarize([x for r in ok for x in r.itl])
    agg["e2e"] = summarize([r.e2e for r in ok if r.e2e is not None])
    return agg


def crossover(rates: list[float], baseline: list[float], spec: list[float]) -> dict:
    """Where speculation stops paying: the request rate at which `spec` (a latency such as
    median TPOT, lower is better) first reaches `baseline`, linearly interpolated between
    the measured rates around the sign change. `status` is "crossed", "never-paid" (no
    better at the lowest rate) or "still-pays" (better at every measured rate)."""
    pairs = sorted((r, s - b) for r, b, s in zip(rates, baseline, spec) if b is not None and s is not None)
    if not pairs:
        return {"status": None, "rate": None, "pays_again_at": []}
    if pairs[0][1] >= 0:
        return {"status": "never-paid", "rate": None, "pays_again_at": []}
    for i, ((r0, d0), (r1, d1)) in enumerate(zip(pairs, pairs[1:])):
        if d1 >= 0:
            return {"status": "crossed", "rate": r0 + (r1 - r0) * (-d0) / (d1 - d0),
                    "pays_again_at": [r for r, d in pairs[i + 2:] if d < 0]}  # noise, or a second regime
    return {"status": "still-pays", "rate": None, "pays_again_at": []}


def parse_values(text: str, name: str, integer: bool = False) -> list[float]:
    """'1,2, 4 inf' -> [1.0, 2.0, 4.0, inf] in the given order; every value > 0."""
    out = []
    for t in text.replace(",", " ").split():
        try:
            v = int(t) if integer else float(t)
        except ValueError:
            raise QuickdraftError(f"{name} expects {'integers' if integer else 'numbers'} separated by commas, "
                                  f"got {text!r}") from None
        if not v > 0 or (isinstance(v, float) and math.isnan(v)):
            raise QuickdraftError(f"{name} values must be > 0, got {t}")
        out.append(v)
    if not out:
        raise QuickdraftError(f"{name} is empty")
    return out


def base_url(url: str) -> str:
    """Validate a server URL and return it without a trailing slash or /v1."""
    import httpx

    try:
        u = httpx.URL(url.strip())
    except Exception:  # noqa: BLE001  (httpx raises several types for malformed URLs)
        raise QuickdraftError(f"--url is not a valid URL: {url!r}") from None
    if u.scheme not in ("http", "https") or not u.host:
        raise QuickdraftError(f"--url must be http(s)://HOST[:PORT], got {url!r}")
    text = str(u).rstrip("/")
    return text[:-3] if text.endswith("/v1") else text


# ----------------------------------------------------------------------------- the client

@dataclass(frozen=True)
class LoadConfig:
    url: str  # base URL, from base_url()
    num_requests: int = 32
    request_rate: float | None = None  # Poisson arrivals (req/s; inf = all at once), or
    concurrency: int | None = None  # this many clients back to back
    max_tokens: int = 64
    temperature: float = 0.0
    ignore_eos: bool = True
    model: str | None = None  # sent as "model" when set
    return_token_ids: bool = True  # ask for each chunk's token ids (vLLM's extra field)
    seed: int = 0  # arrival times; with temperature > 0 request i also gets seed + i
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 600.0  # per request


def _payload(cfg: LoadConfig, prompt, i: int) -> dict:
    body = {"prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
    if cfg.model is not None:
        body["model"] = cfg.model
    if cfg.temperature > 0:
        body["seed"] = cfg.seed + i
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    return body


async def send_request(client, cfg: LoadConfig, prompt, result: RequestResult) -> RequestResult:
    """One streamed completion; fills `result` (errors are recorded, never raised)."""
    import httpx

    chunks: list[Chunk] = []
    usage = None
    done = False
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", cfg.url + "/v1/completions", json=_payload(cfg, prompt, result.index),
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=10.0)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            sse = SSEDecoder()
            async for text in resp.aiter_text():
                now = time.perf_counter() - t0
                for data in sse.feed(text):
                    if data.strip() == "[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        raise RuntimeError(f"server error in stream: {json.dumps(event['error'])[:300]}")
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or ():
                        chunks.append(Chunk(now, choice.get("text") or "", chunk_token_count(choice)))
        end = time.perf_counter() - t0
        if not done:
            raise RuntimeError("stream ended without data: [DONE]")
        usage_tokens = usage.get("completion_tokens") if usage else None
        timings = request_timings(chunks, end, usage_tokens)
    except (httpx.HTTPError, OSError, RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        # a refused or broken connection, an error event, malformed JSON or an unexpected chunk shape
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.ok = True
    result.ttft, result.itl, result.tpot, result.e2e = timings["ttft"], timings["itl"], timings["tpot"], timings["e2e"]
    result.output_tokens, result.token_source = timings["output_tokens"], timings["token_source"]
    result.usage_tokens = usage_tokens
    result.prompt_tokens = usage.get("prompt_tokens") if usage else None
    result.num_chunks = len(chunks)
    if all(c.tokens is not None for c in chunks) and chunks:
        result.chunk_tokens = sum(c.tokens for c in chunks)
    return result


async def scrape_spec_counters(client, url: str) -> dict[str, float] | None:
    import httpx

    try:
        resp = await client.get(url + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return spec_counters(parse_prometheus(resp.text)) if resp.status_code == 200 else None


async def run_load(client, cfg: LoadConfig, prompts: list, on_done: Callable[[], None] | None = None
                   ) -> tuple[list[RequestResult], float]:
    """Send cfg.num_requests requests (prompt i % len(prompts)); returns the results and the
    run's wall time (first send to last completion)."""
    start = time.perf_counter()
    results = []

    async def one(i: int, at: float | None = None) -> None:
        if at is not None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        r = RequestResult(index=i, prompt_index=i % len(prompts), send_s=time.perf_counter() - start)
        results.append(await send_request(client, cfg, prompts[i % len(prompts)], r))
        if on_done is not None:
            on_done()

    if cfg.concurrency is not None:
        counter = iter(range(cfg.num_requests))

        async def worker() -> None:
            for i in counter:  # a shared iterator: each client takes the next request
                await one(i)

        await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, cfg.num_requests))))
    else:
        times = poisson_schedule(cfg.num_requests, cfg.request_rate, cfg.seed)
        await asyncio.gather(*(one(i, t) for i, t in enumerate(times)))
    duration = time.perf_counter() - start
    return sorted(results, key=lambda r: r.index), duration


def _client(n: int):
    import httpx

    # no pool limit below the number of requests in flight: a queued request would count
    # its wait for a connection as server latency
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4))


async def check_server(url: str, model: str | None) -> str | None:
    """Fail with one clear line when the server is not there; return the model name to send
    (the given one, else the first of /v1/models when the server lists any)."""
    import httpx

    async with httpx.AsyncClient() as client:
        try:
            health = await client.get(url + "/health", timeout=10.0)
        except httpx.HTTPError as exc:
            raise QuickdraftError(f"server not reachable at {url}: {type(exc).__name__}: {exc}") from None
        if health.status_code != 200:
            raise QuickdraftError(f"server at {url} is not ready: GET /health answered {health.status_code}")
        if model is not None:
            return model
        try:
            listed = await client.get(url + "/v1/models", timeout=10.0)
            data = listed.json().get("data") if listed.status_code == 200 else None
            return data[0]["id"] if data else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return None


async def run_benchmark(cfgs: list[LoadConfig], prompts: list, warmup: int = 1,
                        on_done: Callable[[], None] | None = None) -> list[dict]:
    """Warm up, then one run per config (same server), each between two /metrics scrapes."""
    if not cfgs:
        return []
    runs = []
    async with _client(max(c.num_requests for c in cfgs)) as client:
        for i in range(warmup):
            w = await send_request(client, cfgs[0], prompts[i % len(prompts)],
                                   RequestResult(index=i, prompt_index=i % len(prompts), send_s=0.0))
            if not w.ok:
                raise QuickdraftError(f"warm-up request failed: {w.error}")
        for cfg in cfgs:
            load = _loadavg()  # other work on the machine skews latencies: record it
            before = await scrape_spec_counters(client, cfg.url)
            results, duration = await run_load(client, cfg, prompts, on_done)
            after = await scrape_spec_counters(client, cfg.url)
            runs.append({"request_rate": cfg.request_rate, "concurrency": cfg.concurrency, "model": cfg.model,
                         "loadavg_1m_before": load,
                         **aggregate(results, duration, cfg.slo_ttft_ms, cfg.slo_tpot_ms),
                         "spec": spec_summary(before, after),
                         "requests": [asdict(r) for r in results]})
    return runs


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


# ----------------------------------------------------------------------------- output

def run_name(run: dict) -> str:
    if run["concurrency"] is not None:
        return f"concurrency {run['concurrency']}"
    return f"{run['request_rate']:g} req/s"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


COLUMNS = ["label", "load", "ok/err", "req/s", "out tok/s", "goodput", "TTFT mean/med/p99 ms",
           "TPOT mean/med/p99 ms", "ITL mean/med/p99 ms", "E2E med/p99 ms", "acceptance", "mean acc. length"]


def table_rows(result: dict) -> list[list[str]]:
    rows = []
    for r in result["runs"]:
        lat = ["/".join(_ms(r[m][s]) for s in ("mean", "median", "p99")) for m in ("ttft", "tpot", "itl")]
        rows.append([r.get("label") or result["setup"].get("label") or "", run_name(r),
                     f"{r['completed']}/{r['errors']}", _f(r["request_throughput"]),
                     _f(r["output_throughput"], ".1f"), _f(r["goodput"]), *lat,
                     f"{_ms(r['e2e']['median'])}/{_ms(r['e2e']['p99'])}",
                     _f(r["spec"]["acceptance_rate"], ".3f"), _f(r["spec"]["mean_acceptance_length"])])
    return rows


def markdown(result: dict) -> str:
    s = result["setup"]
    slo = ", ".join(f"{k} {s[k]} ms" for k in ("slo_ttft_ms", "slo_tpot_ms") if s.get(k) is not None)
    lines = [f"# quickdraft bench-serve ({s['client_cpu']})", "",
             f"{s['date']}; server {s['url']}; {s['num_requests']} requests per run, max_tokens {s['max_tokens']}, "
             f"temperature {s['temperature']}, ignore_eos {s['ignore_eos']}, prompts: {s['prompts']}"
             + (f"; goodput SLO: {slo}" if slo else "") + ".", "",
             f"`{s['command']}`", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result))
    return paths


def load_prompts(workload: str, prompts_file: Path | None, n: int) -> tuple[list, str]:
    """Prompts and a description: a JSONL file, or `n` prompts of a built-in held-out workload."""
    from ..bench.tune_cmd import read_prompts

    if prompts_file is not None:
        return read_prompts(prompts_file), str(prompts_file)
    from ..bench.workloads import code_completion, editing
    from ..train.corpus import load_corpus

    if workload not in ("code", "editing"):
        raise QuickdraftError(f"--workload must be code or editing, got {workload!r}")
    docs = load_corpus(None).heldout
    texts = code_completion(docs, n) if workload == "code" else [e.text for e in editing(docs, n, excerpt_chars=400)]
    if not texts:
        raise QuickdraftError(f"the built-in {workload} workload has no prompts")
    return texts, f"built-in {workload} workload ({len(texts)} held-out prompts)"


def bench(cfgs: list[LoadConfig], prompts: list, warmup: int = 1, progress: bool = True) -> list[dict]:
    """Run the configs against one server (see check_server), with a progress bar on stderr."""
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task("bench-serve", total=sum(c.num_requests for c in cfgs))
        return asyncio.run(run_benchmark(cfgs, prompts, warmup, on_done=lambda: bar.advance(task)))


def bench_serve_command(
    url: str = typer.Option(..., "--url", help="Server base URL, e.g. http://127.0.0.1:8000."),
    request_rates: Optional[str] = typer.Option(
        None, "--request-rates", help="Poisson arrival rates in req/s, comma-separated, one run each; "
        "'inf' sends all at once (default inf unless --concurrency)."),
    concurrency: Optional[str] = typer.Option(
        None, "--concurrency", help="Numbers of clients sending back to back, comma-separated, one run each."),
    num_requests: int = typer.Option(32, "--num-requests", help="Requests per run."),
    max_tokens: int = typer.Option(64, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Always generate max_tokens."),
    workload: str = typer.Option("code", "--workload", help="code | editing (built-in, held-out files)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL of {\"prompt\": ...} instead."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name to send (default: first of /v1/models)."),
    return_token_ids: bool = typer.Option(
        True, "--return-token-ids/--no-return-token-ids",
        help="Send return_token_ids (vLLM's extra field) to count each chunk's tokens exactly where supported."),
    seed: int = typer.Option(0, "--seed", help="Seed of the arrival times (and of sampling, seed + i)."),
    slo_ttft_ms: Optional[float] = typer.Option(None, "--slo-ttft-ms", help="Goodput SLO on time to first token."),
    slo_tpot_ms: Optional[float] = typer.Option(None, "--slo-tpot-ms", help="Goodput SLO on time per output token."),
    warmup: int = typer.Option(1, "--warmup", help="Requests sent (and not counted) before the runs."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds per request."),
    out_dir: Path = typer.Option(Path("bench-results"), "--out-dir"),
    name: str = typer.Option("bench_serve", "--name", help="Output file name (without extension)."),
    label: str = typer.Option("", "--label", help="Label of the server configuration, kept in the results."),
) -> None:
    """Load a running server (Poisson arrivals or fixed concurrency): TTFT, TPOT, ITL, E2E, throughput,
    goodput and acceptance; writes JSON and markdown."""
    from ..cli import fail

    try:
        result = _bench_serve(url, request_rates, concurrency, num_requests, max_tokens, temperature, ignore_eos,
                              workload, prompts, model, return_token_ids, seed, slo_ttft_ms, slo_tpot_ms, warmup, timeout,
                              label)
    except QuickdraftError as exc:
        fail(str(exc))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench-serve {result['setup']['url']}")
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("label", "load") else "right")
    for row in table_rows(result):
        table.add_row(*row)
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 220)  # a file or pipe: no reason to wrap the table
    console.print(table)
    for p in write_outputs(result, out_dir, name):
        console.print(f"wrote {p}")


def _bench_serve(url, request_rates, concurrency, num_requests, max_tokens, temperature, ignore_eos, workload,
                 prompts_file, model, return_token_ids, seed, slo_ttft_ms, slo_tpot_ms, warmup, timeout, label) -> dict:
    import importlib.util

    if importlib.util.find_spec("httpx") is None:
        raise QuickdraftError("bench-serve needs httpx: pip install httpx")
    url = base_url(url)
    if request_rates is not None and concurrency is not None:
        raise QuickdraftError("give --request-rates or --concurrency, not both")
    if num_requests < 1 or max_tokens < 1 or warmup < 0 or not timeout > 0:
        raise QuickdraftError("--num-requests and --max-tokens must be >= 1, --warmup >= 0, --timeout > 0")
    if not temperature >= 0:
        raise QuickdraftError(f"--temperature must be >= 0, got {temperature}")
    for opt, v in (("--slo-ttft-ms", slo_ttft_ms), ("--slo-tpot-ms", slo_tpot_ms)):
        if v is not None and not v > 0:
            raise QuickdraftError(f"{opt} must be > 0, got {v}")
    common = dict(url=url, num_requests=num_requests, max_tokens=max_tokens, temperature=temperature,
                  ignore_eos=ignore_eos, model=model, return_token_ids=return_token_ids, seed=seed, slo_ttft_ms=slo_ttft_ms,
                  slo_tpot_ms=slo_tpot_ms, timeout_s=timeout)
    if concurrency is not None:
        cfgs = [LoadConfig(concurrency=int(c), **common) for c in parse_values(concurrency, "--concurrency", True)]
    else:
        cfgs = [LoadConfig(request_rate=r, **common) for r in parse_values(request_rates or "inf", "--request-rates")]
    model = asyncio.run(check_server(url, model))
    cfgs = [LoadConfig(**{**asdict(c), "model": model}) for c in cfgs]
    texts, described = load_prompts(workload, prompts_file, num_requests)
    runs = bench(cfgs, texts, warmup)
    if not any(r["completed"] for r in runs):
        raise QuickdraftError(f"every request failed, e.g. {runs[0]['error_samples'][0]}")
    for r in runs:
        r["label"] = label
    return {"setup": setup(cfgs[0], described, label, warmup, "quickdraft bench-serve " + " ".join(sys.argv[2:])),
            "runs": runs}


def setup(cfg: LoadConfig, prompts: str, label: str, warmup: int, command: str) -> dict:
    from ..bench.hardware import cpu_model

    return {"url": cfg.url, "label": label, "num_requests": cfg.num_requests, "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos, "model": cfg.model, "seed": cfg.seed,
            "slo_ttft_ms": cfg.slo_ttft_ms, "slo_tpot_ms": cfg.slo_tpot_ms, "warmup": warmup, "prompts": prompts,
            "return_token_ids": cfg.return_token_ids,
            "client_cpu": cpu_model(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command}
