"""Speculation-length policies against fixed k and plain decoding, by batch size.

Each batch size B runs B held-out code prompts at once (greedy, 64 new tokens) with plain
decoding, fixed k, the acceptance-driven policy and the goodput policy (profile from
`quickdraft tune`), in a rotated order per repeat; tokens/s are medians over repeats and
ratios are to plain decoding in the same repeat. The goodput policy is also compared with
the best fixed k at each batch size (the fixed k with the highest median ratio to plain
decoding there, a choice made after the fact, which the policy has to make beforehand),
paired per repeat.

    python benchmarks/policies.py --profile benchmarks/results/tune_default_pair_cpu.json \
        --batch-sizes 1 2 4 8 16 32 --repeats 5 --threads 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.bench.hardware import cpu_model, loadavg, provenance, provenance_line
from quickdraft.bench.workloads import code_completion
from quickdraft.llm import default_model_dirs
from quickdraft.train.corpus import load_corpus


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--fixed-k", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("-k", type=int, default=6, help="k bound of the adaptive policies")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 keeps a shared CPU's other jobs from stalling every thread)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="policies_cpu")
    args = ap.parse_args()
    if min(args.batch_sizes) < 1 or min(args.fixed_k) < 1 or args.k < 1 or args.repeats < 1 or args.new_tokens < 1:
        ap.error("batch sizes, fixed k, -k, repeats and new tokens must be >= 1")
    if not args.profile.is_file():
        ap.error(f"profile {args.profile} not found (write one with quickdraft tune)")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.batch_sizes = sorted(set(args.batch_sizes))
    target, draft = default_model_dirs()
    configs = {"plain": LLM(target, method="none")}
    for k in args.fixed_k:
        configs[f"fixed k={k}"] = LLM(target, draft=draft, num_speculative_tokens=k, policy="fixed")
    configs["acceptance"] = LLM(target, draft=draft, num_speculative_tokens=args.k, policy="acceptance")
    configs["goodput"] = LLM(target, draft=draft, num_speculative_tokens=args.k, policy="goodput",
                             profile=args.profile)
    tok = configs["plain"].tokenizer
    prompts = [tok.encode(t) for t in code_completion(load_corpus(None).heldout, max(args.batch_sizes))]
    if len(prompts) < max(args.batch_sizes):
        sys.exit(f"error: the held-out code workload has {len(prompts)} prompts, fewer than batch "
                 f"size {max(args.batch_sizes)}")
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    names = list(configs)
    results, best_fixed = {}, {}
    load_before = loadavg()
    for B in args.batch_sizes:
        batch = prompts[:B]
        for llm in configs.values():
            llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        rows = {n: [] for n in names}
        for r in range(args.repeats):
            order = names[r % len(names):] + names[: r % len(names)]
            got = {}
            for n in order:
                llm = configs[n]
                llm.stats = type(llm.stats)()
                t0 = time.perf_counter()
                outs = llm.generate(batch, params)
                got[n] = (time.perf_counter() - t0, outs, llm.stats)
            base = [o.token_ids for o in got["plain"][1]]
            for n in names:
                secs, outs, s = got[n]
                tokens = sum(len(o.token_ids) for o in outs)
                rows[n].append({"tokens_per_s": tokens / secs, "vs_plain": got["plain"][0] / secs,
                                "draft_tokens_per_step": s.num_draft_tokens / max(1, s.num_steps),
                                "identical": [o.token_ids for o in outs] == base})
        results[str(B)] = {n: {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in v),
                               "vs_plain": statistics.median(x["vs_plain"] for x in v),
                               "draft_tokens_per_step": statistics.median(x["draft_tokens_per_step"] for x in v),
                               "identical": all(x["identical"] for x in v), "repeats": v}
                           for n, v in rows.items()}
        fixed = [n for n in names if n.startswith("fixed")]
        best = max(fixed, key=lambda n: results[str(B)][n]["vs_plain"])
        per = [g["tokens_per_s"] / f["tokens_per_s"] for g, f in zip(rows["goodput"], rows[best])]
        best_fixed[str(B)] = {"best_fixed": best, "goodput_vs_best_fixed": statistics.median(per), "per_repeat": per}
        print(f"B={B}: " + ", ".join(f"{n} {results[str(B)][n]['vs_plain']:.2f}x" for n in names)
              + f"; goodput / {best} {best_fixed[str(B)]['goodput_vs_best_fixed']:.2f}x", flush=True)
    setup = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "new_tokens": args.new_tokens, "repeats": args.repeats, "k": args.k, "profile": str(args.profile),
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "command": "python benchmarks/policies.py " + " ".join(sys.argv[1:])}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    data = {"setup": setup, "results": results, "goodput_vs_best_fixed": best_fixed,
            "provenance": provenance("cpu", load_before=load_before)}
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(data, indent=2) + "\n")
    md = [f"# Speculation-length policies by batch size ({setup['cpu']}, {setup['threads']} threads)", "", provenance_line(data["provenance"]), "",
          f"Bundled pair, greedy, {args.new_tokens} new tokens per request, B held-out code prompts at once, "
          f"{args.repeats} repeats (medians; ratio to plain decoding paired per repeat), {setup['date']}.", "",
          "| batch | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for B, row in results.items():
        md.append(f"| {B} | " + " | ".join(f"{row[n]['tokens_per_s']:.0f} tok/s ({row[n]['vs_plain']:.2f}x, "
                                           f"{row[n]['draft_tokens_per_step']:.1f} drafted/step)"
                                           f"{'' if row[n]['identical'] else ' NOT IDENTICAL'}" for n in names) + " |")
    md += ["", "Goodput policy against the best fixed k at each batch size (chosen after the fact by its "
               "median ratio to plain decoding; ratio of tokens/s paired per repeat, median):", "",
           "| batch | best fixed k | goodput / best fixed k |", "|---|---|---|"]
    for B, row in best_fixed.items():
        md.append(f"| {B} | {row['best_fixed']} | {row['goodput_vs_best_fixed']:.2f}x |")
    md += ["", f"Command: `{setup['command']}`", ""]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
