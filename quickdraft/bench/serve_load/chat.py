"""The multi-turn chat workload of `quickdraft bench-serve --workload chat`: what a chat server's
traffic is. `conversations` conversations of `turns` turns each, every one opening with the same
system prompt; every turn sends the whole history (system prompt, earlier questions and the
server's own answers, the new question) to POST /v1/chat/completions, streamed, so a server with
prefix caching computes only each turn's new tokens. `concurrency` clients each take the next
conversation and run its turns back to back.

Per turn: time to first token (TTFT), time per output token (TPOT), inter-token latencies (ITL;
a chunk of several tokens shares its gap, as in `stats.request_timings`), the prompt tokens and
the prompt tokens the server took from its cache (OpenAI's `usage.prompt_tokens_details.
cached_tokens`), and the request's own speculation figures (`usage.speculation`). Aggregates:
TTFT per turn (median, p99), TPOT and ITL (mean, median, p99), the prefix hit rate (cached /
prompt tokens from `usage`, and the server's `prefix_cache_hits / prefix_cache_queries` from
/metrics over the run), acceptance (from `usage.speculation`).

Two clients send the same requests: `httpx` (this package's SSE reader, default) or the official
`openai` Python client (`AsyncOpenAI`, extra fields in `extra_body`), to check the server the way
its users call it.

`compare_url`: a second server (e.g. the same model with `--no-enable-prefix-caching`) gets every
turn right after the first one does (paired and interleaved, so the machine's drift hits both),
each server continuing its conversation with its own answers; the results say, per turn, the
ratio of the two TTFTs and whether the two answers were the same text.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...errors import QuickdraftError
from .client import read_stream
from .stats import Chunk, parse_prometheus, request_timings, spec_counters, \
    spec_summary, summarize

CLIENTS = ("httpx", "openai")
_WORDS = ("You are a careful Python assistant. Answer with short, correct code and one sentence of explanation. "
          "Prefer the standard library, name things clearly, handle empty inputs and say which exceptions a "
          "function raises. Keep answers under twenty lines unless asked for more. ").split()
QUESTIONS = ("How do I reverse a list?", "Now sort it by length.", "Make it a function with a docstring.",
             "Add type hints.", "What if the list is empty?", "Write a test for it.", "Make it a generator.",
             "Count the words instead.", "Read them from a file.", "Handle a missing file.")


def system_prompt(words: int) -> str:
    """The shared system prompt: about `words` words (roughly 1.3 tokens each), the same every run."""
    out = [_WORDS[i % len(_WORDS)] for i in range(words)]
    return " ".join(out)


def question(conversation: int, turn: int) -> str:
    q = QUESTIONS[(turn + conversation) % len(QUESTIONS)]
    return q if conversation == 0 else f"{q} (conversation {conversation})"


@dataclass(frozen=True)
class ChatConfig:
    url: str  # base URL (client.base_url)
    conversations: int = 8
    turns: int = 10
    concurrency: int = 1
    system_words: int = 1000
    max_tokens: int = 32
    temperature: float = 0.0
    ignore_eos: bool = True
    model: str | None = None
    client: str = "httpx"  # CLIENTS
    compare_url: str | None = None  # a second server, sent every turn right after the first
    seed: int = 0  # with temperature > 0, turn t of conversation c gets seed + 1000 c + t
    timeout_s: float = 600.0
    api_key: str = "unused"  # sent as a bearer token (the openai client always sends one)

    def check(self) -> None:
        if self.conversations < 1 or self.turns < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise QuickdraftError("--conversations, --turns, --concurrency and --max-tokens must be >= 1")
        if self.system_words < 0:
            raise QuickdraftError(f"--system-words must be >= 0, got {self.system_words}")
        if self.client not in CLIENTS:
            raise QuickdraftError(f"--client must be one of {', '.join(CLIENTS)}, got {self.client!r}")
        if not self.timeout_s > 0:
            raise QuickdraftError("--timeout must be > 0")


@dataclass
class TurnResult:
    conversation: int
    turn: int  # from 1
    server: str  # "url" or "compare_url"
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    speculation: dict | None = None
    text: str = ""


def _body(cfg: ChatConfig, messages: list[dict], c: int, t: int) -> tuple[dict, dict]:
    """OpenAI's fields, and the extra ones (extra_body in the openai client)."""
    body = {"messages": messages, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if cfg.model is not None:
        body["model"] = cfg.model
    if cfg.temperature > 0:
        body["seed"] = cfg.seed + 1000 * c + t
    return body, {"ignore_eos": cfg.ignore_eos, "return_token_ids": True}


def _finish(result: TurnResult, chunks: list[Chunk], end: float, usage: dict | None, done: bool) -> TurnResult:
    if not done:
        raise RuntimeError("stream ended without its end")
    tokens = usage.get("completion_tokens") if usage else None
    timings = request_timings(chunks, end, tokens)
    result.ttft, result.itl, result.tpot, result.e2e = timings["ttft"], timings["itl"], timings["tpot"], timings["e2e"]
    result.output_tokens = timings["output_tokens"]
    result.text = "".join(c.text for c in chunks)
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        result.speculation = usage.get("speculation")
    result.ok = True
    return result


async def _turn_httpx(client, url: str, cfg: ChatConfig, messages: list[dict], result: TurnResult) -> TurnResult:
    import httpx

    body, extra = _body(cfg, messages, result.conversation, result.turn)
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json={**body, **extra},
                             headers={"Authorization": f"Bearer {cfg.api_key}"},
                             timeout=httpx.Timeout(cfg.timeout_s, connect=10.0)) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode('utf-8', 'replace')[:300]}")
        chunks, usage, done = await read_stream(resp, t0, chat=True)
    return _finish(result, chunks, time.perf_counter() - t0, usage, done)


