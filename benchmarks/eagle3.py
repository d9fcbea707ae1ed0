"""EAGLE-3 heads on this CPU: the shipped heads against plain decoding (and the bundled draft
model), paired, batch 1, greedy and sampled (issue 14).

Models: the bundled code target with `target-eagle3` (code openings from the corpus' held-out
files, raw text) and SmolLM2-135M-Instruct with a head given by --head (none ships: train one
with `quickdraft train-eagle3`; quickdraft's chat requests through the chat template). Rows: plain decoding; eagle3 chains at each --ks; an EAGLE-2
dynamic trees (--trees, default width 3, 8 nodes, depth 4); for the bundled target also its
draft model (--draft-ks, default k 5; --draft-quantization adds rows with its weights in another format).
Every row runs with compile="aot" by default (the AOT packages, built before timing; eagle3 rows use the
package variant that returns the target's hidden states), float32, eos ignored, fixed k.

Each (model, threads) block: one warm-up per row, then --repeats repeats; in a repeat every row
runs every prompt, in an order rotated per repeat. Reported: decode tok/s (first token to last)
as the median over repeats, the speedup over plain as the median of per-repeat ratios (min -
max), acceptance rate and mean acceptance length, and whether every output equals plain
decoding's. The machine's load: other processes' CPU share during the block.

    python benchmarks/eagle3.py --out-dir benchmarks/results --threads 1 2
    python benchmarks/eagle3.py --models bundled --threads 1 --ks 2 --trees 2x4x2 --draft-ks 2 --prompts 1 \
        --new-tokens 4 --repeats 1 --compile eager --out-dir /tmp/x   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.bench.hardware import cpu_model, cpu_seconds, loadavg, other_cpu_share, provenance, provenance_line
from quickdraft.bench.workloads import chat_requests, code_completion
from quickdraft.llm import default_model_dirs
from quickdraft.metrics import SpecStats
from quickdraft.train.corpus import load_corpus


def rows_for(model: str, ks: list[int], head_quant: list[str] = (), head: str | None = None,
             trees: list[str] = ("3x8x4",), draft_ks: list[int] = (5,), compile: str | bool = "aot",
             draft_quant: list[str] = ()) -> dict[str, dict]:
    """Rows of one model's block. eagle3-k<k>: the head as the engine loads it by default (on a
    CPU with quickdraft's kernels int8, int4 without VNNI); eagle3-k<k>-<q>head: with
    draft_quantization=q ("none": the head's weights as stored). draft-k<k>: the bundled draft
    model as loaded by default (int8 on such a CPU); draft-k<k>-<q>draft: with draft_quantization=q
    ("none": as loaded, float32 here). compile: every row's LLM(compile=...)."""
    target, draft = default_model_dirs()
    base = {"target": str(target) if model == "bundled" else "smollm2", "dtype": "float32", "compile": compile}
    if head is None and model != "bundled":  # only the bundled target's head ships
        raise SystemExit(f"--models {model} needs --head DIR: a head trained with `quickdraft train-eagle3` "
                         "(docs/eagle3-and-training.md has the command for SmolLM2's)")
    head = head or "target-eagle3"
    rows = {"plain": {**base, "method": "none"}}
    for k in ks:
        rows[f"eagle3-k{k}"] = {**base, "method": "eagle3", "draft": head, "num_speculative_tokens": k}
    for q in head_quant:  # the head's weights quantised (the target stays float32)
        for k in ks:
            rows[f"eagle3-k{k}-{q}head"] = {**base, "method": "eagle3", "draft": head, "num_speculative_tokens": k,
                                            "draft_quantization": q}
    for tree in trees:  # width x nodes x depth
        w, nodes, depth = map(int, tree.split("x"))
        rows[f"eagle3-tree{w}x{nodes}d{depth}"] = {**base, "method": "eagle3", "draft": head,
                                                 "num_speculative_tokens": depth,
                                                 "spec_options": {"tree_width": w, "tree_nodes": nodes}}
    if model == "bundled":
        for k in draft_ks:
            rows[f"draft-k{k}"] = {**base, "method": "draft", "draft": str(draft), "num_speculative_tokens": k}
            for q in draft_quant:
                rows[f"draft-k{k}-{q}draft"] = {**base, "method": "draft", "draft": str(draft),
                                                "num_speculative_tokens": k, "draft_quantization": q}
    return rows


def prompts_for(model: str, llm: LLM, n: int) -> list[list[int]]:
    if model == "bundled":
        return [llm.tokenizer.encode(t) for t in code_completion(load_corpus(None).heldout, n)]
    return [llm.encode_chat(c) for c in chat_requests(n)]


def run(llm: LLM, prompt: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> tuple[float, list[int], SpecStats]:
    params = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=seed)
    first = final = None
    for out in llm.stream(prompt, params):
        if first is None:
            first = time.perf_counter()
        if out.finished:
            final = out
    return time.perf_counter() - first, list(final.token_ids), final.stats


def block(llms: dict[str, LLM], prompts: list[list[int]], n: int, threads: int, repeats: int,
          temperature: float = 0.0) -> dict:
    torch.set_num_threads(threads)
    names = list(llms)
    for name in names:
        run(llms[name], prompts[0], 16)  # warm-up
    cpu0, t0, load0 = cpu_seconds(), time.perf_counter(), loadavg()
    per = {name: [] for name in names}
    outputs = {name: [] for name in names}
    stats = {name: SpecStats() for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        secs = {name: 0.0 for name in names}
        for i, p in enumerate(prompts):
            for name in order:
                s, ids, st = run(llms[name], p, n, temperature, seed=i)
                secs[name] += s
                if r == 0:
                    outputs[name].append(ids)
                stats[name].merge(st)
        for name in names:
            per[name].append(len(prompts) * (n - 1) / secs[name])
    wall = time.perf_counter() - t0
    result = {}
    for name in names:
        ratios = [a / b for a, b in zip(per[name], per["plain"])]
        st = stats[name]
        result[name] = {"tokens_per_s": statistics.median(per[name]), "per_repeat": per[name],
                        "speedup_median": statistics.median(ratios), "speedup_min": min(ratios),
                        "speedup_max": max(ratios), "acceptance_rate": st.acceptance_rate if st.num_drafts else None,
                        "mean_acceptance_length": st.mean_acceptance_length if st.num_drafts else None,
                        # sampled rows: the same seed, yet speculation draws other random numbers
                        "identical_to_plain": outputs[name] == outputs["plain"] if temperature == 0 else None}
    return {"threads": threads, "temperature": temperature, "rows": result, "seconds": wall,
            "machine": {"loadavg_1m_before": load0 and load0[0], "loadavg_1m_after": (loadavg() or [None])[0],
                        "other_cpu_share": other_cpu_share(cpu0, cpu_seconds(), wall)}}


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["bundled"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--head-quantization", nargs="*", default=[], choices=["none", "int8", "int4"],
                    help="also rows with the head's weights so (eagle3-k<k>-<q>head; none: as stored)")
    ap.add_argument("--head", default=None, help="a head folder or name instead of the model's shipped head")
    ap.add_argument("--trees", nargs="*", default=["3x8x4"], help="EAGLE-2 trees: width x nodes x depth")
    ap.add_argument("--draft-ks", nargs="*", type=int, default=[5], help="the bundled draft model's rows")
    ap.add_argument("--draft-quantization", nargs="*", default=[], choices=["none", "int8", "int4"],
                    help="also draft-model rows with its weights so (draft-k<k>-<q>draft; none: as loaded)")
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0],
                    help="blocks per temperature (sampled: seeded per prompt; every row gets the same seeds)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="eagle3_cpu")
    ap.add_argument("--compile", choices=["aot", "eager"], default="aot",
                    help="every row's steps: AOT packages (built before timing) or eager (smoke tests)")
    args = ap.parse_args()
    results = []
    for model in args.models:
        llms = {}
        for name, kw in rows_for(model, args.ks, args.head_quantization, args.head, args.trees, args.draft_ks,
                                 "aot" if args.compile == "aot" else False, args.draft_quantization).items():
            start = time.perf_counter()
            llms[name] = LLM(**dict({"policy": "fixed"}, **kw))  # k as the row names it, every step
            print(f"{model} {name}: loaded in {time.perf_counter() - start:.1f} s "
                  f"({type(llms[name].engine._forward).__name__})", flush=True)
        prompts = prompts_for(model, llms["plain"], args.prompts)
        for threads, temperature in [(t, T) for t in args.threads for T in args.temperatures]:
            b = block(llms, prompts, args.new_tokens, threads, args.repeats, temperature)
            b.update(model=model, prompt_tokens=[len(p) for p in prompts])
            results.append(b)
            for name, r in b["rows"].items():
                acc = "" if r["acceptance_rate"] is None else (f", acceptance {r['acceptance_rate']:.2f}, "
                                                               f"MAL {r['mean_acceptance_length']:.2f}")
                print(f"{model} {threads}t T={temperature} {name}: {r['tokens_per_s']:.1f} tok/s, {r['speedup_median']:.2f}x plain"
                      f"{acc}, identical {r['identical_to_plain']}", flush=True)
        del llms
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": cpu_model(), "cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(), "args": {k: str(v) for k, v in vars(args).items()},
            "command": "python benchmarks/eagle3.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items())}
    prov = provenance("cpu", list(args.threads))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps({"meta": meta, "blocks": results, "provenance": prov}, indent=2))
    md = [f"# EAGLE-3 heads vs plain decoding ({meta['cpu']}, {meta['cores']} cores)", "", provenance_line(prov), "",
          f"{meta['date']}, torch {meta['torch']}. Batch 1, {args.new_tokens} new tokens (eos ignored), "
          f"{args.prompts} prompts, {args.repeats} repeats, compile={args.compile}, float32. Speedup: median of per-repeat "
          "ratios to plain decoding in the same block (min - max). MAL: mean acceptance length. T: temperature "
          "(0: greedy; sampled requests seeded per prompt, so 'identical' applies to greedy only).", "",
          "| model | threads | T | row | tok/s | speedup | acceptance | MAL | identical to plain | other CPU |",
          "|---|---:|---:|---|---:|---:|---:|---:|---|---:|"]
    for b in results:
        other = b["machine"]["other_cpu_share"]
        for name, r in b["rows"].items():
            acc, mal = r["acceptance_rate"], r["mean_acceptance_length"]
            acc = "-" if acc is None else f"{acc:.2f}"
            mal = "-" if mal is None else f"{mal:.2f}"
            share = "-" if other is None else f"{100 * other:.0f}%"
            ident = "-" if r["identical_to_plain"] is None else r["identical_to_plain"]
            md.append(f"| {b['model']} | {b['threads']} | {b['temperature']:g} | {name} | {r['tokens_per_s']:.1f} | "
                      f"{r['speedup_median']:.2f}x "
                      f"({r['speedup_min']:.2f} - {r['speedup_max']:.2f}) | {acc} | {mal} | "
                      f"{ident} | {share} |")
    md += ["", f"Command: `{meta['command']}`", ""]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
