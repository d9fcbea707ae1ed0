"""Plain autoregressive decoding: quickdraft (method="none") against transformers' generate.

One random ~25M-parameter Llama checkpoint (GQA, untied embeddings) is written to a temp
folder and loaded by both libraries in float32 on CPU. For batch 1 and a random prompt,
both produce `--new-tokens` greedy tokens; the time covers the whole call (prefill + decode).
After warm-up, each repeat runs ours and theirs back to back (the order alternates
between repeats) so that machine noise hits both; we report medians and the median of
the per-repeat ratios, and check that the greedy outputs are token-identical.

    .venv/bin/python benchmarks/ar_vs_transformers.py [--repeats 5] [--new-tokens 128] \
        [--threads N] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from quickdraft.bench.hardware import cpu_model, loadavg, provenance, provenance_line

# Model shape: ~25.2M parameters (12.6M in the untied embedding + lm_head, 12.6M in 8 layers).
MODEL = dict(
    vocab_size=16384,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=2,  # GQA: 3 query heads per kv head, head_dim 64
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def make_checkpoint(path: Path, seed: int) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(**MODEL)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats (each runs ours and theirs once)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs of each before timing")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per call")
    ap.add_argument("--prompt-len", type=int, default=32, help="random prompt length")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="ar_vs_transformers_cpu", help="result files NAME.json and NAME.md")
    args = ap.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    load_before = loadavg()  # other processes on the machine add noise; record how busy it was

    import transformers
    from transformers import AutoModelForCausalLM

    from quickdraft import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix="qd_ar_bench_") as tmp:
        ckpt = Path(tmp) / "llama25m"
        n_params = make_checkpoint(ckpt, args.seed)
        print(f"checkpoint: {n_params:,} parameters ({n_params / 1e6:.1f}M), torch threads {threads}")

        ours = LLM(target=str(ckpt), method="none", dtype="float32", device="cpu")
        theirs = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        n_params_qd = sum(p.numel() for p in ours.target.parameters())

        g = torch.Generator().manual_seed(args.seed + 1)
        prompt = torch.randint(3, MODEL["vocab_size"], (args.prompt_len,), generator=g).tolist()
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        input_ids = torch.tensor([prompt])
        attention_mask = torch.ones_like(input_ids)
        eos_id = theirs.generation_config.eos_token_id

        def run_ours() -> tuple[float, list[int]]:
            t0 = time.perf_counter()
            out = ours.generate([prompt], params)[0]
            return time.perf_counter() - t0, list(out.token_ids)

        def run_theirs() -> tuple[float, list[int]]:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = theirs.generate(input_ids, attention_mask=attention_mask, max_new_tokens=args.new_tokens,
                                      min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0, out[0, len(prompt):].tolist()

        for _ in range(args.warmup):
            run_ours()
            run_theirs()

        ours_s, theirs_s, ratios = [], [], []
        ours_tokens = theirs_tokens = None
        identical = True
        for i in range(args.repeats):
            if i % 2 == 0:
                (to, ours_tokens), (tt, theirs_tokens) = run_ours(), run_theirs()
            else:
                (tt, theirs_tokens), (to, ours_tokens) = run_theirs(), run_ours()
            identical &= ours_tokens == theirs_tokens
            assert len(ours_tokens) == len(theirs_tokens) == args.new_tokens, (len(ours_tokens), len(theirs_tokens))
            ours_s.append(to)
            theirs_s.append(tt)
            ratios.append(tt / to)  # = ours tok/s / theirs tok/s
            print(f"repeat {i + 1}/{args.repeats}: ours {to:.3f}s ({args.new_tokens / to:.1f} tok/s)  "
                  f"transformers {tt:.3f}s ({args.new_tokens / tt:.1f} tok/s)  ratio {tt / to:.3f}")

    first_diff = next((j for j, (a, b) in enumerate(zip(ours_tokens, theirs_tokens)) if a != b), None)
    eos_ids = eos_id if isinstance(eos_id, list) else [eos_id] if eos_id is not None else []
    med_o, med_t = statistics.median(ours_s), statistics.median(theirs_s)
    result = {
        "benchmark": "ar_vs_transformers",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable.replace(os.getcwd() + "/", ""), *sys.argv]),
        "hardware": {"device": "cpu", "cpu_model": cpu_model(), "logical_cores": os.cpu_count(),
                     "torch_threads": threads},
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "model": {**MODEL, "num_parameters": n_params, "num_parameters_quickdraft": n_params_qd,
                  "dtype": "float32", "seed": args.seed},
        "workload": {"batch_size": 1, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "greedy": True, "warmup": args.warmup, "repeats": args.repeats,
                     "timing": "wall time of the whole generate call (prefill + decode)",
                     "ours": "quickdraft.LLM(method='none').generate(SamplingParams(temperature=0, ignore_eos=True))",
                     "theirs": "transformers model.generate(do_sample=False, min_new_tokens=max_new_tokens)"},
        "ours": {"seconds": ours_s, "median_s": med_o, "median_tokens_per_s": args.new_tokens / med_o},
        "transformers": {"seconds": theirs_s, "median_s": med_t, "median_tokens_per_s": args.new_tokens / med_t},
        "ratio_of_medians": med_t / med_o,
        "median_of_ratios": statistics.median(ratios),
        "ratios": ratios,
        "ratio_definition": "ours tokens/s / transformers tokens/s (> 1: ours faster)",
        "greedy_identical": identical,
        "first_difference_at": first_diff,
        "eos_in_output": any(t in eos_ids for t in ours_tokens),
        "provenance": provenance("cpu", threads, load_before=load_before),
    }

    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = f"""# Plain decoding: quickdraft vs transformers (CPU, float32, batch 1)

{provenance_line(result['provenance'])}

Random Llama, {n_params / 1e6:.1f}M parameters ({MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, \
{MODEL['num_attention_heads']} heads / {MODEL['num_key_value_heads']} kv heads, vocab {MODEL['vocab_size']}), \
{args.prompt_len}-token random prompt, {args.new_tokens} new tokens, greedy. Time is the whole generate call \
(prefill + decode); {args.warmup} warm-up runs each, then {args.repeats} repeats, ours and transformers \
interleaved (order alternating).

| | median s | median tokens/s |
| --- | ---: | ---: |
| quickdraft (`method="none"`) | {med_o:.3f} | {args.new_tokens / med_o:.1f} |
| transformers `generate` | {med_t:.3f} | {args.new_tokens / med_t:.1f} |

- ratio (ours tokens/s / transformers tokens/s): **{med_t / med_o:.3f}** of medians, \
**{statistics.median(ratios):.3f}** median of per-repeat ratios (per repeat: {", ".join(f"{r:.3f}" for r in ratios)})
- greedy outputs token-identical: **{"yes" if identical else f"no (first difference at token {first_diff})"}**

Hardware: {cpu_model()}, {os.cpu_count()} logical cores, torch threads {threads}. \
torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}. \
Date {result['date']}.

Command: `{result['command']}`
"""
    (args.out_dir / f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
