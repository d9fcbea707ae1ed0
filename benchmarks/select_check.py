"""Does `quickdraft select` pick well? Run it, then measure its pick again against the other
configurations it ranked highest, side by side (paired), and report the pick's speed over the
best one's.

1. `quickdraft select` (quickdraft.bench.select) on a target and a built-in workload: every
   candidate method / draft / k, end to end against plain decoding; its choice is written to a
   profile as `quickdraft select --out` does.
2. A fresh paired run of plain decoding, the choice and the next `--top` configurations of its
   ranking: one LLM each (policy "fixed": k every step; the AOT steps the engine uses by default,
   built before timing), every prompt at batch 1, greedy; each repeat runs every configuration
   over the whole workload in an order rotated per repeat; a configuration's speedup is the
   median over repeats of plain's time / its time in that repeat. Every output is checked token
   for token against plain decoding.
3. The bar: the choice's speedup / the best speedup of step 2 (>= 0.95: within 5%).

torch uses --threads threads, the process pinned to as many cores (--cores).

    python benchmarks/select_check.py --target bundled --workload code --prompts 4 --repeats 5
    python benchmarks/select_check.py --target smollm2 --workload editing-chat --prompts 3 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.bench.hardware import loadavg, provenance, provenance_line
from quickdraft.bench.select import Candidate, SelectConfig, encode_prompts, select, workload_prompts


def label(method: str, draft: str | None, k: int) -> str:
    return "plain" if method == "none" else f"{Candidate(method, draft).label} k={k}"


def remeasure(args, configs: list[tuple[str, str | None, int]], prompts: list[list[int]]) -> dict:
    """Paired end-to-end speedups of `configs` (method, draft, k) over plain decoding (module doc, 2)."""
    target = None if args.target == "bundled" else args.target
    llms = {("none", None, 0): LLM(target, method="none", dtype=args.dtype)}
    for method, draft, k in configs:
        llms[(method, draft, k)] = LLM(target, method=method, draft=draft, num_speculative_tokens=k,
                                       dtype=args.dtype, policy="fixed")
    for llm in llms.values():
        llm.wait_for_aot()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts[:1], warm)
    names = list(llms)
    times = {n: [] for n in names}
    outputs = {}
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            if llms[n].engine.proposer is not None:  # each run sees the prompts as new
                llms[n].engine.proposer.forget_requests()
            t0 = time.perf_counter()
            outs = [llms[n].generate([p], params)[0].token_ids for p in prompts]
            times[n].append(time.perf_counter() - t0)
            outputs.setdefault(n, outs)
    plain = ("none", None, 0)
    rows = []
    for n in names:
        ratios = [tp / t for tp, t in zip(times[plain], times[n])]
        rows.append({"config": label(*n), "method": n[0], "draft": n[1], "k": n[2],
                     "speedup": statistics.median(ratios), "ratios": ratios,
                     "seconds": statistics.median(times[n]), "identical": outputs[n] == outputs[plain]})
    return {"rows": rows}


def markdown(result: dict) -> str:
    sel, check = result["select"], result["check"]
    lines = [f"# `quickdraft select`'s choice against the best it measured ({result['target']}, "
             f"{result['workload']})", "", provenance_line(result["provenance"]), "",
             f"Command: `{result['provenance']['command']}`", "",
             f"Load average (1 min): {result['load_before'][0]} before, {sel['load_after'][0]} after select, "
             f"{result['load_after'][0]} at the end, on a 2-core machine shared with other work; one core pinned. "
             "Ratios of paired runs are meaningful under load; absolute tok/s are not.", "",
             f"## 1. select ({sel['seconds']:.0f} s)", "",
             "| # | configuration | speedup | measured again (near-ties) | tokens/step |", "|---|---|---|---|---|"]
    for i, r in enumerate(sel["rows"], 1):
        again = f"{r['runoff']['speedup']:.2f}x" if "runoff" in r else ""
        lines.append(f"| {i} | {label(r['method'], r['draft'], r['k'])} | {r['speedup']:.2f}x | {again} | "
                     f"{r['tokens_per_step']:.2f} |")
    lines += ["", f"Choice: **{sel['choice']}** ({sel['choice_speedup']:.2f}x in select's own measurement; "
              "with a runoff, the mean of its two).", "",
              "## 2. The choice and the next configurations of the ranking, measured again side by side", "",
              "| configuration | speedup (median of paired ratios) | per repeat | output = plain |", "|---|---|---|---|"]
    for r in check["rows"]:
        mark = "**" if r["config"] == sel["choice"] else ""
        lines.append(f"| {mark}{r['config']}{mark} | {r['speedup']:.2f}x | "
                     f"{', '.join(f'{x:.2f}' for x in r['ratios'])} | {'yes' if r['identical'] else 'NO'} |")
    lines += ["", f"## 3. The choice's speedup / the best's: **{check['choice_over_best']:.3f}** "
              f"(best: {check['best']}; bar >= 0.95)", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="bundled", help="bundled, a catalogue name (smollm2) or a folder")
    ap.add_argument("--workload", default="code", help="a built-in select workload")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5])
    ap.add_argument("--select-repeats", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="paired repeats of the check")
    ap.add_argument("--top", type=int, default=3, help="configurations besides the choice measured again")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cores", type=int, nargs="*", default=None)
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cores = args.cores or (sorted(os.sched_getaffinity(0))[:args.threads] if hasattr(os, "sched_getaffinity") else None)
    if cores:
        os.sched_setaffinity(0, cores)
    load_before = loadavg()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"select_check_{args.target}_cpu"
    config = SelectConfig(target=args.target, ks=tuple(args.ks), workload=args.workload, num_prompts=args.prompts,
                          max_tokens=args.max_tokens, repeats=args.select_repeats,
                          out=Path(tempfile.mkdtemp()) / "profile.json", dtype=args.dtype,
                          command="(benchmarks/select_check.py)")
    t0 = time.perf_counter()
    res = select(config)
    c = res.choice
    sel = {"seconds": time.perf_counter() - t0, "load_after": loadavg(), "skipped": res.skipped,
           "rows": [{k: r[k] for k in ("method", "draft", "k", "speedup", "tokens_per_step", "runoff") if k in r}
                    for r in res.rows],
           "choice": label(c.method, c.draft, c.k), "choice_speedup": c.speedup}
    chosen = (c.method, c.draft, c.k)
    ranked = [(r["method"], r["draft"], r["k"]) for r in res.rows]
    configs = ([chosen] if c.method != "none" else []) + [x for x in ranked if x != chosen][:args.top]
    tok = LLM(None if args.target == "bundled" else args.target, method="none").tokenizer
    prompts = encode_prompts(tok, workload_prompts(args.workload, args.prompts))
    check = remeasure(args, configs, prompts)
    best = max(check["rows"], key=lambda r: r["speedup"])
    pick = next(r for r in check["rows"] if r["config"] == sel["choice"])
    check.update(best=best["config"], choice_over_best=pick["speedup"] / best["speedup"])
    result = {"target": args.target, "workload": args.workload, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "load_before": load_before, "select": sel, "check": check, "load_after": loadavg(),
              "provenance": provenance("cpu", threads=args.threads, load_before=load_before)}
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / f"{name}.md").write_text(markdown(result))
    print((args.out_dir / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
