"""`quickdraft bench-serve`: load a running OpenAI-compatible server and measure TTFT, TPOT,
ITL, E2E, throughput, goodput and acceptance (the load generator is quickdraft.bench.serve_load);
`--workload chat`: multi-turn conversations (quickdraft.bench.serve_load.chat)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

from ..bench.serve_load.client import (COLUMNS, LoadConfig, base_url, bench, check_server, load_prompts, setup,
                                       table_rows, write_outputs)
from ..errors import QuickdraftError
from . import common as opts
from .common import command_line, fail, parse_values


def bench_serve_command(
    url: str = typer.Option(..., "--url", help="Server base URL, e.g. http://127.0.0.1:8000."),
    request_rates: Optional[str] = typer.Option(
        None, "--request-rates", help="Poisson arrival rates in req/s, comma-separated, one run each; "
        "'inf' sends all at once (default inf unless --concurrency)."),
    concurrency: Optional[str] = typer.Option(
        None, "--concurrency", help="Numbers of clients sending back to back, comma-separated, one run each."),
    num_requests: int = typer.Option(32, "--num-requests", help="Requests per run."),
    max_tokens: int = typer.Option(64, "--max-tokens"),
    temperature: float = opts.TEMPERATURE,
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Always generate max_tokens."),
    workload: str = typer.Option("code", "--workload", help="code | editing (held-out files, one completion "
                                 "each) | chat (multi-turn conversations sharing a system prompt: --turns, "
                                 "--conversations, --concurrency, per-turn TTFT and the prefix hit rate)."),
    prompts: Optional[Path] = opts.PROMPTS_FILE,
    model: Optional[str] = typer.Option(None, "--model", help="Model name to send (default: first of /v1/models)."),
    return_token_ids: bool = typer.Option(
        True, "--return-token-ids/--no-return-token-ids",
        help="Send return_token_ids (vLLM's extra field) to count each chunk's tokens exactly where supported."),
    seed: int = typer.Option(0, "--seed", help="Seed of the arrival times (and of sampling, seed + i)."),
    slo_ttft_ms: Optional[float] = typer.Option(None, "--slo-ttft-ms", help="Goodput SLO on time to first token."),
    slo_tpot_ms: Optional[float] = typer.Option(None, "--slo-tpot-ms", help="Goodput SLO on time per output token."),
    warmup: int = typer.Option(1, "--warmup", help="Requests sent (and not counted) before the runs."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds per request."),
    out_dir: Path = opts.OUT_DIR,
    name: str = typer.Option("bench_serve", "--name", help="Output file name (without extension)."),
    label: str = typer.Option("", "--label", help="Label of the server configuration, kept in the results."),
    turns: int = typer.Option(10, "--turns", help="chat: turns per conversation (each sends the whole history)."),
    conversations: int = typer.Option(8, "--conversations", help="chat: conversations (--concurrency at a time)."),
    system_words: int = typer.Option(1000, "--system-words", help="chat: words of the shared system prompt "
                                     "(about 1.3 tokens each)."),
    client: str = typer.Option("httpx", "--client", help="chat: httpx (default) or openai (the official "
                               "client, AsyncOpenAI)."),
    compare_url: Optional[str] = typer.Option(None, "--compare-url", help="chat: a second server (e.g. "
                                              "--no-enable-prefix-caching) sent every turn right after --url's: "
                                              "paired, interleaved TTFT per turn."),
    compare_label: str = typer.Option("", "--compare-label", help="chat: label of the --compare-url server."),
    api_key: str = typer.Option("unused", "--api-key", envvar="QUICKDRAFT_API_KEY",
                                help="chat: bearer token to send."),
) -> None:
    """Load a running server (Poisson arrivals or fixed concurrency): TTFT, TPOT, ITL, E2E, throughput,
    goodput and acceptance; or multi-turn chat (--workload chat); writes JSON and markdown."""
    if workload == "chat":
        try:
            paths = _bench_chat(url, concurrency, turns, conversations, system_words, client, compare_url,
                                compare_label, max_tokens, temperature, ignore_eos, model, seed, timeout, label,
                                api_key, request_rates, prompts, out_dir, name)
        except QuickdraftError as exc:
            fail(str(exc))
        for p in paths:
            print(f"wrote {p}")
        print(paths[1].read_text())
        return
    try:
        result = _bench_serve(url, request_rates, concurrency, num_requests, max_tokens, temperature, ignore_eos,
                              workload, prompts, model, return_token_ids, seed, slo_ttft_ms, slo_tpot_ms, warmup,
                              timeout,
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
    for opt, v in (("--slo-ttft-ms", slo_ttft_ms), ("--slo-tpot-ms", slo_tpot_ms)):
        if v is not None and not v > 0:
            raise QuickdraftError(f"{opt} must be > 0, got {v}")
    common = dict(url=url, num_requests=num_requests, max_tokens=max_tokens, temperature=temperature,
                  ignore_eos=ignore_eos, model=model, return_token_ids=return_token_ids, seed=seed,
                  slo_ttft_ms=slo_ttft_ms,
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
    return {"setup": setup(cfgs[0], described, label, warmup, command_line()),
            "runs": runs}


def _bench_chat(url, concurrency, turns, conversations, system_words, client, compare_url, compare_label,
                max_tokens, temperature, ignore_eos, model, seed, timeout, label, api_key, request_rates, prompts,
                out_dir, name) -> list[Path]:
    import importlib.util
    import os

    from ..bench.serve_load.chat import ChatConfig, run_chat, setup, write_outputs

    if importlib.util.find_spec("httpx") is None:
        raise QuickdraftError("bench-serve needs httpx: pip install httpx")
    if request_rates is not None or prompts is not None:
        raise QuickdraftError("--workload chat runs conversations: give --concurrency, not --request-rates or "
                              "--prompts")
    values = parse_values(concurrency or "1", "--concurrency", True)
    if len(values) != 1:
        raise QuickdraftError("--workload chat takes one --concurrency")
    url = base_url(url)
    compare = base_url(compare_url) if compare_url is not None else None
    cfg = ChatConfig(url=url, conversations=conversations, turns=turns, concurrency=int(values[0]),
                     system_words=system_words, max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                     model=model, client=client, compare_url=compare, seed=seed, timeout_s=timeout, api_key=api_key)
    cfg.check()
    model = asyncio.run(check_server(url, model))
    if compare is not None:
        asyncio.run(check_server(compare, model))
    cfg = ChatConfig(**{**asdict(cfg), "model": model})
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True)) as bar:
        task = bar.add_task("bench-serve chat", total=conversations * turns * (2 if compare else 1))
        result = asyncio.run(run_chat(cfg, on_turn=lambda: bar.advance(task)))
    if not any(s["completed"] for s in result["servers"].values()):
        raise QuickdraftError(f"every turn failed, e.g. {result['servers']['url']['error_samples'][0]}")
    result = {"setup": setup(cfg, label, compare_label, command_line(), load), **result}
    return write_outputs(result, out_dir, name)
