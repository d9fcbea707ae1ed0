"""The blocked float32 kernel's time per call by row count, on SmolLM2's and the bundled target's
shapes: whether one row costs more than two (it did on an AMD EPYC with four read streams per
row, see kernels/blocked_mm.cpp `four_streams`). One thread, median of 7 rounds of 30 calls, us.

    python benchmarks/blocked_rows.py --out benchmarks/results/blocked_rows_cpu.txt
    python benchmarks/blocked_rows.py --tiny          # a smoke test: one small shape, few calls
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from quickdraft import kernels
from quickdraft.bench.hardware import cpu_model, loadavg, provenance, provenance_line

SHAPES = [(576, 1536), (1536, 576), (512, 1408), (576, 49152)]  # (K, N): SmolLM2's and the bundled target's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="the text file to write (default: stdout)")
    ap.add_argument("--tiny", action="store_true", help="one (64, 128) shape, 3 rounds of 2 calls (tests)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not kernels.available():
        raise SystemExit("quickdraft's kernels are not available here")
    shapes, rounds_n, calls = ([(64, 128)], 3, 2) if args.tiny else (SHAPES, 7, 30)
    load_before = loadavg()
    lines = []
    for K, N in shapes:
        packed = kernels.pack(torch.randn(N, K).t().contiguous())
        row = {}
        for M in (1, 2, 3, 4, 6):
            x = torch.randn(M, K)
            kernels.blocked_mm(x, packed, None, N)
            rounds = []
            for _ in range(rounds_n):
                t = time.perf_counter()
                for _ in range(calls):
                    kernels.blocked_mm(x, packed, None, N)
                rounds.append((time.perf_counter() - t) / calls * 1e6)
            row[M] = sorted(rounds)[rounds_n // 2]
        cells = "  ".join(f"M={m} {v:.0f}" for m, v in row.items())
        lines.append(f"({K}, {N})  {cells}  one row: {K * N * 4 / row[1] / 1e3:.1f} GB/s")
        print(lines[-1], file=sys.stderr, flush=True)
    header = [f"# {provenance_line(provenance('cpu', 1, load_before=load_before))}",
              f"# {cpu_model()}, torch {torch.__version__}, 1 thread; us per call (median of {rounds_n} x {calls})"]
    text = "\n".join(header + lines) + "\n"
    if args.out is None:
        print(text, end="")
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
