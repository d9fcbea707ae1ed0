"""Attention split over the threads by keys and outputs (kernels.use_attend_split), against whole
passes per kv head: one sequence decoding at long contexts, where a model with fewer kv heads
than a multiple of the threads (SmolLM2: 3 kv heads on 2 threads) leaves a thread idle for a
third of attention.

Two measurements, each split "off" and "auto" alternating (every other pair reversed), medians:
  - the kernel alone: `attend` for one token (3 query heads per kv head) and for a few tokens (a
    prompt chunk) over --contexts keys of a float16 cache, SmolLM2's heads;
  - whole decoding: the model (`--target`, AOT steps) after a prompt of each context length,
    --new-tokens greedy tokens, decode tokens/s from the first streamed token; the outputs of the
    two modes are compared (the bits are the same, so the tokens must be).

    python benchmarks/attend_split.py --target smollm2 --threads 2 --contexts 1000,2000,3000,4000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from quickdraft.bench.hardware import loadavg, provenance, provenance_line, steady_steps

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "auto")


def kernel_us(kernels, T: int, L: int, calls: int) -> float:
    """Median microseconds of one attend call: T tokens x 9 query heads over 3 kv heads of L keys."""
    g = torch.Generator().manual_seed(L + T)
    q = torch.randn(1, 9, T, 64, generator=g)
    k, v = (torch.randn(1, 3, L, 64, generator=g).half() for _ in range(2))
    mask = torch.ones(1, 1, T, L, dtype=torch.bool)
    for t in range(T):
        mask[:, :, t, L - T + t + 1:] = False
    for _ in range(3):
        kernels.attend(q, k, v, mask, 0.125)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        kernels.attend(q, k, v, mask, 0.125)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    steady_steps()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2", help="a catalogue name or folder (bundled: the bundled target)")
    ap.add_argument("--compile", choices=["aot", "eager"], default="aot", help="the target's steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="1000,2000,3000,4000")
    ap.add_argument("--chunk-tokens", default="1,4", help="query tokens per kernel call (1: a decode step)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--calls", type=int, default=100, help="kernel calls per measurement")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="attend_split_cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from quickdraft import LLM, SamplingParams, kernels

    load_before = loadavg()
    contexts = [int(x) for x in args.contexts.split(",")]
    rows = []
    for L in contexts:  # the kernel alone
        for T in (int(x) for x in args.chunk_tokens.split(",")):
            times = {m: [] for m in MODES}
            for r in range(args.repeats):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    with kernels.use_attend_split(mode):
                        times[mode].append(kernel_us(kernels, T, L, args.calls))
            ratios = [a / o for a, o in zip(times["auto"], times["off"])]
            rows.append({"what": "kernel", "context": L, "tokens": T,
                         "off_us": statistics.median(times["off"]), "auto_us": statistics.median(times["auto"]),
                         "auto_over_off": statistics.median(ratios)})
            print(rows[-1], flush=True)
    llm = LLM(None if args.target == "bundled" else args.target, method="none",
              compile="aot" if args.compile == "aot" else False)
    steps = type(llm.engine._forward).__name__
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rng = random.Random(0)
    vocab = llm.target.config.vocab_size

    def decode(prompt: list[int]) -> tuple[float, list[int]]:
        first, last = None, None
        for out in llm.stream(prompt, params):
            if first is None:
                first = time.perf_counter()
            last = out
        return (len(last.token_ids) - 1) / (time.perf_counter() - first), list(last.token_ids)

    for L in contexts:  # whole decoding
        prompt = [rng.randrange(100, vocab) for _ in range(L)]
        decode(prompt)  # (warm: this length's first steps)
        rates, tokens = {m: [] for m in MODES}, {}
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                with kernels.use_attend_split(mode):
                    rate, ids = decode(prompt)
                rates[mode].append(rate)
                tokens.setdefault(mode, []).append(ids)
        ratios = [a / o for a, o in zip(rates["auto"], rates["off"])]
        same = all(t == tokens["off"][0] for m in MODES for t in tokens[m])
        rows.append({"what": "decode", "context": L, "tokens": 1, "off_tok_s": statistics.median(rates["off"]),
                     "auto_tok_s": statistics.median(rates["auto"]), "auto_over_off": statistics.median(ratios),
                     "ratios": [round(x, 3) for x in ratios], "identical": same})
        print(rows[-1], flush=True)
    record = provenance(threads=args.threads, load_before=load_before)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = {"rows": rows, "target": args.target, "steps": steps, "threads": args.threads,
           "isa": kernels.isa(), "provenance": record}
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(out, indent=2))
    lines = [f"# Attention split over {args.threads} threads by keys and outputs, against whole passes per kv head",
             "", provenance_line(record), "",
             f"Kernel path {kernels.isa()}; `auto`: split where a call's passes are too few for the threads and "
             f"its keys many (the default); `off`: whole passes. Medians of {args.repeats} alternating pairs "
             f"(ratio: median of per-pair ratios, < 1 is faster for the kernel, > 1 faster for decoding).", "",
             "| measurement | context (keys) | query tokens | off | auto | auto / off | identical |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["what"] == "kernel":
            lines.append(f"| attend, SmolLM2's heads, float16 cache (us) | {r['context']} | {r['tokens']} | "
                         f"{r['off_us']:.1f} | {r['auto_us']:.1f} | {r['auto_over_off']:.3f} | |")
        else:
            lines.append(f"| {args.target} decoding, batch 1, {steps} (tok/s) | {r['context']} | 1 | "
                         f"{r['off_tok_s']:.1f} | {r['auto_tok_s']:.1f} | {r['auto_over_off']:.3f} | {r['identical']} |")
    lines += ["", f"`python benchmarks/attend_split.py {' '.join(argv) if argv else ' '.join(os.sys.argv[1:])}`", ""]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
