"""The step that admits one more request while others stream, when that admission grows the KV
cache's rows: with the rows' address space reserved (the default on a CPU: more rows are a view
of the same memory) against without (`reserve_rows=0`: a new cache and a copy of every cached
position of the running rows, written page by page into fresh memory). Every running stream waits
for that step: it is an inter-token gap.

In one process, alternating the two per repeat: `--streams` requests of `--stream-prompt` tokens
decode `--decoded` tokens each (the cache then holds about prompt + decoded positions per row),
then a request of `--new-prompt` tokens arrives; the table gives the step that admits it (its
first prefill chunk rides in it), the next step, and the streams' steady step (median of 20).

    taskset -c 1 python benchmarks/kv_growth.py --out-dir benchmarks/results --name kv_growth_cpu
    python benchmarks/kv_growth.py --repeats 1 --decoded 8 --out-dir /tmp/x      # a smoke test

With `--first N`, a request of N prompt tokens runs first, so the caches are first sized for it
and grow to more positions (a copy) when the streams arrive, as in a server whose first request
was short: a third mode then keeps the reservation's bytes through that growth, fewer rows at more
positions (what KVCache.resize did before the engine passed the rows its budget affords at the new
capacity), so the admission copies again.

With `--method draft` (or `eagle3`) the streams speculate and the proposer's own KV cache grows
with the target's: a third mode then reserves the target's rows but copies the proposer's (what
the engine did before `Proposer.reserve_rows`). The streams then step until the longest holds
`--stream-prompt` + `--decoded` positions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="a model name, folder or GGUF (default: the bundled target)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-prompt", type=int, default=100)
    ap.add_argument("--decoded", type=int, default=600, help="tokens each stream decodes before the new request")
    ap.add_argument("--new-prompt", type=int, default=300)
    ap.add_argument("--first", type=int, default=0, help="a request of this many prompt tokens first (0: none)")
    ap.add_argument("--method", default="none", help="none, draft or eagle3 (the target's shipped draft / head)")
    ap.add_argument("--repeats", type=int, default=4, help="per mode, alternating")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--name", default="kv_growth")
    args = ap.parse_args(argv)

    import torch

    from quickdraft import LLM, SamplingParams
    from quickdraft.bench.hardware import loadavg, provenance, provenance_line
    from quickdraft.cache import KVCache
    from quickdraft.proposers.base import OwnKVProposer

    torch.set_num_threads(args.threads)
    reserved = KVCache.for_model.__func__

    def copying(cls, model, max_slots, capacity, reserve_rows=0):
        return reserved(cls, model, max_slots, capacity, 0)

    modes = {"reserved rows (view)": classmethod(reserved), "no reservation (copy)": classmethod(copying)}
    hint, resize = OwnKVProposer.reserve_rows, KVCache.resize
    if args.method != "none":
        modes["target's rows reserved, the proposer's copied"] = classmethod(reserved)
    if args.first:
        modes["reservation's bytes kept at a new capacity"] = classmethod(reserved)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    load_before = loadavg()
    slack = 50 if args.method == "none" else 300  # (speculation: up to k + 1 tokens a step, 20 steady steps)
    stream = SamplingParams(temperature=0, max_tokens=args.decoded + slack, ignore_eos=True)
    for rep in range(args.repeats):
        for mode in (list(modes) if rep % 2 == 0 else list(modes)[::-1]):
            KVCache.for_model = modes[mode]
            if mode.startswith("target's"):
                OwnKVProposer.reserve_rows = lambda self, rows: None
            if mode.startswith("reservation's"):
                KVCache.resize = lambda self, *a, reserve_rows=None, **kw: resize(self, *a, **kw)
            if mode.startswith("no reservation"):  # (nor at a new capacity)
                KVCache.resize = lambda self, *a, reserve_rows=None, **kw: resize(self, *a, reserve_rows=0, **kw)
            try:
                engine = LLM(args.target, method=args.method, policy="fixed").engine
                if args.first:
                    engine.add_request([j % 230 + 5 for j in range(args.first)],
                                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                    while engine.has_unfinished():
                        engine.step()
                for i in range(args.streams):
                    engine.add_request([(7 * i + j) % 200 + 3 for j in range(args.stream_prompt)], stream)
                while max([len(r.tokens) for r in engine.running] + [0]) < args.stream_prompt + args.decoded:
                    engine.step()
                steady = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    engine.step()
                    steady.append(time.perf_counter() - t0)
                rows_before = engine.cache.max_slots
                positions = max(len(r.tokens) for r in engine.running)
                engine.add_request([j % 250 + 9 for j in range(args.new_prompt)],
                                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                steps = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    engine.step()
                    steps.append(time.perf_counter() - t0)
                runs[mode].append({"admission_ms": 1e3 * steps[0], "next_ms": 1e3 * steps[1],
                                   "steady_ms": 1e3 * statistics.median(steady), "rows": [rows_before,
                                                                                          engine.cache.max_slots],
                                   "capacity": engine.cache.capacity, "positions": positions})
                print(mode, runs[mode][-1], flush=True)
            finally:
                KVCache.for_model = classmethod(reserved)
                OwnKVProposer.reserve_rows, KVCache.resize = hint, resize
            del engine
    summary = {m: {key: statistics.median(r[key] for r in rs) for key in ("admission_ms", "next_ms", "steady_ms")}
               for m, rs in runs.items()}
    result = {"target": args.target or "bundled", "method": args.method, "args": {k: str(v) for k, v in vars(args).items()},
              "runs": runs, "summary": summary, "load": [load_before, loadavg()], "provenance": provenance()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    first = next(iter(runs.values()))[0]
    lines = [f"# The step that admits a request and grows the KV rows ({result['target']}, method {args.method}, "
             f"{args.streams} streams)", "",
             f"Rows {first['rows'][0]} -> {first['rows'][1]} at {first['capacity']} positions; the streams held up to "
             f"{first['positions']} positions each; the new prompt {args.new_prompt} tokens; "
             f"{args.threads} thread(s); medians of {args.repeats} runs per mode, alternating.", "",
             "| KV rows | admission step ms | next step ms | steady step ms |", "|---|---:|---:|---:|"]
    for m, s in summary.items():
        lines.append(f"| {m} | {s['admission_ms']:.1f} | {s['next_ms']:.1f} | {s['steady_ms']:.1f} |")
    lines += ["", f"Load average (1 min) {result['load'][0]} before, {result['load'][1]} after.", "",
              provenance_line(result["provenance"])]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
