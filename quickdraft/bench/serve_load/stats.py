"""Pure statistics of a load run: percentiles, Poisson arrivals, SSE and Prometheus parsing,
per-request timings, aggregates and the speculation crossover. No IO (see the package
docstring for what each figure means)."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

from ...errors import QuickdraftError

SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
GENERATION_TOKENS = "generation_tokens"  # the server's count of tokens it generated, to check usage against
METRICS = ("ttft", "tpot", "itl", "e2e")  # seconds in the results, milliseconds in the tables


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


