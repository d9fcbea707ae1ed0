"""What running quickdraft's blocked int8 / int4 kernels at every row count costs a prefill
(issue 19, issue 36): one linear of SmolLM2's gate/up (3072x576) and down (576x1536) shapes on
its kernel (what runs at every row count: a row's bits are its own) against a dense path
(weights dequantised to bf16 per call, dense GEMM; what ran past 64 rows before) at 8-256 rows,
best of 7 calls each, ms.

    python benchmarks/blocked_vs_dense_rows.py 1 --out benchmarks/results/blocked_vs_dense_rows_cpu.txt
    python benchmarks/blocked_vs_dense_rows.py --tiny   # a smoke test: one small shape, two row counts
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.bench.hardware import loadavg, provenance, provenance_line
from quickdraft.model.quant import make_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("threads", type=int, nargs="?", default=1, help="torch threads (default 1)")
    ap.add_argument("--out", type=Path, default=None, help="the text file to write (default: stdout)")
    ap.add_argument("--tiny", action="store_true", help="one (256, 128) shape, 8 and 32 rows, best of 2 (tests)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes, rows, tries = ([(256, 128)], (8, 32), 2) if args.tiny else \
        ([(3072, 576), (576, 1536)], (8, 16, 24, 32, 48, 64, 128, 256), 7)
    load_before = loadavg()
    lines = []
    for (o, i) in shapes:
        lin = torch.nn.Linear(i, o, bias=False)
        for fmt in ("int8", "int4"):
            f = make_linear([lin], fmt)
            assert f.calls_kernels
            row = []
            for m in rows:
                x = torch.randn(m, i)
                res = {}
                for mode in ("kernel", "dense"):
                    if mode == "dense" and m <= 16:
                        continue

                    def call():
                        if mode == "kernel":
                            return f(x)
                        return F.linear(x.bfloat16(), f.dequantized(torch.bfloat16)).float()

                    best = 1e9
                    for _ in range(tries):
                        t = time.perf_counter()
                        call()
                        best = min(best, time.perf_counter() - t)
                    res[mode] = best * 1e3
                row.append(f"M={m} " + "/".join(f"{v:.2f}" for v in res.values()))
            lines.append(f"{(o, i)} {fmt} kernel/dense ms: " + "  ".join(row))
            print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join([f"# {provenance_line(provenance('cpu', args.threads, load_before=load_before))}"] + lines) + "\n"
    if args.out is None:
        print(text, end="")
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
