"""Compiled vs eager steps, and a full-precision vs an int8 draft, on the default pair, one run.

Configurations (all batch 1, greedy, held-out code prompts, `--new-tokens` each, eos ignored):
  plain-eager, plain-compiled        LLM(method="none", compile=False / True)
  draft-eager, draft-compiled        LLM(draft, k, compile=False / True)
  int8-draft-eager, int8-draft-compiled   the same with draft_quantization="int8"
Each is warmed up (which compiles), then each repeat runs every configuration over all
prompts in a rotated order. Speedups are paired within a repeat, against plain decoding of
the same mode (eager vs eager, compiled vs compiled); figures are medians over repeats.
Greedy outputs are checked equal to plain-eager decoding. Memory: weights and caches of
each pair at batch 1 and 32, full context (quickdraft.bench.memory.footprint).

    python benchmarks/compiled.py --prompts 8 --repeats 3
    python benchmarks/compiled.py --configs draft-eager --prompts 1 --new-tokens 4 --repeats 1  # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams, SpecStats
from quickdraft.bench.hardware import cpu_model, provenance, provenance_line
from quickdraft.bench.memory import footprint
from quickdraft.bench.workloads import code_completion
from quickdraft.llm import default_model_dirs
from quickdraft.train.corpus import load_corpus

CONFIGS = {  # name -> (uses the draft, compile, draft quantization)
    "plain-eager": (False, False, None),
    "plain-compiled": (False, True, None),
    "draft-eager": (True, False, None),
    "draft-compiled": (True, True, None),
    "int8-draft-eager": (True, False, "int8"),
    "int8-draft-compiled": (True, True, "int8"),
}


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 | float16")
    ap.add_argument("--draft-dtype", default=None, help="the draft's precision (default: --dtype)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="compiled_cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for base in ("plain-eager", "plain-compiled"):
        if base not in args.configs and any(c.endswith(base.split("-")[1]) for c in args.configs):
            args.configs.insert(0, base)
    target_dir, draft_dir = default_model_dirs()
    llms, compile_s = {}, {}
    for name in args.configs:
        uses_draft, compiled, quant = CONFIGS[name]
        t0 = time.perf_counter()
        llms[name] = LLM(target_dir, draft_dir if uses_draft else None, method="draft" if uses_draft else "none",
                         num_speculative_tokens=args.k, compile=compiled, draft_quantization=quant, dtype=args.dtype,
                         draft_dtype=args.draft_dtype if uses_draft else None, policy="fixed")
        compile_s[name] = time.perf_counter() - t0
        print(f"{name}: loaded{' and compiled' if compiled else ''} in {compile_s[name]:.1f} s", flush=True)
    tok = llms[args.configs[0]].tokenizer
    prompts = [tok.encode(t) for t in code_completion(load_corpus(None).heldout, args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    for llm in llms.values():  # warm-up (compiled: the graphs for these shapes)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))

    reps: dict[str, list[dict]] = {n: [] for n in args.configs}
    reference = None
    for r in range(args.repeats):
        order = args.configs[r % len(args.configs):] + args.configs[: r % len(args.configs)]
        got = {}
        for name in order:
            llm = llms[name]
            llm.stats = SpecStats()
            t0 = time.perf_counter()
            outs = [llm.generate([p], params)[0] for p in prompts]
            got[name] = (time.perf_counter() - t0, outs, llm.stats)
        if reference is None and "plain-eager" in got:
            reference = [o.token_ids for o in got["plain-eager"][1]]
        for name in args.configs:
            secs, outs, s = got[name]
            base = "plain-compiled" if CONFIGS[name][1] else "plain-eager"
            tokens = sum(len(o.token_ids) for o in outs)
            reps[name].append({
                "seconds": secs, "tokens_per_s": tokens / secs, "ms_per_token": 1e3 * secs / tokens,
                "speedup_vs_plain_same_mode": got[base][0] / secs if base in got else None,
                "speedup_vs_plain_eager": got["plain-eager"][0] / secs if "plain-eager" in got else None,
                "tokens_per_step": s.tokens_per_step,
                "acceptance_rate": s.acceptance_rate,
                "identical_to_plain": reference is None or [o.token_ids for o in outs] == reference})
        print(f"repeat {r}: " + ", ".join(f"{n} {reps[n][-1]['tokens_per_s']:.1f} tok/s" for n in args.configs),
              flush=True)

    def med(rows, key):
        vals = [x[key] for x in rows if x[key] is not None]
        return statistics.median(vals) if vals else None

    summary = {}
    for name, rows in reps.items():
        llm = llms[name]
        summary[name] = {key: med(rows, key) for key in ("tokens_per_s", "ms_per_token", "speedup_vs_plain_same_mode",
                                                         "speedup_vs_plain_eager", "tokens_per_step",
                                                         "acceptance_rate")}
        summary[name]["identical_to_plain"] = all(x["identical_to_plain"] for x in rows)
        summary[name]["load_and_compile_s"] = compile_s[name]
        step = llm.engine._forward
        summary[name]["compile_fell_back"] = getattr(step, "failed", None)
        summary[name]["memory"] = {f"batch_{b}": footprint(llm, b) for b in (1, 32)}
        summary[name]["repeats"] = rows
    result = {"configs": summary, "setup": {
        "k": args.k, "dtype": str(llms[args.configs[0]].target.dtype).removeprefix("torch."),
        "draft_dtype": args.draft_dtype, "prompts": len(prompts), "new_tokens": args.new_tokens, "repeats": args.repeats, "batch": 1,
        "threads": torch.get_num_threads(), "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/compiled.py " + " ".join(sys.argv[1:])}, "provenance": provenance()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    s = result["setup"]
    md = [f"# Compiled vs eager steps, full vs int8 draft ({s['cpu']}, {s['threads']} threads)", "", provenance_line(result["provenance"]), "",
          f"Default pair, batch 1, greedy, k={args.k}, {len(prompts)} held-out code prompts x {args.new_tokens} "
          f"tokens, {args.repeats} repeats (medians; speedups paired per repeat), {s['dtype']}, "
          f"torch {s['torch']}, {s['date']}.", "",
          "| config | tok/s | ms/token | speedup vs plain (same mode) | vs plain eager | tokens/step | "
          "acceptance rate | identical to plain | added memory (B=1) |",
          "|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for name, m in summary.items():
        mem = m["memory"]["batch_1"]["added_fraction"]
        md.append(f"| {name} | {m['tokens_per_s']:.1f} | {m['ms_per_token']:.2f} | "
                  f"{f(m['speedup_vs_plain_same_mode'], '.2f')}x | {f(m['speedup_vs_plain_eager'], '.2f')}x | "
                  f"{m['tokens_per_step']:.2f} | {m['acceptance_rate']:.3f} | "
                  f"{'yes' if m['identical_to_plain'] else 'NO'} | {100 * mem:.1f}% |")
    md += ["", "Added memory: (target + draft weights and caches) / (target weights and cache) - 1 at batch 1, "
           "full context.", "", f"Command: `{s['command']}`", ""]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