async def _turn_openai(client, cfg: ChatConfig, messages: list[dict], result: TurnResult) -> TurnResult:
    body, extra = _body(cfg, messages, result.conversation, result.turn)
    body.setdefault("model", "default")
    chunks, usage = [], None
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(**body, extra_body=extra, timeout=cfg.timeout_s)
    async for event in stream:
        now = time.perf_counter() - t0
        if event.usage is not None:
            usage = event.usage.model_dump()
        for choice in event.choices:
            ids = (choice.model_extra or {}).get("token_ids")
            chunks.append(Chunk(now, choice.delta.content or "", len(ids) if isinstance(ids, list) else None))
    return _finish(result, chunks, time.perf_counter() - t0, usage, True)  # the client ends at [DONE]


class _Server:
    """One server under test: its client and its own copy of each conversation's history."""

    def __init__(self, name: str, url: str, cfg: ChatConfig):
        self.name, self.url, self.cfg = name, url, cfg
        if cfg.client == "openai":
            try:
                import openai
            except ImportError:
                raise QuickdraftError("--client openai needs the openai package: pip install openai") from None
            self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=cfg.api_key, max_retries=0)
        else:
            import httpx

            n = cfg.concurrency + 4  # no request waits for a connection (that wait would count as latency)
            self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

    async def send(self, messages: list[dict], c: int, t: int) -> TurnResult:
        result = TurnResult(conversation=c, turn=t, server=self.name)
        try:
            if self.cfg.client == "openai":
                return await _turn_openai(self.client, self.cfg, messages, result)
            return await _turn_httpx(self.client, self.url, self.cfg, messages, result)
        except Exception as exc:  # noqa: BLE001  (either client's errors: recorded per turn, never raised)
            result.error = f"{type(exc).__name__}: {str(exc)[:300]}"
            return result

    async def metrics(self) -> dict[str, float] | None:
        import httpx

        try:
            async with httpx.AsyncClient() as c:
                r = await c.get(self.url + "/metrics", timeout=10.0)
        except httpx.HTTPError:
            return None
        return parse_prometheus(r.text) if r.status_code == 200 else None

    async def close(self) -> None:
        await (self.client.close() if self.cfg.client == "openai" else self.client.aclose())


