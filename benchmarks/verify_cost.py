"""What a verify step of k + 1 tokens costs against a one-token step on this CPU (issue 19:
"T(k + 1) / T(1) as close to 1 as the kernels allow"), float32, batch 1, at a 400-token context,
for the two float32 CPU weight formats side by side: `blocked` (quickdraft's own small-M kernel,
quickdraft/kernels) and `transposed` (MKL's sgemm, the format before it). With --quantization
int8 / int4 the two sides are quickdraft's blocked int8 / int4 kernels (float32 activations) and
PyTorch's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` (bfloat16 activations), labelled
`blocked` and `pytorch`.

Each format runs in its own worker process (the format is chosen when the model is prepared);
the workers take turns, one round of every query length each, so both see the same machine
state; medians over rounds. Steps are the AOT packages (`compile="aot"`, built first and not
timed) and, with --eager, the eager forward too. Also records greedy output identity between
the two formats (64 tokens, plain decoding).

    python benchmarks/verify_cost.py --model smollm2 --threads 1 --out benchmarks/results/verify_cost_smollm2_cpu.json
    python benchmarks/verify_cost.py --model bundled --tiny --rounds 1 --out /tmp/x.json   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

QUERY = (1, 2, 3, 4, 5, 6, 8)
CONTEXT = 400


def worker(fmt: str, model: str, threads: int, eager: bool, quantization: str, conn, tiny: bool = False) -> None:
    """One format's process: with `tiny`, eager steps only (no AOT build), a 32-token context and
    8 greedy tokens (a smoke test)."""
    if fmt != "blocked":
        os.environ["QUICKDRAFT_KERNELS"] = "0"
    import torch

    from quickdraft import LLM, SamplingParams
    from quickdraft.cache import KVCache
    from quickdraft.llm import default_model_dirs

    torch.set_num_threads(threads)
    target = "smollm2" if model == "smollm2" else default_model_dirs()[0]
    context, new_tokens = (32, 8) if tiny else (CONTEXT, 64)
    llm = LLM(target, method="none", compile=False if tiny else "aot", dtype="float32",
              quantization=None if quantization == "none" else quantization)
    tgt = llm.target
    formats = sorted({m.fmt for m in tgt.modules() if hasattr(m, "fmt")})
    steps = {} if tiny else {"aot": llm.engine._forward}
    if eager or tiny:
        steps["eager"] = tgt
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    tokens = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0))[0].token_ids
    cache = KVCache.for_model(tgt, 1, context + 16)
    ids = torch.randint(0, 1000, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        tgt(ids, torch.arange(context)[None], cache.rows(0, 1), kv_len=context)
        view = cache.rows(0, 1)

        def call(step, t):
            return step(ids[:, :t], torch.arange(context, context + t)[None], view, kv_len=context + t)

        conn.send({"formats": formats, "steps": {k: type(v).__name__ for k, v in steps.items()}, "tokens": tokens})
        while conn.recv() == "round":
            out = {}
            for name, step in steps.items():
                for t in QUERY:
                    call(step, t)
                    start = time.perf_counter()
                    for _ in range(3):
                        call(step, t)
                    out[f"{name} T{t}"] = (time.perf_counter() - start) / 3 * 1e3
            conn.send(out)


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds a live process has used (Linux; 0 elsewhere): the workers are not reaped children,
    so cpu_seconds() would count them as other processes."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["bundled", "smollm2"], default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--eager", action="store_true", help="also time the eager forward")
    ap.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="eager steps only, a 32-token context, 8 greedy tokens "
                    "(a smoke test; use with --model bundled --rounds 1)")
    args = ap.parse_args()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from quickdraft.bench.hardware import cpu_seconds, loadavg, other_cpu_share, provenance

    ctx = mp.get_context("spawn")
    workers = {}
    other_side = "transposed" if args.quantization == "none" else "pytorch"
    for fmt in ("blocked", other_side):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(fmt, args.model, args.threads, args.eager, args.quantization, there,
                                                 args.tiny),
                           daemon=True)
        proc.start()
        workers[fmt] = (proc, here)
    info = {fmt: conn.recv() for fmt, (_, conn) in workers.items()}
    times = {fmt: {} for fmt in workers}
    before, wall0 = cpu_seconds(), time.perf_counter()
    workers_before = sum(process_cpu_seconds(p.pid) for p, _ in workers.values())
    load_before = loadavg()
    for r in range(args.rounds):
        for fmt, (_, conn) in (list(workers.items()) if r % 2 == 0 else list(workers.items())[::-1]):
            conn.send("round")
            for key, ms in conn.recv().items():
                times[fmt].setdefault(key, []).append(ms)
    after, wall = cpu_seconds(), time.perf_counter() - wall0
    workers_used = sum(process_cpu_seconds(p.pid) for p, _ in workers.values()) - workers_before
    other = None if before is None else other_cpu_share(before, (after[0], after[1] + workers_used), wall)
    for _, conn in workers.values():
        conn.send("stop")
    rows = {}
    for fmt, per in times.items():
        med = {k: round(statistics.median(v), 2) for k, v in per.items()}
        ratios = {}
        for step in info[fmt]["steps"]:
            t1 = med[f"{step} T1"]
            ratios[step] = {f"T{t}/T1": round(med[f"{step} T{t}"] / t1, 3) for t in QUERY}
        rows[fmt] = {"formats": info[fmt]["formats"], "steps": info[fmt]["steps"], "median_ms": med, "ratios": ratios}
    same = info["blocked"]["tokens"] == info[other_side]["tokens"]
    import torch

    out = {"model": args.model, "quantization": args.quantization, "threads": args.threads,
           "context": 32 if args.tiny else CONTEXT, "rounds": args.rounds, "other_cpu_share": other, "torch": torch.__version__,
           "greedy_identical_across_formats": same, "greedy_tokens": 8 if args.tiny else 64, "results": rows,
           f"blocked_over_{other_side}": {k: round(rows["blocked"]["median_ms"][k] / rows[other_side]["median_ms"][k], 3)
                                          for k in rows["blocked"]["median_ms"]},
           "provenance": provenance("cpu", args.threads, load_before=load_before)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("greedy_identical_across_formats", f"blocked_over_{other_side}",
                                          "other_cpu_share")}, indent=1))
    for fmt, row in rows.items():
        print(fmt, row["ratios"])


if __name__ == "__main__":
    main()
