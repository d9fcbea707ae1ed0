"""The hybrid proposer (method="auto" or a list of methods) against each single method, on chat,
code, editing and a mixed stream of the three, measured side by side in one run.

Models and rows (every row k = --k, policy "fixed": the methods, not the k policy, are compared):
- bundled: the bundled code target; rows plain, draft (the bundled draft), eagle3 (the bundled
  target-eagle3 head), suffix, ngram, auto (= suffix,ngram,draft: what method="auto" is for the
  bundled pair) and suffix,ngram,eagle3. Workloads: code (openings of held-out files), editing (an
  excerpt, then the start of a copy with one identifier renamed), chat (quickdraft's chat
  questions as raw text: the bundled model is a code model, so this is its "open text" case).
- smollm2 (SmolLM2-135M-Instruct, the catalogue model): rows plain, suffix, ngram, auto (= suffix,ngram:
  no draft or EAGLE-3 head ships for it here); chat, code and editing requests through its chat
  template (quickdraft.bench.workloads).
- mixed: the three workloads' prompts interleaved (chat, code, editing, chat, ...) as one stream.

Batch 1, one prompt per call, greedy (every output is checked token for token against plain
decoding), eos ignored (fixed lengths). Each repeat runs every row over the workload's prompts in an
order rotated per repeat; a row's speedup is plain's time / its time within the repeat, reported as
the median over repeats. Before each workload of each repeat the suffix tries' memory of earlier
outputs and the hybrid's estimates over earlier requests are emptied (its measured step costs
stay: they are the machine's). torch uses --threads threads, the process pinned to as many cores.

    python benchmarks/hybrid.py --models bundled smollm2 --prompts 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams, SpecStats
from quickdraft.bench.hardware import loadavg, provenance, provenance_line, steady_steps
from quickdraft.bench.workloads import (CHAT_PROMPTS, chat_requests, code_completion, code_requests, editing,
                                        editing_requests)
from quickdraft.llm import default_model_dirs
from quickdraft.proposers import HybridProposer, PROPOSERS
from quickdraft.train.corpus import load_corpus

ROWS = {  # model -> row -> (method, draft[, spec options])
    "bundled": {"plain": ("none", None), "draft": ("draft", "draft"), "eagle3": ("eagle3", "target-eagle3"),
                "suffix": ("suffix", None), "ngram": ("ngram", None), "auto": ("auto", "draft"),
                "suffix,ngram,eagle3": ("suffix,ngram,eagle3", "target-eagle3"),
                # the hybrid with each row's candidates merged into one tree (merge=True)
                "auto-merged": ("auto", "draft", {"merge": True})},
    "smollm2": {"plain": ("none", None), "suffix": ("suffix", None), "ngram": ("ngram", None),
                "auto": ("auto", None), "auto-merged": ("auto", None, {"merge": True})},
}

OPTIONAL = {"auto-merged"}  # rows run only when --rows names them


def fresh_memory(llm: LLM) -> None:
    """Forget earlier requests: suffix tries' outputs, the hybrid's estimates over requests."""
    p = llm.engine.proposer
    members = p.members if isinstance(p, HybridProposer) else {"": p} if p is not None else {}
    for name, m in members.items():
        if type(m) is PROPOSERS["suffix"]:
            m.trie = type(m.trie)(m.max_tree_depth)
            m.held.clear()
            m.held_tokens = 0
    if isinstance(p, HybridProposer):
        p.prior = {n: type(s)(1.0, 1.0, 2.0) for n, s in p.prior.items()}
        p.drafted_by = dict.fromkeys(p.drafted_by, 0)
        p.model_steps = 0
        p.merged_rows = 0


def steps_of(llm: LLM) -> str:
    """Which steps a row runs: the target's and its model proposer's, eager or compiled (an engine
    on a fresh cache runs eager steps until its AOT packages are built; steady_steps)."""
    p = llm.engine.proposer
    model = p.model if isinstance(p, HybridProposer) else p
    parts = ["target " + ("eager" if llm.engine.runs_eagerly() else "compiled")]
    if hasattr(model, "_step") and hasattr(model, "model"):
        parts.append("draft " + ("eager" if model._step is model.model else "compiled"))
    elif hasattr(model, "_head") and hasattr(model, "head"):
        parts.append("head " + ("eager" if model._head is model.head else "compiled"))
    return ", ".join(parts)


def workloads(model: str, llm: LLM, n: int) -> dict[str, list[list[int]]]:
    docs = load_corpus(None).heldout
    if model == "bundled":
        tok = llm.tokenizer
        out = {"chat": [tok.encode(q + "\n") for q in CHAT_PROMPTS[:n]],
               "code": [tok.encode(t) for t in code_completion(docs, n)],
               "editing": [tok.encode(e.text) for e in editing(docs, n, excerpt_chars=400)]}
    else:
        out = {"chat": [llm.encode_chat(c) for c in chat_requests(n)],
               "code": [llm.encode_chat(c) for c in code_requests(n)],
               "editing": [llm.encode_chat(e.messages) for e in editing_requests(docs, n)]}
    out["mixed"] = [p for trio in zip(out["chat"], out["code"], out["editing"]) for p in trio]
    return out


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]], SpecStats]:
    llm.stats = SpecStats()
    outs, t0 = [], time.perf_counter()
    for p in prompts:
        outs.append(llm.generate([p], params)[0].token_ids)
    return time.perf_counter() - t0, outs, llm.stats


@torch.inference_mode()
def bench_model(model: str, args) -> dict:
    target, bundled_draft = default_model_dirs()
    target = str(target) if model == "bundled" else "smollm2"
    drafts = {"draft": str(bundled_draft), "target-eagle3": "target-eagle3"}
    llms = {}
    for row, (method, draft, *options) in ROWS[model].items():
        if (args.rows and row not in args.rows or not args.rows and row in OPTIONAL) and row != "plain":
            continue
        llms[row] = LLM(target, draft=drafts.get(draft), method=method, num_speculative_tokens=args.k,
                        policy="fixed", spec_options=options[0] if options else None)
    names = list(llms)
    loads = {name: prompts for name, prompts in workloads(model, llms["plain"], args.prompts).items()
             if name in args.workloads}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    result = {"rows": {r: llms[r].engine.config.spec.method for r in names},
              "steps": {r: steps_of(llms[r]) for r in names}, "workloads": {}}
    for llm in llms.values():  # one-time costs (and the hybrid's cost measurement) before timing
        for prompts in loads.values():
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for wname, prompts in loads.items():
        reps: dict[str, list[dict]] = {r: [] for r in names}
        print(f"[{model}] {wname}: {len(prompts)} prompts, mean {statistics.mean(map(len, prompts)):.0f} tokens",
              flush=True)
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            got = {}
            for r in order:
                fresh_memory(llms[r])
                got[r] = run(llms[r], prompts, params)
                p = llms[r].engine.proposer
                if isinstance(p, HybridProposer):
                    got[r] += (dict(p.drafted_by), p.model_steps, p.merged_rows)
            plain_s, plain_outs, _ = got["plain"][:3]
            for r in names:
                secs, outs, s = got[r][:3]
                entry = {"seconds": secs, "tokens_per_s": sum(map(len, outs)) / secs, "speedup": plain_s / secs,
                         "identical": outs == plain_outs, "mean_acceptance_length": s.mean_acceptance_length,
                         "tokens_per_step": s.tokens_per_step}
                if len(got[r]) > 3:
                    entry["drafted_by"], entry["model_steps"], entry["merged_rows"] = got[r][3:6]
                reps[r].append(entry)
        summary = {}
        for r in names:
            e = reps[r]
            summary[r] = {"speedup": statistics.median(x["speedup"] for x in e),
                          "tokens_per_s": statistics.median(x["tokens_per_s"] for x in e),
                          "identical": all(x["identical"] for x in e),
                          "mean_acceptance_length": statistics.median(x["mean_acceptance_length"] for x in e),
                          "tokens_per_step": statistics.median(x["tokens_per_step"] for x in e),
                          "repeats": e}
            if "drafted_by" in e[-1]:
                summary[r]["drafted_by"], summary[r]["model_steps"] = e[-1]["drafted_by"], e[-1]["model_steps"]
                summary[r]["merged_rows"] = e[-1]["merged_rows"]
            print(f"  {r:>22}: {summary[r]['speedup']:.2f}x plain, {summary[r]['tokens_per_s']:.1f} tok/s, "
                  f"acc len {summary[r]['mean_acceptance_length']:.2f}, identical {summary[r]['identical']}"
                  + (f", drafted by {summary[r]['drafted_by']}" if "drafted_by" in summary[r] else ""), flush=True)
        result["workloads"][wname] = {"prompts": len(prompts), "load_after": loadavg(), "rows": summary}
    return result


def markdown(result: dict) -> list[str]:
    lines = ["# The hybrid proposer against each single method (batch 1, greedy)", "",
             provenance_line(result["provenance"]), "",
             f"Command: `{result['command']}`", ""] + ([result["note"], ""] if result.get("note") else []) + [
             "Speedup over plain decoding (median over repeats of paired ratios); `auto`: method=\"auto\" "
             "(for the bundled pair suffix,ngram,draft; for SmolLM2 suffix,ngram). Best single method in bold; "
             "`vs best`: the hybrid's speedup over the best single method's. Every output identical to plain "
             "decoding unless marked.", ""]
    for model, res in result["models"].items():
        rows = [r for r in res["rows"] if r != "plain"]
        singles = [r for r in rows if "," not in res["rows"][r]]
        hybrids = [r for r in rows if r not in singles]
        lines += [f"## {model}", "", "| workload | " + " | ".join(rows) + " | " +
                  " | ".join(f"{h} vs best" for h in hybrids) + " | load after |",
                  "|---" * (len(rows) + len(hybrids) + 2) + "|"]
        for wname, w in res["workloads"].items():
            s = w["rows"]
            best = max(singles, key=lambda r: s[r]["speedup"])
            cells = []
            for r in rows:
                c = f"{s[r]['speedup']:.2f}x" + ("" if s[r]["identical"] else " (differs!)")
                cells.append(f"**{c}**" if r == best else c)
            cells += [f"{s[h]['speedup'] / s[best]['speedup']:.2f}x" for h in hybrids]
            load = w["load_after"][0] if w["load_after"] else "?"
            lines.append(f"| {wname} | " + " | ".join(cells) + f" | {load} |")
        if all("tokens_per_step" in w["rows"][r] for w in res["workloads"].values() for r in rows):
            # what the load cannot change: tokens per target step (the hybrid's model drafting costs extra time)
            lines += ["", "Tokens per target step (median over repeats; independent of the machine's load):", "",
                      "| workload | " + " | ".join(rows) + " |", "|---" * (len(rows) + 1) + "|"]
            for wname, w in res["workloads"].items():
                lines.append(f"| {wname} | " + " | ".join(f"{w['rows'][r]['tokens_per_step']:.2f}" for r in rows) + " |")
            steps = [f"{wname} {h}: {w['rows'][h]['model_steps']}" for wname, w in res["workloads"].items()
                     for h in hybrids if "model_steps" in w["rows"][h]
                     and ("draft" in res["rows"][h] or "eagle3" in res["rows"][h])]
            lines += ["", "Steps in which the hybrid's model member drafted (last repeat): "
                      + ("; ".join(steps) or "none (no model member)")]
            merged = [f"{wname} {h}: {w['rows'][h]['merged_rows']}" for wname, w in res["workloads"].items()
                      for h in hybrids if "merged_rows" in w["rows"][h]]
            if merged:
                lines += ["", "Rows whose candidates (two or more members') were verified as one tree "
                          "(last repeat): " + "; ".join(merged)]
        if "steps" in res:
            lines += ["", "Steps each row ran: " + "; ".join(f"{r}: {v}" for r, v in res["steps"].items())]
        lines += ["", "Rows drafted by each member of the hybrid (last repeat), and mean acceptance length:", ""]
        for wname, w in res["workloads"].items():
            for h in hybrids:
                s = w["rows"][h]
                lines.append(f"- {model} {wname}, {h}: {s.get('drafted_by')}, acceptance length "
                             f"{s['mean_acceptance_length']:.2f} (single methods: " + ", ".join(
                                 f"{r} {w['rows'][r]['mean_acceptance_length']:.2f}" for r in singles) + ")")
        lines.append("")
    return lines


def main() -> None:
    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bundled", "smollm2"], choices=list(ROWS))
    ap.add_argument("--rows", nargs="*", default=None, help="only these rows (plain always runs)")
    ap.add_argument("--workloads", nargs="+", default=["chat", "code", "editing", "mixed"])
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4, help="per workload (mixed: 3 x this)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cores", type=int, nargs="*", default=None, help="pin to these cores (default: the first --threads)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="hybrid_cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cores = args.cores or (sorted(os.sched_getaffinity(0))[:args.threads] if hasattr(os, "sched_getaffinity") else None)
    if cores:
        os.sched_setaffinity(0, cores)  # pinned: one core per thread
    load_before = loadavg()
    result = {"command": "python " + " ".join(sys.argv), "k": args.k, "new_tokens": args.new_tokens,
              "threads": args.threads, "pinned_cores": cores, "models": {}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for model in args.models:  # written after each model: a long run that stops keeps what it measured
        result["models"][model] = bench_model(model, args)
        result["provenance"] = provenance("cpu", threads=args.threads, load_before=load_before)
        (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out_dir / f"{args.name}.md").write_text("\n".join(markdown(result)) + "\n")
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