async def run_chat(cfg: ChatConfig, on_turn=None) -> dict:
    """Every conversation, `cfg.concurrency` at a time; returns the results (see `summary`)."""
    cfg.check()
    servers = [_Server("url", cfg.url, cfg)]
    if cfg.compare_url is not None:
        servers.append(_Server("compare_url", cfg.compare_url, cfg))
    system = system_prompt(cfg.system_words)
    results: list[TurnResult] = []
    todo = iter(range(cfg.conversations))

    async def worker() -> None:
        for c in todo:  # a shared iterator: each client takes the next conversation
            histories = {s.name: [{"role": "system", "content": system}] if system else [] for s in servers}
            for t in range(1, cfg.turns + 1):
                for s in servers:  # paired: the same turn on each server, one after the other
                    messages = histories[s.name] + [{"role": "user", "content": question(c, t)}]
                    r = await s.send(messages, c, t)
                    results.append(r)
                    messages.append({"role": "assistant", "content": r.text})
                    histories[s.name] = messages
                    if on_turn is not None:
                        on_turn()

    peaks = [{} for _ in servers]

    async def sample() -> None:  # the servers' KV memory and queue while the run goes (their peaks)
        while True:
            for s, peak in zip(servers, peaks):
                m = await s.metrics() or {}
                for name in ("kv_cache_bytes", "num_requests_running", "num_requests_waiting"):
                    if name in m:
                        peak[name] = max(peak.get(name, 0), m[name])
            await asyncio.sleep(0.5)

    try:
        before = [await s.metrics() for s in servers]
        sampler = asyncio.ensure_future(sample())
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, cfg.conversations))))
        duration = time.perf_counter() - started
        sampler.cancel()
        after = [await s.metrics() for s in servers]
    finally:
        for s in servers:
            await s.close()
    results.sort(key=lambda r: (r.server, r.conversation, r.turn))
    out = {s.name: summary([r for r in results if r.server == s.name], cfg.turns, b, a, duration)
           for s, b, a in zip(servers, before, after)}
    for s, peak in zip(servers, peaks):
        out[s.name]["peak"] = peak  # sampled every 0.5 s: kv_cache_bytes, running and waiting requests
    return {"servers": out,
            "paired": paired(results, cfg.turns) if len(servers) == 2 else None,
            "turn_results": [asdict(r) for r in results]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(results: list[TurnResult], turns: int, before: dict | None, after: dict | None, duration: float) -> dict:
    """One server's figures: per turn and over every turn."""
    ok = [r for r in results if r.ok]
    per_turn = []
    for t in range(1, turns + 1):
        rs = [r for r in ok if r.turn == t]
        per_turn.append({"turn": t, "completed": len(rs),
                         "prompt_tokens": summarize([r.prompt_tokens for r in rs if r.prompt_tokens is not None]),
                         "cached_tokens": summarize([r.cached_tokens for r in rs if r.cached_tokens is not None]),
                         "ttft": summarize([r.ttft for r in rs if r.ttft is not None]),
                         "tpot": summarize([r.tpot for r in rs if r.tpot is not None])})
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    spec = [r.speculation for r in ok if r.speculation]
    drafted, accepted = sum(s.get("draft_tokens", 0) for s in spec), sum(s.get("accepted_tokens", 0) for s in spec)
    drafts = sum(s.get("num_drafts", 0) for s in spec)
    metric_delta = {}
    if before is not None and after is not None:
        for name in ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions"):
            for key in (name + "_total", name):
                if key in before and key in after:
                    metric_delta[name] = after[key] - before[key]
                    break
        metric_delta["kv_cache_budget_bytes"] = after.get("kv_cache_budget_bytes")
    return {
        "turns": per_turn, "num_requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:3], "duration_s": duration,
        "ttft": summarize([r.ttft for r in ok if r.ttft is not None]),
        "tpot": summarize([r.tpot for r in ok if r.tpot is not None]),
        "itl": summarize([x for r in ok for x in r.itl]),
        "e2e": summarize([r.e2e for r in ok if r.e2e is not None]),
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": sum(r.output_tokens for r in ok),
        "hit_rate_usage": _ratio(cached, prompt),
        "hit_rate_metrics": _ratio(metric_delta.get("prefix_cache_hits"), metric_delta.get("prefix_cache_queries")),
        "prefix_cache": metric_delta,
        "speculation": {"draft_tokens": drafted, "accepted_tokens": accepted, "num_drafts": drafts,
                        "acceptance_rate": _ratio(accepted, drafted),
                        "mean_acceptance_length": 1 + accepted / drafts if drafts else None},
        "spec_metrics": spec_summary(spec_counters(before) if before else None,
                                     spec_counters(after) if after else None),
    }


def paired(results: list[TurnResult], turns: int) -> dict:
    """Turn by turn, compare_url's TTFT over url's (medians over conversations), and how many
    answers were the same text on both servers."""
    by = {(r.server, r.conversation, r.turn): r for r in results if r.ok}
    out = []
    for t in range(1, turns + 1):
        pairs = [(a, by.get(("compare_url", c, t))) for (s, c, tt), a in by.items() if s == "url" and tt == t]
        pairs = [(a, b) for a, b in pairs if b is not None]
        ratios = [b.ttft / a.ttft for a, b in pairs if a.ttft and b.ttft]
        out.append({"turn": t, "pairs": len(pairs), "ttft_ratio": summarize(ratios),
                    "same_text": sum(a.text == b.text for a, b in pairs)})
    return {"turns": out}


# ----------------------------------------------------------------------------- output

def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _peak_text(sv: dict) -> str:
    peak, budget = sv.get("peak") or {}, sv["prefix_cache"].get("kv_cache_budget_bytes")
    if "kv_cache_bytes" not in peak:
        return "."
    return (f"; at most {peak['kv_cache_bytes'] / 2**20:.0f} MiB of KV memory held (sampled every 0.5 s; budget "
            f"{'-' if budget is None else f'{budget / 2**20:.0f} MiB'}), {peak.get('num_requests_running', 0):.0f} "
            f"requests running and {peak.get('num_requests_waiting', 0):.0f} waiting at most.")


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [f"# quickdraft bench-serve --workload chat ({s['client_cpu']})", "",
             f"{s['date']}; {s['conversations']} conversations x {s['turns']} turns, concurrency {s['concurrency']}, "
             f"system prompt {s['system_words']} words, max_tokens {s['max_tokens']}, temperature {s['temperature']}, "
             f"client {s['client']}; load average (1 min) before: {s['loadavg_1m_before']}.", "",
             f"`{s['command']}`", ""]
    if "provenance" in result:
        from ..hardware import provenance_line

        lines += [provenance_line(result["provenance"]) + " (the load generator's machine)", ""]
    names = {"url": f"{s['url']} {s.get('label') or ''}".strip(),
             "compare_url": f"{s.get('compare_url')} {s.get('compare_label') or ''}".strip()}
    for key, sv in result["servers"].items():
        lines += [f"## {names[key]}", "",
                  f"{sv['completed']}/{sv['num_requests']} turns completed"
                  + (f" (errors: {'; '.join(sv['error_samples'])})" if sv["errors"] else "")
                  + f"; prefix hit rate {_f(sv['hit_rate_usage'])} (usage.cached_tokens / prompt_tokens), "
                  f"{_f(sv['hit_rate_metrics'])} (/metrics prefix_cache_hits / queries); "
                  f"acceptance {_f(sv['speculation']['acceptance_rate'])}, mean acceptance length "
                  f"{_f(sv['speculation']['mean_acceptance_length'], '.2f')} (usage.speculation)"
                  + _peak_text(sv), "",
                  "| | mean ms | median ms | p99 ms |", "|---|---|---|---|"]
        for m in ("ttft", "tpot", "itl", "e2e"):
            lines.append(f"| {m.upper()} | {_ms(sv[m]['mean'])} | {_ms(sv[m]['median'])} | {_ms(sv[m]['p99'])} |")
        lines += ["", "| turn | prompt tokens (median) | cached tokens (median) | TTFT median ms | TTFT p99 ms "
                  "| TPOT median ms |", "|---|---|---|---|---|---|"]
        for t in sv["turns"]:
            lines.append(f"| {t['turn']} | {_f(t['prompt_tokens']['median'], '.0f')} | "
                         f"{_f(t['cached_tokens']['median'], '.0f')} | {_ms(t['ttft']['median'])} | "
                         f"{_ms(t['ttft']['p99'])} | {_ms(t['tpot']['median'])} |")
        lines.append("")
    if result.get("paired"):
        lines += [f"## Paired: {names['compare_url']} TTFT / {names['url']} TTFT", "",
                  "| turn | pairs | TTFT ratio (median) | same answer text |", "|---|---|---|---|"]
        for t in result["paired"]["turns"]:
            lines.append(f"| {t['turn']} | {t['pairs']} | {_f(t['ttft_ratio']['median'], '.2f')} | "
                         f"{t['same_text']}/{t['pairs']} |")
        lines.append("")
    return "\n".join(lines)


def setup(cfg: ChatConfig, label: str, compare_label: str, command: str, load: float | None) -> dict:
    from ..hardware import cpu_model

    d = asdict(cfg)
    d.pop("api_key")
    return {**d, "label": label, "compare_label": compare_label, "client_cpu": cpu_model(), "command": command,
            "loadavg_1m_before": load,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_outputs(result: dict, out_dir: Path, name: str) -> list[Path]:
    if "provenance" not in result:
        from ..hardware import provenance

        result["provenance"] = provenance("cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown(result))
    return paths
