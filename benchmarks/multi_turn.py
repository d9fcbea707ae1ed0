"""Multi-turn chat with a shared system prompt: time to first token per turn, with and without
prefix caching, measured side by side on one engine.

Workload: `--conversations` conversations of `--turns` turns each; every conversation starts
with the same system prompt (about `--system-tokens` tokens) and every turn sends the whole
history (system prompt, earlier questions and answers, the new question), as a chat server
receives it. Each turn runs twice in a row on the same engine and models: once with the prefix
cache switched off (every prompt computed from its first token), once with it on (the cache then
holds the earlier turns' KV and the system prompt's). Pairing the two runs turn by turn lets the
machine's drift hit both. Greedy decoding; the two runs' tokens must be identical
(`identical` in the result), which is the prefix cache's promise.

    python benchmarks/multi_turn.py                                  # the bundled pair, plain decoding
    python benchmarks/multi_turn.py --target smollm2 --turns 10 --system-tokens 1000
    python benchmarks/multi_turn.py --turns 2 --conversations 1 --system-tokens 40 --max-tokens 4 --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.bench.hardware import provenance, provenance_line
from quickdraft.prefix_cache import PrefixCache

SYSTEM = ("You are a careful Python assistant. Answer with short, correct code and one sentence of "
          "explanation. Prefer the standard library, name things clearly, and handle empty inputs. ")
QUESTIONS = ["How do I reverse a list?", "Now sort it by length.", "Make it a function with a docstring.",
             "Add type hints.", "What if the list is empty?", "Write a test for it.", "Make it a generator.",
             "Count the words instead.", "Read them from a file.", "Handle a missing file."]


def first_token_time(engine, prompt: list[int], params: SamplingParams):
    """Seconds from add_request to the request's first token, and its final output."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    ttft, final = None, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                if ttft is None and out.token_ids:
                    ttft = time.perf_counter() - t0
                if out.finished:
                    final = out
    return ttft, final


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model (default: the bundled one)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--method", default="none", help="none (default) | draft | eagle3 | suffix | ngram | lookahead")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=400, help="the shared system prompt's length, about")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each answer gets")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile", choices=("eager", "auto"), default="eager")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="multi_turn_cpu")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.target, draft=args.draft, method=args.method, num_speculative_tokens=args.k,
              compile=False if args.compile == "eager" else None, enable_prefix_caching=True,
              max_num_batched_tokens=args.max_num_batched_tokens)
    engine, tok = llm.engine, llm.tokenizer
    cache: PrefixCache = engine.prefix_cache
    one = tok.encode(SYSTEM)
    system = (one * (args.system_tokens // len(one) + 1))[:args.system_tokens]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    turns: list[dict] = [dict(turn=t + 1, prompt_tokens=[], off_s=[], on_s=[], cached_tokens=[], identical=True)
                         for t in range(args.turns)]
    for c in range(args.conversations):
        history = list(system)
        for t in range(args.turns):
            question = QUESTIONS[(t + c) % len(QUESTIONS)] + ("" if c == 0 else f" (variant {c})")
            history += tok.encode(f"\nUser: {question}\nAssistant:")
            engine.prefix_cache = None  # off: computed from the first token
            off_s, off = first_token_time(engine, history, params)
            engine.prefix_cache = cache  # on: the earlier turns' KV
            on_s, on = first_token_time(engine, history, params)
            row = turns[t]
            row["prompt_tokens"].append(len(history))
            row["off_s"].append(off_s)
            row["on_s"].append(on_s)
            row["cached_tokens"].append(on.num_cached_tokens)
            row["identical"] &= on.token_ids == off.token_ids
            history += on.token_ids
    for row in turns:
        row["ttft_off_s"] = statistics.median(row["off_s"])
        row["ttft_on_s"] = statistics.median(row["on_s"])
        row["ratio"] = row["ttft_off_s"] / row["ttft_on_s"]
    stats = cache.stats
    result = dict(target=str(args.target or "bundled"), method=args.method, k=args.k, turns=turns,
                  conversations=args.conversations, system_tokens=len(system), max_tokens=args.max_tokens,
                  max_num_batched_tokens=args.max_num_batched_tokens, threads=torch.get_num_threads(),
                  identical=all(r["identical"] for r in turns), last_turn_ratio=turns[-1]["ratio"],
                  prefix_cache=dict(queries=stats.queries, hits=stats.hits, evictions=stats.evictions,
                                    cached_tokens=cache.num_cached_tokens, bytes=cache.nbytes),
                  provenance=provenance(threads=torch.get_num_threads()))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Multi-turn chat: time to first token with and without prefix caching ({result['target']}, "
             f"method {args.method})", "",
             "| turn | prompt tokens | cached tokens | TTFT off (s) | TTFT on (s) | off / on | identical |",
             "|---|---|---|---|---|---|---|"]
    for r in turns:
        lines.append(f"| {r['turn']} | {statistics.median(r['prompt_tokens']):.0f} | "
                     f"{statistics.median(r['cached_tokens']):.0f} | {r['ttft_off_s']:.3f} | {r['ttft_on_s']:.3f} | "
                     f"{r['ratio']:.2f}x | {r['identical']} |")
    lines += ["", f"Medians over {args.conversations} conversation(s). "
              f"Prefix cache: {stats.hits} of {stats.queries} prompt tokens hit (the on runs).", "",
              provenance_line(result["provenance"]), ""]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
