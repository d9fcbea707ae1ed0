"""Step costs behind chunked prefill: a decode step of the running rows, a prompt chunk alone, and
the two in one mixed step, on the eager model and on the AOT packages (the decode package and the
packed mixed-step one), per chunk size and per position of the chunk in its prompt.

In-process, no server: `--rows` rows decode one token each at position `--context`; one more row
holds a prompt whose next chunk starts at each of `--positions` (the caches hold random keys and
values: the cost does not depend on them). Every measurement is interleaved with the others and
repeated (`--repeats`); medians in ms, and each step's ratio to the decode step of its own mode
(what a running stream's gap grows by: alternating, a chunk step comes between two decode steps,
so a stream waits decode + chunk; mixed, it waits the mixed step).

    python benchmarks/mixed_steps.py --target smollm2 --threads 2 --modes eager,aot
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

from quickdraft.bench.hardware import provenance, provenance_line

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, out: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="a catalogue name or folder (default: the bundled target)")
    ap.add_argument("--modes", default="eager,aot", help="eager and/or aot (builds the packages when missing)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--context", type=int, default=200, help="the running rows' position")
    ap.add_argument("--positions", default="0,2000,3900", help="where the chunk starts in its prompt")
    ap.add_argument("--chunks", default="8,16,32,64")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="mixed_steps_cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from quickdraft import aot
    from quickdraft.cache import KVCache
    from quickdraft.llm import LLM
    from quickdraft.model.transformer import Block, forward_chunks, pad_chunks

    load_before = os.getloadavg()[0]
    llm = LLM(args.target, method="none", compile=False)
    model = llm.target
    modes = args.modes.split(",")
    step = aot.load_or_build(model, packed=True) if "aot" in modes else None
    if "aot" in modes and (step is None or step.packed_runner is None):
        raise SystemExit("no AOT packages for this model here")
    positions = [int(p) for p in args.positions.split(",")]
    sizes = [int(c) for c in args.chunks.split(",")]
    R = args.rows
    cache = KVCache.for_model(model, R + 1, max(positions) + max(sizes) + args.context + 2)
    g = torch.Generator().manual_seed(0)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    V = model.config.vocab_size
    ids = torch.randint(0, V, (R, 1), generator=g)
    pos = torch.full((R, 1), args.context)
    running, prompt_row = cache.rows(0, R), cache.rows(R, R + 1)
    kv = args.context + 1

    def decode(mode):
        return (lambda: model(ids, pos, running, kv_len=kv)) if mode == "eager" else \
            (lambda: step(ids, pos, running, kv_len=kv))

    def chunk(mode, n, p):
        toks = torch.randint(0, V, (n,), generator=g).tolist()
        if mode == "eager":
            return lambda: forward_chunks(model, [toks], [p], prompt_row)
        b = (*pad_chunks([toks], [p], model.device)[:3], prompt_row, p + n)
        return lambda: step.packed(None, b)

    def mixed(mode, n, p):
        toks = torch.randint(0, V, (n,), generator=g).tolist()
        if mode == "eager":
            blocks = [Block(ids, pos, 0, kv), Block(torch.tensor([toks]), torch.arange(p, p + n)[None], R, p + n,
                                                    logits_at=torch.tensor([[n - 1]]))]
            return lambda: model.forward_packed(blocks, cache.rows(0, R + 1))
        b = (*pad_chunks([toks], [p], model.device)[:3], prompt_row, p + n)
        return lambda: step.packed((ids, pos, running, kv), b)

    cases = {}
    for mode in modes:
        cases[(mode, "decode", 0, 0)] = decode(mode)
        for n in sizes:
            for p in positions:
                cases[(mode, "chunk", n, p)] = chunk(mode, n, p)
                cases[(mode, "mixed", n, p)] = mixed(mode, n, p)
    times: dict = {key: [] for key in cases}
    with torch.inference_mode():
        for fn in cases.values():  # warm-up
            fn()
        for rep in range(args.repeats):
            for key in (list(cases) if rep % 2 == 0 else list(cases)[::-1]):
                timed(cases[key], times[key])
    med = {key: statistics.median(v) for key, v in times.items()}
    rows = []
    for (mode, kind, n, p), t in med.items():
        base = med[(mode, "decode", 0, 0)]
        rows.append({"mode": mode, "step": kind, "chunk_tokens": n, "chunk_position": p, "median_ms": 1e3 * t,
                     "over_decode": t / base})
    result = {"target": args.target or "bundled", "rows": R, "context": args.context, "repeats": args.repeats,
              "threads": args.threads, "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
              "table": rows, "command": "python benchmarks/mixed_steps.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "provenance": provenance(threads=args.threads)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Step costs: {R} rows decoding beside a prompt chunk ({result['target']}, {args.threads} threads)", "",
             "Alternating, a running stream waits decode + chunk; mixed, the mixed step. Ratios to the decode step "
             "of the same mode.", "",
             "| mode | chunk tokens | chunk position | decode ms | chunk alone ms | mixed ms | "
             "(decode + chunk) / decode | mixed / decode |", "|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        d = med[(mode, "decode", 0, 0)]
        for n in sizes:
            for p in positions:
                c, m = med[(mode, "chunk", n, p)], med[(mode, "mixed", n, p)]
                lines.append(f"| {mode} | {n} | {p} | {1e3 * d:.1f} | {1e3 * c:.1f} | {1e3 * m:.1f} | "
                             f"{(d + c) / d:.2f} | {m / d:.2f} |")
    lines += ["", f"Medians over {args.repeats} interleaved repeats (every other one reversed); load "
              f"{load_before:.2f} -> {result['loadavg_1m_after']:.2f}.", "", f"`{result['command']}`", "",
              provenance_line(result["provenance"]), ""]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
