"""quickdraft against transformers' own speculative decoding, on the default pair, in one run.

The bundled target and draft (quickdraft.llm.default_model_dirs) are loaded by both libraries
in float32 on CPU. Held-out code prompts (quickdraft.bench.workloads.code_completion, never
trained on), batch 1, greedy, `--new-tokens` tokens per prompt with eos ignored.

Methods:
- ours-plain: LLM(method="none");  ours-draft-k5 / ours-draft-k2: LLM(draft=..., k=5 / 2);
  ours-ngram-k5: LLM(method="ngram", k=5);
- hf-plain: model.generate(do_sample=False);  hf-assisted: generate(assistant_model=draft)
  (transformers' default assistant schedule); hf-prompt-lookup: generate(prompt_lookup_num_tokens=5).
Every method is warmed up once, then each repeat runs every method over all prompts, in an
order rotated between repeats; figures are medians over repeats. Greedy outputs are compared
with ours-plain token by token (transformers may differ by float noise: reported, not failed).

    python benchmarks/peers.py --prompts 8 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.bench.hardware import cpu_model
from quickdraft.bench.workloads import code_completion
from quickdraft.llm import default_model_dirs
from quickdraft.train.corpus import load_corpus

RATIOS = [("ours-draft-k5", "hf-assisted"), ("ours-draft-k2", "hf-assisted"),
          ("ours-plain", "hf-plain"), ("ours-ngram-k5", "hf-prompt-lookup")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="peers_cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    load_before = os.getloadavg()

    import transformers
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir = default_model_dirs()
    n = args.new_tokens
    ours = {
        "ours-plain": LLM(target_dir, method="none", dtype="float32", device="cpu"),
        "ours-draft-k5": LLM(target_dir, draft=draft_dir, num_speculative_tokens=5, dtype="float32", device="cpu"),
        "ours-draft-k2": LLM(target_dir, draft=draft_dir, num_speculative_tokens=2, dtype="float32", device="cpu"),
        "ours-ngram-k5": LLM(target_dir, method="ngram", num_speculative_tokens=5, dtype="float32", device="cpu"),
    }
    hf_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    pad_id = hf_target.generation_config.pad_token_id
    if pad_id is None:
        eos = hf_target.generation_config.eos_token_id
        pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    hf_extra = {"hf-plain": {}, "hf-assisted": {"assistant_model": hf_draft},
                "hf-prompt-lookup": {"prompt_lookup_num_tokens": 5}}

    tok = ours["ours-plain"].tokenizer
    prompts = [tok.encode(t) for t in code_completion(load_corpus(None).heldout, args.prompts)]
    print(f"{len(prompts)} prompts, mean {statistics.mean(map(len, prompts)):.0f} tokens; {n} new tokens; "
          f"torch threads {threads}")

    def run_ours(llm: LLM, ps: list[list[int]], max_tokens: int) -> list[list[int]]:
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [list(llm.generate([x], p)[0].token_ids) for x in ps]

    def run_hf(extra: dict, ps: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = []
        with torch.inference_mode():
            for x in ps:
                ids = torch.tensor([x])
                out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                         pad_token_id=pad_id, **extra)
                outs.append(out[0, len(x):].tolist())
        return outs

    runners = {name: (lambda ps, m, llm=llm: run_ours(llm, ps, m)) for name, llm in ours.items()}
    runners.update({name: (lambda ps, m, e=e: run_hf(e, ps, m)) for name, e in hf_extra.items()})
    methods = list(runners)

    for name in methods:  # warm-up: one full-length call each (first calls pay one-time costs)
        runners[name]([prompts[0]], n)

    reps: dict[str, list[dict]] = {m: [] for m in methods}
    for r in range(args.repeats):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        got = {}
        for name in order:
            t0 = time.perf_counter()
            outs = runners[name](prompts, n)
            got[name] = (time.perf_counter() - t0, outs)
        base = got["ours-plain"][1]
        for name in methods:
            secs, outs = got[name]
            tokens = sum(len(o) for o in outs)
            same = sum(o == b for o, b in zip(outs, base))
            first_diff = [next((j for j, (a, b) in enumerate(zip(o, bb)) if a != b), None) for o, bb in zip(outs, base)]
            reps[name].append({"seconds": secs, "tokens": tokens, "tokens_per_s": tokens / secs,
                               "identical_prompts": same, "first_difference_at": first_diff})
            assert all(len(o) == n for o in outs), (name, [len(o) for o in outs])
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{m} {reps[m][-1]['tokens_per_s']:.1f}" for m in methods)
              + " tok/s")

    summary = {}
    for name, rows in reps.items():
        summary[name] = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in rows),
                         "median_s": statistics.median(x["seconds"] for x in rows),
                         "identical_to_ours_plain": all(x["identical_prompts"] == len(prompts) for x in rows),
                         "identical_prompts_min": min(x["identical_prompts"] for x in rows),
                         "repeats": rows}
    ratios = {}
    for a, b in RATIOS:
        per = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(reps[a], reps[b])]
        ratios[f"{a} / {b}"] = {"ratio_of_medians": summary[a]["tokens_per_s"] / summary[b]["tokens_per_s"],
                                "median_of_ratios": statistics.median(per), "per_repeat": per}

    cmd = "python benchmarks/peers.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = {
        "benchmark": "peers",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": cmd,
        "hardware": {"device": "cpu", "cpu_model": cpu_model(), "logical_cores": os.cpu_count(),
                     "torch_threads": threads, "loadavg_1m_before": load_before[0],
                     "loadavg_1m_after": os.getloadavg()[0]},
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "workload": {"prompts": len(prompts), "mean_prompt_tokens": statistics.mean(map(len, prompts)),
                     "new_tokens": n, "batch": 1, "greedy": True, "ignore_eos": True, "dtype": "float32",
                     "repeats": args.repeats, "warmup": 1,
                     "timing": "wall time of all prompts' generate calls, one prompt per call",
                     # None in the draft's generation_config: transformers falls back to its global defaults
                     "hf_assistant_generation_config": {
                         k: getattr(hf_draft.generation_config, k, None) if getattr(hf_draft.generation_config, k,
                                                                                    None) is not None else f"default ({d})"
                         for k, d in (("num_assistant_tokens", 20), ("num_assistant_tokens_schedule", "constant"),
                                      ("assistant_confidence_threshold", 0.4))}},
        "methods": summary,
        "ratios": ratios,
        "ratio_definition": "tokens/s of the first / tokens/s of the second (> 1: first faster)",
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")

    h = result["hardware"]
    md = [f"# quickdraft vs transformers on the default pair ({h['cpu_model']}, {threads} threads)", "",
          f"Bundled target + draft, float32, batch 1, greedy, {len(prompts)} held-out code prompts (mean "
          f"{result['workload']['mean_prompt_tokens']:.0f} tokens), {n} new tokens each (eos ignored); one warm-up "
          f"each, then {args.repeats} repeats with the method order rotated; medians over repeats. "
          f"transformers' assisted generation uses its default assistant schedule "
          f"({result['workload']['hf_assistant_generation_config']}).", "",
          "| method | median tok/s | median s | identical to ours-plain |", "|---|---:|---:|---|"]
    for name, m in summary.items():
        ident = "yes" if m["identical_to_ours_plain"] else f"NO ({m['identical_prompts_min']}/{len(prompts)} prompts)"
        md.append(f"| {name} | {m['tokens_per_s']:.1f} | {m['median_s']:.2f} | {ident} |")
    md += ["", "| ratio (tokens/s) | of medians | median of per-repeat |", "|---|---:|---:|"]
    for k, v in ratios.items():
        md.append(f"| {k} | {v['ratio_of_medians']:.2f}x | {v['median_of_ratios']:.2f}x |")
    md += ["", f"Hardware: {h['cpu_model']}, {h['logical_cores']} logical cores, torch threads {threads} "
               f"(1-minute load average {h['loadavg_1m_before']:.2f} before, {h['loadavg_1m_after']:.2f} after). "
               f"torch {torch.__version__}, transformers {transformers.__version__}, "
               f"Python {platform.python_version()}. Date {result['date']}.", "",
           f"Command: `{cmd}`", ""]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
