"""The load generator's client side: streaming requests to a running server (httpx),
Poisson or fixed-concurrency runs, /metrics scrapes, prompts, and the result files."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ...errors import QuickdraftError
from .stats import (Chunk, RequestResult, SSEDecoder, aggregate, chunk_token_count, parse_prometheus,
                    poisson_schedule, request_timings, spec_counters, spec_summary)

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


async def read_stream(resp, t0: float, chat: bool = False) -> tuple[list[Chunk], dict | None, bool]:
    """Read a streamed (SSE) completion: its chunks (arrival time from t0, text, tokens when the
    chunk names them), the last usage sent, and whether `data: [DONE]` came. `chat`: the text is in
    each choice's delta (chat completions). An error event raises RuntimeError."""
    chunks: list[Chunk] = []
    usage, done = None, False
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
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                chunks.append(Chunk(now, piece or "", chunk_token_count(choice)))
    return chunks, usage, done


async def send_request(client, cfg: LoadConfig, prompt, result: RequestResult) -> RequestResult:
    """One streamed completion; fills `result` (errors are recorded, never raised)."""
    import httpx

    t0 = time.perf_counter()
    try:
        async with client.stream("POST", cfg.url + "/v1/completions", json=_payload(cfg, prompt, result.index),
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=10.0)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            chunks, usage, done = await read_stream(resp, t0)
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
    if "provenance" in result:  # the client's machine (the server's may be another)
        from ..hardware import provenance_line

        lines[2:2] = [provenance_line(result["provenance"]) + " (the load generator's machine)", ""]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out_dir: Path, name: str) -> list[Path]:
    if "provenance" not in result:
        from ..hardware import provenance

        result["provenance"] = provenance("cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result))
    return paths


def load_prompts(workload: str, prompts_file: Path | None, n: int) -> tuple[list, str]:
    """Prompts and a description: a JSONL file, or `n` prompts of a built-in held-out workload."""
    from ..workloads import read_prompts

    if prompts_file is not None:
        return read_prompts(prompts_file), str(prompts_file)
    from ...train.corpus import load_corpus
    from ..workloads import code_completion, editing

    if workload not in ("code", "editing"):
        raise QuickdraftError(f"--workload must be code, editing or chat, got {workload!r}")
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


def setup(cfg: LoadConfig, prompts: str, label: str, warmup: int, command: str) -> dict:
    from ..hardware import cpu_model

    return {"url": cfg.url, "label": label, "num_requests": cfg.num_requests, "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos, "model": cfg.model, "seed": cfg.seed,
            "slo_ttft_ms": cfg.slo_ttft_ms, "slo_tpot_ms": cfg.slo_tpot_ms, "warmup": warmup, "prompts": prompts,
            "return_token_ids": cfg.return_token_ids,
            "client_cpu": cpu_model(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command}
