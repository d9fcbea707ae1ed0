"""Chunked prefill: how much a long prompt arriving slows the streams already running, per chunk size
(`--max-num-batched-tokens`), on a real `quickdraft serve`.

Per chunk size (sizes interleaved, the sweep repeated in reverse so drift hits every size alike):
start a server, warm it up, start `--streams` streaming completions (short prompts, long answers),
let them run `--steady` seconds, send one `--long-tokens`-token prompt, and keep the streams going
`--steady` seconds past its first token. The streams' inter-token latencies (the load generator's
ITL: a chunk of several tokens shares its gap) are split into the steady ones (before the long
prompt was sent and after its first token) and the window's (while it was prefilled). The bar:
p99 of the window's ITL <= 3x the steady median. Also the long prompt's time to first token,
which smaller chunks lengthen (more steps, a decode step between each two). The streams' own steps
slow as their context grows (by about 2,000 tokens during SmolLM2's window), and half the steady
gaps come from before the window: `--control` runs the same streams again on the same server without
the long prompt, as long, and also reports the window's p99 over their median gap at the token
positions the window covered.

`--modes` picks the steps the server runs (each mode x size a configuration of the sweep): `eager`
(--no-compile), `aot` (the AOT packages, built first when missing, the default once built: chunks
ride in mixed steps on the packed package), `aot-alternate` (the same packages without the packed
one, QUICKDRAFT_AOT_MIXED=0: chunk steps and decode steps alternate, as before mixed AOT steps),
`aot-f16kv` (`aot` with --kv-cache-dtype float16: the streams and the chunk read a 16-bit cache; the
default for int8 / int4 layers), `aot-f32kv` (`aot` with --kv-cache-dtype float32).

    python benchmarks/chunked_prefill.py --target smollm2 --sizes 32,64,128,256,512 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from quickdraft.bench.hardware import provenance, provenance_line
from quickdraft.bench.serve_load.launch import served
from quickdraft.bench.serve_load.stats import SSEDecoder, percentile

ROOT = Path(__file__).resolve().parents[1]


MODES = {"eager": (["--no-compile"], "1"), "aot": (["--aot"], "1"), "aot-alternate": (["--aot"], "0"),
         "aot-f16kv": (["--aot", "--kv-cache-dtype", "float16"], "1"),
         "aot-f32kv": (["--aot", "--kv-cache-dtype", "float32"], "1")}


def server_args(args, mode: str, size: str) -> list[str]:
    out = ["--served-model-name", "model", "--method", args.method, "--policy", "fixed", "--log-level", "warning",
           *MODES[mode][0], "--threads", str(args.threads), "--max-num-batched-tokens", size]
    return out + (["--target", args.target] if args.target else [])


async def stream(client, url: str, prompt, max_tokens: int, t0: float, seen: list[tuple[float, int]]) -> None:
    """One streamed completion; appends (arrival time from t0, tokens) per chunk to `seen` as they come
    (kept when the task is cancelled: the streams are hung up on at the end of a run)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    sse = SSEDecoder()
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=httpx.Timeout(600.0)) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for text in resp.aiter_text():
            now = time.perf_counter() - t0
            for data in sse.feed(text):
                if data.strip() == "[DONE]":
                    return
                for choice in json.loads(data).get("choices") or ():
                    if choice.get("token_ids"):
                        seen.append((now, len(choice["token_ids"])))


