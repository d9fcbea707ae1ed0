"""A decode step's cost by KV cache element type (kv_cache_dtype: float32, float16, bfloat16) and
context length: the whole model's forward of q new rows (1: a decode step; 6: a verify step of
k = 5) over L cached positions, batch 1, on the eager forward (--aot: the ahead-of-time package
built for each cache type, not timed). Each round takes the cache types in turn (reversed every
other round), one model in memory; medians over rounds of this thread's CPU time at 1 thread,
wall time otherwise. A 16-bit cache halves the bytes a step reads per cached token, which past a
few hundred tokens is a large share of what a CPU decode step reads (SmolLM2-135M: 46 KB of
float32 keys and values per token, against ~70 MB of int4 weights per step).

    taskset -c 1 python benchmarks/kv_cache_dtype.py --model smollm2 --format int4 \\
        --contexts 500,1000,2000,4000 --out /tmp/kv/kv_cache_dtype.json
    python benchmarks/kv_cache_dtype.py --tiny   # a smoke test: the bundled target, 2 layers
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
from verify_table import load  # noqa: E402  (the same models and formats)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def measure(args, model: str, fmt: str) -> dict:
    from quickdraft.cache import KVCache

    net = load(model, fmt, args.layers)
    longest = max(args.contexts) + max(args.rows) + 1
    ids = torch.randint(0, 1000, (1, longest), generator=torch.Generator().manual_seed(0))
    steps, caches = {}, {}
    for name in args.dtypes:
        net.kv_cache_dtype = None if DTYPES[name] == net.dtype else DTYPES[name]
        steps[name] = net
        if args.aot:
            from quickdraft import aot

            steps[name] = aot.load_or_build(net) or net
        caches[name] = KVCache.for_model(net, 1, longest)
    net.kv_cache_dtype = None
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    times = {name: {L: {q: [] for q in args.rows} for L in args.contexts} for name in args.dtypes}
    with torch.inference_mode():
        filled = 0
        for L in sorted(args.contexts):  # each cache prefilled up to L (chunks of 512), then timed there
            for name in args.dtypes:
                view = caches[name].rows(0, 1)
                for s in range(filled, L, 512):
                    e = min(L, s + 512)
                    net(ids[:, s:e], torch.arange(s, e)[None], view, kv_len=e)
            filled = L
            for r in range(args.rounds):
                for name in (args.dtypes if r % 2 == 0 else args.dtypes[::-1]):
                    view, step = caches[name].rows(0, 1), steps[name]
                    for q in args.rows:  # the q rows after the context (the same cache slots each time)
                        def call():
                            return step(ids[:, L:L + q], torch.arange(L, L + q)[None], view, kv_len=L + q)

                        call()
                        start = clock()
                        for _ in range(args.calls):
                            call()
                        times[name][L][q].append((clock() - start) / args.calls * 1e3)
    out = {"step": type(steps[args.dtypes[0]]).__name__}
    for name in args.dtypes:
        out[name] = {str(L): {str(q): round(statistics.median(v), 3) for q, v in per.items()}
                     for L, per in times[name].items()}
    return out


def markdown(result: dict) -> str:
    from quickdraft.bench.hardware import provenance_line

    a = result["args"]
    base = a["dtypes"][0]
    lines = [f"# A step's cost by KV cache dtype and context, batch 1, {a['threads']} thread(s), "
             f"{'AOT packages' if a['aot'] else 'eager forward'}, {a['clock']} (median of {a['rounds']} rounds)", "",
             provenance_line(result["provenance"]), "",
             "| model | format | context | q | " + " | ".join(f"{d} ms" for d in a["dtypes"]) + " | "
             + " | ".join(f"{d} / {base}" for d in a["dtypes"][1:]) + " |",
             "|---|---|---:|---:|" + "---:|" * (2 * len(a["dtypes"]) - 1)]
    for model, per_fmt in result["results"].items():
        for fmt, per in per_fmt.items():
            for L in map(str, a["contexts"]):
                for q in map(str, a["rows"]):
                    ms = [per[d][L][q] for d in a["dtypes"]]
                    lines.append(f"| {model} | {fmt} | {L} | {q} | " + " | ".join(f"{m:.2f}" for m in ms) + " | "
                                 + " | ".join(f"{m / ms[0]:.2f}x" for m in ms[1:]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from quickdraft.bench.hardware import loadavg, provenance, steady_steps

    steady_steps()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2, 1.7b, bundled (comma-separated)")
    p.add_argument("--format", default="int4", help="f32, bf16, int8, int4 (comma-separated)")
    p.add_argument("--dtypes", default="float32,float16,bfloat16", help="cache types; the first is the baseline")
    p.add_argument("--contexts", default="500,1000,2000,4000")
    p.add_argument("--rows", default="1,6", help="query rows per step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="timed calls per measurement")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (smoke tests)")
    p.add_argument("--aot", action="store_true", help="time the ahead-of-time packages (built first, not timed)")
    p.add_argument("--out", type=Path, default=None, help="JSON out; the markdown table beside it (.md)")
    p.add_argument("--tiny", action="store_true", help="a smoke test: the bundled target, 2 layers, short contexts")
    args = p.parse_args()
    if args.tiny:
        args.model, args.format, args.layers, args.contexts, args.rounds, args.calls = "bundled", "f32", 2, "40,90", 1, 1
    args.model, args.format = args.model.split(","), args.format.split(",")
    args.dtypes = args.dtypes.split(",")
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.rows = [int(r) for r in args.rows.split(",")]
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown cache dtype(s) {unknown}: {', '.join(DTYPES)}")
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    results = {m: {f: measure(args, m, f) for f in args.format} for m in args.model}
    result = {"args": {**vars(args), "out": str(args.out),
                       "clock": "thread CPU time" if args.threads == 1 else "wall time"},
              "results": results, "load_after": loadavg(),
              "provenance": provenance("cpu", threads=args.threads, load_before=load_before)}
    text = markdown(result)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
