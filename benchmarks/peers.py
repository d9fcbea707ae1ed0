"""quickdraft against transformers' own speculative decoding, on the default pair, in one run.

A thin wrapper over `quickdraft.bench.peers` (what `quickdraft bench --peers` runs), with
this benchmark's fixed set of methods. The bundled target and draft are loaded by both
libraries in float32 on CPU; held-out code prompts (never trained on), batch 1, greedy,
`--new-tokens` tokens per prompt with eos ignored.

- ours-plain: LLM(method="none");  ours-draft-k{k}: LLM(draft=..., k) for each --draft-k;
  ours-ngram-k{k}: LLM(method="ngram", k) for each --ngram-k;
- hf-plain: generate(do_sample=False);  hf-assisted: generate(assistant_model=draft)
  (transformers' default assistant schedule);  hf-prompt-lookup-k{k}: generate(prompt_lookup_num_tokens=k).

Warm-up, repeats in rotated order, ratios paired per repeat, token equality with ours-plain:
see quickdraft/bench/peers.py.

    python benchmarks/peers.py --prompts 8 --repeats 3 --threads 1
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
from pathlib import Path

import torch

from quickdraft import LLM
from quickdraft.bench.hardware import cpu_model, loadavg, provenance, provenance_line
from quickdraft.bench.peers import markdown, run_peers, transformers_missing
from quickdraft.bench.workloads import code_completion
from quickdraft.llm import default_model_dirs
from quickdraft.train.corpus import load_corpus


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--draft-k", type=int, nargs="+", default=[5, 2], help="k of our draft chain (each a row)")
    ap.add_argument("--ngram-k", type=int, nargs="+", default=[5], help="k of our ngram and transformers' "
                                                                         "prompt_lookup_num_tokens")
    ap.add_argument("--compile", action="store_true", help="our side with compiled steps (torch.compile); "
                    "transformers' generate runs as it ships")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="peers_cpu")
    args = ap.parse_args()
    if min(args.prompts, args.repeats, args.new_tokens, *args.draft_k, *args.ngram_k) < 1:
        ap.error("--prompts, --repeats, --new-tokens, --draft-k and --ngram-k must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    missing = transformers_missing()
    if missing:
        sys.exit(f"error: {missing}")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    load_before = loadavg()

    target_dir, draft_dir = default_model_dirs()
    kw = {"dtype": "float32", "device": "cpu", "compile": args.compile}
    ours = {("none", 0): LLM(target_dir, method="none", **kw)}
    ours.update({("draft", k): LLM(target_dir, draft=draft_dir, num_speculative_tokens=k, **kw, policy="fixed") for k in args.draft_k})
    ours.update({("ngram", k): LLM(target_dir, method="ngram", num_speculative_tokens=k, **kw, policy="fixed") for k in args.ngram_k})
    tok = ours[("none", 0)].tokenizer
    prompts = [tok.encode(t) for t in code_completion(load_corpus(None).heldout, args.prompts)]
    print(f"{len(prompts)} prompts, mean {statistics.mean(map(len, prompts)):.0f} tokens; {args.new_tokens} new "
          f"tokens; torch threads {threads}", flush=True)
    done = [0]

    def progress() -> None:
        print("warm-up done" if done[0] == 0 else f"repeat {done[0]}/{args.repeats} done", flush=True)
        done[0] += 1

    peers = run_peers(ours, target_dir, draft_dir, prompts, args.new_tokens, args.repeats, progress=progress)

    cmd = "python benchmarks/peers.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = {
        "benchmark": "peers",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": cmd,
        "ours_compiled": args.compile,
        "hardware": {"device": "cpu", "cpu_model": cpu_model(), "logical_cores": os.cpu_count(),
                     "torch_threads": threads},
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": peers["transformers"]},
        **peers,
        "provenance": provenance("cpu", threads, load_before=load_before),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    h = result["hardware"]
    md = [f"# quickdraft{' (compiled steps)' if args.compile else ''} vs transformers on the default pair "
          f"({h['cpu_model']}, {threads} threads)", "", provenance_line(result["provenance"]), ""]
    md += markdown(peers)
    md += ["", f"Hardware: {h['cpu_model']}, {h['logical_cores']} logical cores, torch threads {threads}. "
               f"torch {torch.__version__}, transformers {peers['transformers']}, "
               f"Python {platform.python_version()}. Date {result['date']}.", "",
           f"Command: `{cmd}`", ""]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
