"""Tensor parallelism on this machine: the bundled target at 1 and 2 ranks (gloo, CPU).

Measures, side by side and as medians over repeats:
- comm: the collectives of one step alone, in a 2-process gloo group of their own: the command
  header (broadcast_object_list) + the step's packed input ids, and the 2 all-reduces per layer
  of the (B, T, hidden) float32 activations (T = 1: a plain decode step; T = k+1 = 6: a verify
  step), plus the vocab-parallel head's gather of (B, T, V/2) logits;
- forward: one target forward over a KV cache (B = 1, T = 1 and 6) at 1 rank (2 threads, and
  1 thread) and at 2 ranks (1 thread each: the same 2 cores), with lm_head on rank 0 only or
  vocabulary-parallel;
- generate: greedy tokens/s of plain decoding and of speculative decoding (the bundled draft,
  k = 5) at 1 and 2 ranks, the outputs checked identical.

    .venv/bin/python benchmarks/tensor_parallel.py [--repeats 7] [--out-dir benchmarks/results]
    .venv/bin/python benchmarks/tensor_parallel.py --repeats 1 --iters 1 --new-tokens 4 --out-dir /tmp/x  # smoke test
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
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from quickdraft import LLM, SamplingParams
from quickdraft.bench.hardware import cpu_model, loadavg, provenance, provenance_line
from quickdraft.cache import KVCache

HIDDEN, LAYERS, VOCAB = 512, 8, 8192  # the bundled target's shape


def _comm_rank(rank: int, port: int, iters: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for T in (1, 6):
        x = torch.randn(1, T, HIDDEN)
        logits = torch.randn(1, T, VOCAB // 2)
        ids = torch.zeros(3 * T + 1, dtype=torch.long)
        parts = {"header+inputs": [], "all-reduces": [], "vocab gather": []}
        for i in range(iters + 5):
            dist.barrier()
            t0 = time.perf_counter()
            box = [("forward", {"rows": (0, 0, 1), "kv_len": 100, "hidden_at": None,
                                "names": ["input_ids", "positions", "logits_at"], "freed": []},
                    [((1, T), False), ((1, T), False), ((1, 1), False)])]
            dist.broadcast_object_list(box, src=0)
            dist.broadcast(ids, src=0)
            t1 = time.perf_counter()
            for _ in range(2 * LAYERS):
                dist.all_reduce(x)
            t2 = time.perf_counter()
            dist.gather(logits, [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None, dst=0)
            t3 = time.perf_counter()
            if i >= 5:
                parts["header+inputs"].append(t1 - t0)
                parts["all-reduces"].append(t2 - t1)
                parts["vocab gather"].append(t3 - t2)
        results[T] = {k: statistics.median(v) * 1e6 for k, v in parts.items()}
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def measure_comm(iters: int) -> dict:
    from quickdraft.parallel.group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_comm_rank, args=(r, port, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=30)
    return res


def time_forward(llm: LLM, T: int, threads: int, iters: int) -> float:
    """Median seconds of one target forward of B=1, T tokens at position 100 over a KV cache."""
    torch.set_num_threads(threads)
    target = llm.target
    cache = KVCache.for_model(target, 1, 256)
    ids = torch.randint(0, VOCAB, (1, T))
    pos = (100 + torch.arange(T))[None]
    times = []
    with torch.inference_mode():
        for i in range(iters + 3):
            t0 = time.perf_counter()
            target(ids, pos, cache.rows(0, 1), kv_len=100 + T)
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_generate(llm: LLM, prompts: list[str], threads: int, new_tokens: int = 64) -> tuple[float, list[list[int]]]:
    torch.set_num_threads(threads)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / wall, [o.token_ids for o in outs]


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per generate timing")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="tensor_parallel_cpu", help="result files NAME.json and NAME.md")
    args = ap.parse_args()
    load_before = loadavg()
    started = time.perf_counter()

    comm = measure_comm(args.iters * 3)

    prompts = ["def fib(n):"]
    one = {m: LLM(method=m, compile=False, policy="fixed") for m in ("none", "draft")}
    two = {m: LLM(method=m, compile=False, tensor_parallel_size=2, policy="fixed") for m in ("none", "draft")}
    configs = {"1 rank, 2 threads": (one, 2), "1 rank, 1 thread": (one, 1), "2 ranks, 1 thread each": (two, 1)}
    fwd = {c: {T: [] for T in (1, 6)} for c in configs}
    gen = {c: {m: [] for m in ("none", "draft")} for c in configs}
    outputs = {}
    for r in range(args.repeats):
        order = list(configs)[r % 3:] + list(configs)[: r % 3]  # machine noise hits every config alike
        for c in order:
            llms, threads = configs[c]
            for T in (1, 6):
                fwd[c][T].append(time_forward(llms["none"], T, threads, args.iters))
            for m in ("none", "draft"):
                tps, toks = time_generate(llms[m], prompts, threads, args.new_tokens)
                gen[c][m].append(tps)
                outputs[(c, m)] = toks
    identical = len({json.dumps(v) for v in outputs.values()}) == 1
    for llm in two.values():
        llm.close()

    # lm_head vocabulary-parallel (gathered to rank 0) against lm_head on rank 0 only
    vocab = LLM(method="none", compile=False, tensor_parallel_size=2, tensor_parallel_options={"lm_head": "vocab"})
    head = {T: [] for T in (1, 6)}
    for r in range(args.repeats):
        for T in (1, 6):
            head[T].append(time_forward(vocab, T, 1, args.iters))
    vocab.close()

    med = statistics.median
    result = {
        "benchmark": "tensor parallelism of the bundled target (512 hidden, 8 layers, 8 heads / 4 KV heads, "
                     "8192 vocab, float32), gloo on CPU",
        "setup": {"hardware": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                  "python": platform.python_version(), "repeats": args.repeats, "iters": args.iters,
                  "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "command": shlex.join([sys.executable.split("/")[-1], *sys.argv]),
                  "wall_s": round(time.perf_counter() - started, 1)},
        "comm_per_step_us": {f"T={T}": {k: round(v, 1) for k, v in parts.items()} for T, parts in comm.items()},
        "forward_ms": {c: {f"T={T}": round(med(v) * 1e3, 3) for T, v in per.items()} for c, per in fwd.items()},
        "forward_ms_vocab_parallel_head": {f"T={T}": round(med(v) * 1e3, 3) for T, v in head.items()},
        "generate_tokens_per_s": {c: {m: round(med(v), 1) for m, v in per.items()} for c, per in gen.items()},
        "ratios": {
            "forward T=1, 2 ranks / 1 rank 2 threads": round(med(
                [a / b for a, b in zip(fwd["2 ranks, 1 thread each"][1], fwd["1 rank, 2 threads"][1])]), 3),
            "forward T=6, 2 ranks / 1 rank 2 threads": round(med(
                [a / b for a, b in zip(fwd["2 ranks, 1 thread each"][6], fwd["1 rank, 2 threads"][6])]), 3),
            "speculative speedup at 2 ranks (draft / none tokens/s)": round(med(
                [a / b for a, b in zip(gen["2 ranks, 1 thread each"]["draft"], gen["2 ranks, 1 thread each"]["none"])]),
                3),
        },
        "greedy_outputs_identical_across_configs": identical,
        "provenance": provenance("cpu", [2, 1], load_before=load_before),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# {result['benchmark']}", "", provenance_line(result["provenance"]), "",
             f"Hardware: {result['setup']['hardware']} ({os.cpu_count()} cores), "
             f"torch {torch.__version__}; medians of {args.repeats} repeats.", "",
             "## Collectives of one step (2 gloo ranks, µs)", "", "| T | header + inputs | 16 all-reduces | "
             "vocab gather |", "| --- | --- | --- | --- |"]
    for T, parts in result["comm_per_step_us"].items():
        lines.append(f"| {T} | {parts['header+inputs']} | {parts['all-reduces']} | {parts['vocab gather']} |")
    lines += ["", "## One target forward (B = 1, ms)", "", "| config | T=1 | T=6 |", "| --- | --- | --- |"]
    for c, per in result["forward_ms"].items():
        lines.append(f"| {c} | {per['T=1']} | {per['T=6']} |")
    h = result["forward_ms_vocab_parallel_head"]
    lines.append(f"| 2 ranks, vocab-parallel lm_head | {h['T=1']} | {h['T=6']} |")
    lines += ["", f"## Greedy generation ({args.new_tokens} tokens, tokens/s)", "", "| config | plain | draft k=5 |",
              "| --- | --- | --- |"]
    for c, per in result["generate_tokens_per_s"].items():
        lines.append(f"| {c} | {per['none']} | {per['draft']} |")
    lines += ["", "Ratios (medians of per-repeat ratios): " + "; ".join(f"{k}: {v}" for k, v in result["ratios"].items()),
              "", f"Greedy outputs identical across configs: {identical}.", "", f"Command: `{result['setup']['command']}`"]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