def gaps(seen: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """(arrival time, ITL) per token after the first: a chunk's gap shared by its tokens."""
    out = []
    for (t0, _), (t1, n) in zip(seen, seen[1:]):
        out += [(t1, (t1 - t0) / n)] * n
    return out


async def streams_for(client, url: str, args, seconds: float, long_prompt=None, sent_after: float = 0.0):
    """--streams streams for `seconds` (the long prompt sent after `sent_after` of them, where given):
    each stream's (arrival, tokens) chunks, and (sent, first token) of the long prompt."""
    t0 = time.perf_counter()
    seen = [[] for _ in range(args.streams)]
    tasks = [asyncio.ensure_future(stream(client, url, f"def helper_{i}(values):", args.stream_tokens, t0, seen[i]))
             for i in range(args.streams)]
    sent = first = None
    if long_prompt is not None:
        await asyncio.sleep(sent_after)
        long_seen: list = []
        sent = time.perf_counter() - t0
        await stream(client, url, long_prompt, 4, t0, long_seen)
        first = long_seen[0][0]
        seconds = first + args.steady
    await asyncio.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
    if any(t.done() for t in tasks):
        raise SystemExit("a stream ended before the run did: raise --stream-tokens")
    for t in tasks:
        t.cancel()  # the streams hang up: the server aborts them
    await asyncio.gather(*tasks, return_exceptions=True)
    return seen, sent, first


async def one_run(url: str, args) -> dict:
    rng = random.Random(0)
    long_prompt = [rng.randrange(100, 8000) for _ in range(args.long_tokens)]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.streams + 4)) as client:
        warm: list = []
        await stream(client, url, "def f(x):", 4, time.perf_counter(), warm)
        seen, sent, first = await streams_for(client, url, args, 0.0, long_prompt, args.steady)
        # the control: the same streams (greedy: the same tokens) as long, without the long prompt
        control = (await streams_for(client, url, args, first + args.steady))[0] if args.control else None
    steady, window, matched = [], [], []
    for i, s in enumerate(seen):
        own = gaps(s)
        for t, gap in own:
            (window if sent < t <= first else steady).append(gap)
        if control is not None:  # the control's gaps at the token indices of this stream's window
            ctl = gaps(control[i])
            matched += [ctl[j][1] for j, (t, _) in enumerate(own) if sent < t <= first and j < len(ctl)]
    med = statistics.median(steady)
    out = {}
    if matched:
        out = {"control_itl_median_s": statistics.median(matched),
               "window_p99_over_control_median": percentile(window, 99) / statistics.median(matched),
               "num_control": len(matched)}
    return out | {"long_ttft_s": first - sent, "steady_itl_median_s": med, "steady_itl_p99_s": percentile(steady, 99),
            "window_itl_median_s": statistics.median(window) if window else None,
            "window_itl_p99_s": percentile(window, 99), "window_itl_max_s": max(window, default=None),
            "window_p99_over_steady_median": percentile(window, 99) / med if window else None,
            "all_itl_p99_over_median": percentile(steady + window, 99) / statistics.median(steady + window),
            "num_steady": len(steady), "num_window": len(window)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--method", default="none")
    ap.add_argument("--sizes", default="32,64,128,256,512", help="max_num_batched_tokens values (auto too)")
    ap.add_argument("--modes", default="eager", help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--repeats", type=int, default=2, help="sweeps (every other one in reverse order)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=3000, help="each stream's max_tokens (must outlast a run)")
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--steady", type=float, default=8.0, help="seconds of streaming before and after the long prompt")
    ap.add_argument("--control", action="store_true",
                    help="also run the same streams without the long prompt, and compare the window's gaps with "
                    "theirs at the same token positions (the streams' own steps slow as their context grows)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="chunked_prefill_cpu")
    args = ap.parse_args(argv)
    configs = [f"{m}:{s}" for m in args.modes.split(",") for s in args.sizes.split(",")]
    for c in configs:
        if c.split(":")[0] not in MODES:
            raise SystemExit(f"unknown mode in {c!r}: one of {', '.join(MODES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for rep in range(args.repeats):
        for config in (configs if rep % 2 == 0 else configs[::-1]):
            mode, size = config.split(":")
            os.environ["QUICKDRAFT_AOT_MIXED"] = MODES[mode][1]  # (the server inherits it)
            log = args.out_dir / f"{args.name}.server.log"
            with log.open("w") as f, served(server_args(args, mode, size), log=f, threads=args.threads,
                                            timeout=1800) as (url, _):
                r = asyncio.run(one_run(url, args))
            r["loadavg_1m"] = os.getloadavg()[0]
            runs[config].append(r)
            print(config, json.dumps(r), flush=True)
    log.unlink(missing_ok=True)
    table = []
    for config in configs:
        rs = runs[config]

        def med(key):
            vals = [r[key] for r in rs if r[key] is not None]
            return statistics.median(vals) if vals else None

        mode, size = config.split(":")
        table.append({"mode": mode, "max_num_batched_tokens": int(size) if size.isdigit() else size,
                      **{k: med(k) for k in rs[0] if k not in ("loadavg_1m",)},
                      "loadavg_1m": [r["loadavg_1m"] for r in rs]})
    result = {"target": args.target or "bundled", "method": args.method, "streams": args.streams,
              "long_tokens": args.long_tokens, "steady_s": args.steady, "repeats": args.repeats,
              "threads": args.threads, "loadavg_1m_before": load_before, "table": table, "runs": runs,
              "command": "python benchmarks/chunked_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "provenance": provenance(threads=args.threads)}
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Chunked prefill: running streams' inter-token latency while a {args.long_tokens}-token prompt "
             f"arrives ({result['target']}, method {args.method}, {args.streams} streams)", "",
             "| steps | max_num_batched_tokens | steady ITL median ms | window ITL median ms | window ITL p99 ms | "
             "window p99 / steady median | whole-run p99 / median | long prompt TTFT s |"
             + (" control ITL median ms (the window's positions) | window p99 / control median |" if args.control else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if args.control else "")]
    for row in table:
        lines.append(f"| {row['mode']} | {row['max_num_batched_tokens']} | {1e3 * row['steady_itl_median_s']:.0f} | "
                     f"{1e3 * row['window_itl_median_s']:.0f} | {1e3 * row['window_itl_p99_s']:.0f} | "
                     f"{row['window_p99_over_steady_median']:.2f} | {row['all_itl_p99_over_median']:.2f} | "
                     f"{row['long_ttft_s']:.1f} |"
                     + (f" {1e3 * row['control_itl_median_s']:.0f} | {row['window_p99_over_control_median']:.2f} |"
                        if args.control else ""))
    lines += ["", f"Medians over {args.repeats} runs per configuration (interleaved, every other sweep reversed). "
              "Steady: the streams' ITL before the long prompt was sent and after its first token; window: "
              f"while it was prefilled. Each run {args.steady:g} s of streaming before and after."
              + (" Control: the same streams again on the same server without the long prompt, for as long; its "
                 "median gap over the token positions the window covered (the streams' steps slow as their "
                 "context grows, so the steady median, half of it from before the window, understates them "
                 "there)." if args.control else ""), "",
              f"`{result['command']}`", "", provenance_line(result["provenance"]), ""]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
