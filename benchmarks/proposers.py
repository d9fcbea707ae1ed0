"""Every proposer on the default pair, two workloads, measured side by side in one run.

Workloads (held-out stdlib files, never trained on; quickdraft.bench.workloads):
- code: the opening lines of functions/classes, the model writes on;
- editing: an excerpt of a file, then the start of a copy with one identifier renamed,
  so a model that copies repeats text from its prompt.

Methods: none (plain decoding), draft (chain), draft-tree (--tree-width), ngram, suffix,
lookahead. Batch 1, greedy by default. Each repeat runs every method over the same prompts
in a rotated order; speedup is plain time / method time within the repeat, and figures are
medians over repeats. Suffix decoding's global cache is emptied before each repeat, so a
repeat never sees its own earlier answers (within a repeat, earlier prompts' outputs count).

    python benchmarks/proposers.py --prompts 8 --repeats 3
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
from quickdraft.bench.workloads import code_completion, editing
from quickdraft.llm import default_model_dirs
from quickdraft.proposers import PROPOSERS
from quickdraft.train.corpus import load_corpus

METHODS = {  # name -> (method, options)
    "none": ("none", {}),
    "draft": ("draft", {}),
    "draft-tree": ("draft", {"tree_width": 3}),
    "draft-sampled-tree": ("draft", {"tree_width": 3, "tree_sampled": True}),  # = chain at T=0
    "ngram": ("ngram", {}),
    "suffix": ("suffix", {}),
    "lookahead": ("lookahead", {}),
}


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_method(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    llm.stats = SpecStats()
    outs, t0 = [], time.perf_counter()
    for p in prompts:
        outs.append(llm.generate([p], params)[0])
    return time.perf_counter() - t0, outs, llm.stats


@torch.inference_mode()
def propose_cost(llms: dict, tokens: list[int], context: int, k: int, iters: int = 50) -> dict:
    """Median seconds of one propose() for each context-only proposer at a `context`-token
    context (one new token committed between calls, as in decoding), beside the target's
    1-token step at the longest context it supports."""
    from quickdraft.cache import KVCache
    from quickdraft.model.transformer import forward_chunks
    from quickdraft.proposers.base import ProposeBatch
    from quickdraft.sampling import BatchSampling, StepRandom, seed_key

    out = {}
    plain = llms["none"]
    dev = plain.target.device
    sampling = BatchSampling.build([SamplingParams(temperature=0)], dev)
    for name in ("ngram", "suffix"):
        if name not in llms:
            continue
        proposer = PROPOSERS[name].build(target=plain.target, **METHODS[name][1])
        proposer.reserve(1, context + iters + 64)
        ctx = list(tokens[:context])
        proposer.start(0, ctx)
        times = []
        for i in range(iters):
            ctx.append(tokens[context + i])
            t0 = time.perf_counter()
            proposer.propose(ProposeBatch([ctx], k, sampling, StepRandom([seed_key(0)], [len(ctx)], dev)))
            times.append(time.perf_counter() - t0)
        out[f"propose_{name}_s"] = statistics.median(times)
    target = plain.target
    tctx = min(context, target.config.max_position_embeddings - 2)
    cache = KVCache.for_model(target, 1, tctx + 2)
    view = cache.rows(0, 1)
    forward_chunks(target, [tokens[:tctx]], [0], view)
    one, pos = torch.tensor([[5]], device=dev), torch.tensor([[tctx]], device=dev)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        target(one, pos, view, kv_len=tctx + 1)
        times.append(time.perf_counter() - t0)
    out["target_step_s"] = statistics.median(times)
    out["target_step_context"] = tctx
    out["propose_context"] = context
    return out


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                    help="default: all (draft-sampled-tree only at temperature > 0)")
    ap.add_argument("--workloads", nargs="+", default=["code", "editing"], choices=["code", "editing"])
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--tree-width", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--excerpt-chars", type=int, default=400,
                    help="editing: file excerpt length (the bundled target was trained on 256-token windows)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cost-context", type=int, default=4096, help="context of the propose-cost timing")
    ap.add_argument("--cost-iters", type=int, default=50, help="timed propose() calls per proposer")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="proposers_cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.methods is None:
        args.methods = [m for m in METHODS if m != "draft-sampled-tree" or args.temperature > 0]
    if "none" not in args.methods:
        args.methods.insert(0, "none")
    target_dir, draft_dir = default_model_dirs()
    METHODS["draft-tree"] = ("draft", {"tree_width": args.tree_width})
    METHODS["draft-sampled-tree"] = ("draft", {"tree_width": args.tree_width, "tree_sampled": True})
    llms = {}
    for name in args.methods:
        method, options = METHODS[name]
        llms[name] = LLM(target_dir, draft=draft_dir if method == "draft" else None, method=method,
                         num_speculative_tokens=args.k, spec_options=options, policy="fixed")
    tok = llms["none"].tokenizer
    docs = load_corpus(None).heldout
    workloads = {}
    if "code" in args.workloads:
        workloads["code"] = ([tok.encode(t) for t in code_completion(docs, args.prompts)], None)
    if "editing" in args.workloads:
        eds = editing(docs, args.prompts, excerpt_chars=args.excerpt_chars)
        workloads["editing"] = ([tok.encode(e.text) for e in eds], [e.expected for e in eds])
    params = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True, seed=0)

    results = {"workloads": {}}
    for wname, (prompts, expected) in workloads.items():
        print(f"workload {wname}: {len(prompts)} prompts, mean {statistics.mean(map(len, prompts)):.0f} tokens")
        for llm in llms.values():  # warm-up: first calls pay one-time costs
            llm.generate([prompts[0]], SamplingParams(temperature=args.temperature, max_tokens=8, ignore_eos=True))
        reps: dict[str, list[dict]] = {m: [] for m in args.methods}
        for r in range(args.repeats):
            order = args.methods[r % len(args.methods):] + args.methods[: r % len(args.methods)]
            got = {}
            for name in order:
                llm = llms[name]
                method, options = METHODS[name]
                if method == "suffix":  # a fresh global cache: no answers remembered from earlier repeats
                    llm.engine.proposer = PROPOSERS["suffix"].build(target=llm.target, **options)
                got[name] = run_method(llm, prompts, params)
            plain_s, plain_outs, _ = got["none"]
            for name in args.methods:
                secs, outs, s = got[name]
                tokens = sum(len(o.token_ids) for o in outs)
                row = {"seconds": secs, "tokens": tokens, "tokens_per_s": tokens / secs, "speedup": plain_s / secs,
                       "tokens_per_step": s.tokens_per_step,
                       "acceptance_rate": s.acceptance_rate,
                       "accepted_per_pos": [a / max(1, s.num_steps) for a in s.accepted_per_pos],
                       "draft_tokens_per_step": s.num_draft_tokens / max(1, s.num_steps),
                       # sampled outputs use other random draws than plain decoding: compare at T=0 only
                       "identical_to_plain": None if args.temperature > 0 else
                       [o.token_ids for o in outs] == [o.token_ids for o in plain_outs]}
                if expected is not None:
                    row["copy_fidelity"] = statistics.mean(common_prefix(o.text, e) / max(1, len(o.text))
                                                           for o, e in zip(outs, expected))
                reps[name].append(row)
            print(f"  repeat {r}: " + ", ".join(f"{n} {reps[n][-1]['speedup']:.2f}x "
                                                  f"(tokens/step {reps[n][-1]['tokens_per_step']:.2f})"
                                                  for n in args.methods))
        summary = {}
        for name, rows in reps.items():
            width = max(len(x["accepted_per_pos"]) for x in rows)
            summary[name] = {
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rows),
                "speedup": statistics.median(x["speedup"] for x in rows),
                "tokens_per_step": statistics.median(x["tokens_per_step"] for x in rows),
                "acceptance_rate": statistics.median(x["acceptance_rate"] for x in rows),
                "accepted_per_pos": [statistics.median(x["accepted_per_pos"][i] if i < len(x["accepted_per_pos"])
                                                       else 0.0 for x in rows) for i in range(width)],
                "draft_tokens_per_step": statistics.median(x["draft_tokens_per_step"] for x in rows),
                "identical_to_plain": None if args.temperature > 0 else all(x["identical_to_plain"] for x in rows),
                **({"copy_fidelity": statistics.median(x["copy_fidelity"] for x in rows)} if expected else {}),
                "repeats": rows,
            }
        results["workloads"][wname] = {"prompts": len(prompts),
                                       "mean_prompt_tokens": statistics.mean(map(len, prompts)),
                                       "methods": summary}

    stream = []
    for _, text in docs:
        stream += tok.encode(text)
        if len(stream) > args.cost_context + args.cost_iters + 64:
            break
    cost = propose_cost(llms, stream, args.cost_context, args.k, args.cost_iters)
    results["propose_cost"] = cost
    print(f"propose cost at a {args.cost_context}-token context: " + ", ".join(f"{n} {v * 1e6:.0f} us" for n, v in cost.items()
                                                              if n.startswith("propose_") and n.endswith("_s")))
    results["setup"] = {
        "k": args.k, "tree_width": args.tree_width, "new_tokens": args.new_tokens, "temperature": args.temperature,
        "repeats": args.repeats, "batch": 1, "threads": torch.get_num_threads(), "cpu": cpu_model(),
        "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "methods": {n: {"method": METHODS[n][0], "options": METHODS[n][1]} for n in args.methods},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/proposers.py " + " ".join(sys.argv[1:]),
    }
    results["provenance"] = provenance()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    s = results["setup"]
    md = [f"# Proposers on the default pair ({s['cpu']}, {s['threads']} threads)", "", provenance_line(results["provenance"]), "",
          f"Batch 1, {args.new_tokens} new tokens, temperature {args.temperature}, k={args.k} "
          f"(draft-tree width {args.tree_width}), {args.repeats} repeats (medians; speedup paired per repeat), "
          f"float32, torch {torch.__version__}, {s['date']}.", ""]
    for wname, w in results["workloads"].items():
        fid = "copy_fidelity" in next(iter(w["methods"].values()))
        md += [f"## {wname} ({w['prompts']} prompts, mean {w['mean_prompt_tokens']:.0f} prompt tokens)", "",
               "| method | tok/s | speedup | tokens/step | acceptance rate | draft tokens/step | "
               "accepted per position | identical to plain |" + (" copy fidelity |" if fid else ""),
               "|---|---|---|---|---|---|---|---|" + ("---|" if fid else "")]
        for name, m in w["methods"].items():
            pos = " ".join(f"{a:.2f}" for a in m["accepted_per_pos"]) or "-"
            md.append(f"| {name} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}x | {m['tokens_per_step']:.2f} | "
                      f"{m['acceptance_rate']:.3f} | {m['draft_tokens_per_step']:.1f} | {pos} | "
                      f"{'-' if m['identical_to_plain'] is None else 'yes' if m['identical_to_plain'] else 'NO'} |" + (f" {m['copy_fidelity']:.2f} |" if fid else ""))
        md.append("")
    c = results["propose_cost"]
    md += [f"Proposer cost at a {c['propose_context']}-token context (median of one propose(), batch 1): " + ", ".join(
        f"{n[8:-2]} {v * 1e6:.0f} µs ({100 * v / c['target_step_s']:.1f}% of a target step)"
        for n, v in c.items() if n.startswith("propose_") and n.endswith("_s"))
        + f"; the target's 1-token step at a {c['target_step_context']}-token context (its longest) takes "
          f"{c['target_step_s'] * 1e3:.2f} ms.", ""]
    md += ["Accepted per position: the fraction of steps whose accepted path reached draft position i "
           "(depth i in a tree). Copy fidelity: the share of the output that equals the edited copy's "
           "true continuation before the first difference.", "", f"Command: `{s['command']}`", ""]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
