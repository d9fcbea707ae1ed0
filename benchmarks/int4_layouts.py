"""int4's two layouts for float weights, paired in one process: the super-block layout
(quant.INT4_SUPER_BLOCKS: where a layer's inputs are a multiple of 256, per 8 groups of 32 inputs a
float16 scale and offset factor per output, per group 8-bit codes: 4.625 bits a weight) against the
float16 layout quantization="int4" packs by default (a float16 scale and offset per group: 5 bits).
Both models are loaded from the same weights, on the ahead-of-time
compiled steps by default, and decode the same prompt greedily, one after the other in each
repeat (the order reversed every other repeat), at each thread count: this VM's memory bandwidth
drifts by 20-30% within minutes, so only ratios measured side by side mean much. Random weights
(the big model) say nothing of quality: benchmarks/perplexity.py --formats int4,int4-super does.

    python benchmarks/int4_layouts.py --model big --threads 1 2 --repeats 5 --out-dir DIR --name NAME
    python benchmarks/int4_layouts.py --tiny   # a smoke test: the bundled target, eager, 8 tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llamacpp import big_folder, set_threads  # noqa: E402  (the 1.7B shape, made once)

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.bench.hardware import loadavg, provenance, provenance_line  # noqa: E402
from quickdraft.model import quant  # noqa: E402
from quickdraft.model.sources import BUNDLED_DIR  # noqa: E402

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
LAYOUTS = {"super": True, "float16": False}  # name -> quant.INT4_SUPER_BLOCKS


def decode(llm: LLM, ids: list[int], n: int) -> float:
    """Decode tokens per second (after the first token) of one greedy request."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    first = end = None
    count = 0
    for out in llm.stream(ids, params):
        if first is None:
            first = time.perf_counter()
        count = len(out.token_ids)
    end = time.perf_counter()
    return (count - 1) / (end - first)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="big", help="big (SmolLM2-1.7B's shape, random bf16 weights), or a "
                   "catalogue name / bundled model / folder")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--compile", default="aot", choices=["aot", "off"])
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--name", default="int4_layouts")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    if args.tiny:
        args.model, args.threads, args.repeats, args.new_tokens, args.compile = "bundled", [1], 2, 8, "off"
    load_before = loadavg()
    target = str(big_folder()) if args.model == "big" else (str(BUNDLED_DIR / "target") if args.model == "bundled"
                                                            else args.model)
    set_threads(max(args.threads))
    llms, loads = {}, {}
    for name, on in LAYOUTS.items():
        with quant.int4_super_blocks(on):
            started = time.perf_counter()
            llms[name] = LLM(target, quantization="int4", method="none", device="cpu",
                             compile="aot" if args.compile == "aot" else False)
            loads[name] = time.perf_counter() - started
    ids = llms["super"].tokenizer.encode(PROMPT)
    bytes_per_token = {n: quant.bytes_read_per_token(llm.engine.target) for n, llm in llms.items()}
    steps = {n: type(llm.engine._forward).__name__ for n, llm in llms.items()}
    rows = []
    for threads in args.threads:
        set_threads(threads)
        for llm in llms.values():  # a warm-up at this thread count
            decode(llm, ids, 4)
        tps = {n: [] for n in llms}
        for r in range(args.repeats):
            for n in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
                tps[n].append(decode(llms[n], ids, args.new_tokens))
        ratios = [s / f for s, f in zip(tps["super"], tps["float16"])]
        rows.append({"threads": threads, "tok_s": {n: statistics.median(v) for n, v in tps.items()},
                     "runs": tps, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios)})
        print(f"{threads} thread(s): super {rows[-1]['tok_s']['super']:.1f} tok/s, float16 "
              f"{rows[-1]['tok_s']['float16']:.1f} tok/s, paired ratio {rows[-1]['ratio_median']:.3f} "
              f"({min(ratios):.3f} - {max(ratios):.3f})", flush=True)
    prov = provenance("cpu", args.threads, load_before=load_before)
    result = {"model": args.model, "new_tokens": args.new_tokens, "repeats": args.repeats, "compile": args.compile,
              "bytes_per_token": bytes_per_token, "steps": steps, "load_s": loads, "rows": rows, "provenance": prov}
    md = [f"# int4 from float weights: the super-block layout against the float16 layout ({args.model})", "",
          provenance_line(prov), "",
          f"Weights read per token: super-block {bytes_per_token['super'] / 1e6:.0f} MB, float16 layout "
          f"{bytes_per_token['float16'] / 1e6:.0f} MB ({bytes_per_token['super'] / bytes_per_token['float16']:.3f}x); "
          f"steps: {steps['super']} / {steps['float16']}; greedy, {args.new_tokens} new tokens, {args.repeats} paired "
          "repeats (order alternating).", "",
          "| threads | super-block tok/s | float16 layout tok/s | paired ratio (min - max) |", "|---:|---:|---:|---|"]
    md += [f"| {r['threads']} | {r['tok_s']['super']:.1f} | {r['tok_s']['float16']:.1f} | "
           f"{r['ratio_median']:.3f}x ({r['ratio_min']:.3f} - {r['ratio_max']:.3f}) |" for r in rows]
    print("\n".join(md))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out_dir / f"{args.name}.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
