"""Attention over the KV cache for decode and verify steps on CPU (issue 19): quickdraft's kernel
(kernels.attend) against PyTorch's scaled_dot_product_attention (its CPU flash attention), on the
attention shapes of the bundled target (8 heads, 4 kv heads, D 64, 8 layers) and SmolLM2-135M
(9 heads, 3 kv heads, D 64, 30 layers), float32 cache, causal mask as the engine builds it.

One "call" is a whole step's attention: every layer once, each layer its own cache (so the
keys come from wherever a real step finds them). The two implementations alternate within each
repeat; reported: median over repeats of the per-repeat best-of-N time, the K+V bytes read per
second, and ours / PyTorch per repeat (median, min - max).

    python benchmarks/attention.py --threads 1 2 --out benchmarks/results/attention_cpu.json
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quickdraft import kernels  # noqa: E402
from quickdraft.bench.hardware import cpu_model, cpu_seconds, other_cpu_share, provenance  # noqa: E402

MODELS = {"bundled": (8, 4, 64, 8), "smollm2": (9, 3, 64, 30)}  # heads, kv heads, head dim, layers


def step_time(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--keys", type=int, nargs="+", default=[128, 400, 800])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 9])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", type=Path, help="the JSON file to write (default: print only)")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("quickdraft's kernel library is not available here")
    results, t0, c0 = [], time.perf_counter(), cpu_seconds()
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.models:
            H, Hkv, D, layers = MODELS[name]
            cap = max(args.keys) + max(args.rows) + 1
            g = torch.Generator().manual_seed(0)
            K = [torch.randn(1, Hkv, cap, D, generator=g) for _ in range(layers)]
            V = [torch.randn(1, Hkv, cap, D, generator=g) for _ in range(layers)]
            for L in args.keys:
                for T in args.rows:
                    q = torch.randn(1, T, H, D, generator=g).transpose(1, 2)
                    pos = torch.arange(L - T, L)[None]
                    mask = (torch.arange(L) <= pos[..., None])[:, None]

                    def ours():
                        for i in range(layers):
                            kernels.attend(q, K[i][:, :, :L], V[i][:, :, :L], mask, D ** -0.5)

                    def pytorch():
                        for i in range(layers):
                            F.scaled_dot_product_attention(q, K[i][:, :, :L], V[i][:, :, :L], attn_mask=mask,
                                                           enable_gqa=True)

                    reps = []
                    for r in range(args.repeats):
                        order = [("ours", ours), ("pytorch", pytorch)]
                        if r % 2:
                            order.reverse()
                        reps.append({who: step_time(fn, args.calls) for who, fn in order})
                    kv_bytes = 2 * layers * Hkv * L * D * 4
                    row = {"threads": threads, "model": name, "keys": L, "rows": T, "kv_bytes": kv_bytes}
                    for who in ("ours", "pytorch"):
                        s = statistics.median(x[who] for x in reps)
                        row[f"{who}_us"] = s * 1e6
                        row[f"{who}_gb_s"] = kv_bytes / s / 1e9
                    ratios = [x["ours"] / x["pytorch"] for x in reps]
                    row.update(ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
                    results.append(row)
                    print(f"{threads}t {name:8s} L={L:4d} T={T:2d}: ours {row['ours_us']:8.1f} us "
                          f"({row['ours_gb_s']:5.1f} GB/s)  pytorch {row['pytorch_us']:8.1f} us "
                          f"({row['pytorch_gb_s']:5.1f} GB/s)  ours/pytorch {row['ratio_median']:.2f} "
                          f"({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    wall = time.perf_counter() - t0
    out = {"benchmark": "attention", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "hardware": {"cpu": cpu_model(), "cores": os.cpu_count()},
           "torch": torch.__version__, "repeats": args.repeats, "calls": args.calls,
           "other_cpu_share": other_cpu_share(c0, cpu_seconds(), wall), "results": results,
           "command": "python benchmarks/attention.py " + " ".join(sys.argv[1:]),
           "provenance": provenance("cpu", list(args.threads))}
    print(f"other CPU during the run: {out['other_cpu_share']:.1%}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
