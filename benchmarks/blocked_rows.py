"""The blocked float32 kernel's time per call by row count, on SmolLM2's and the bundled target's
shapes: whether one row costs more than two (it did on an AMD EPYC with four read streams per
row, see kernels/blocked_mm.cpp `four_streams`). One thread, median of 7 rounds of 30 calls, us.

    python benchmarks/blocked_rows.py > benchmarks/results/blocked_rows_cpu.txt
"""

from __future__ import annotations

import os
import time

import torch

from quickdraft import kernels
from quickdraft.bench.hardware import cpu_model


def main() -> None:
    torch.set_num_threads(1)
    if not kernels.available():
        raise SystemExit("quickdraft's kernels are not available here")
    print(f"# {cpu_model()}, torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.2f} before; "
          "us per call (median of 7 x 30)")
    for K, N in [(576, 1536), (1536, 576), (512, 1408), (576, 49152)]:
        packed = kernels.pack(torch.randn(N, K).t().contiguous())
        row = {}
        for M in (1, 2, 3, 4, 6):
            x = torch.randn(M, K)
            kernels.blocked_mm(x, packed, None, N)
            rounds = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(30):
                    kernels.blocked_mm(x, packed, None, N)
                rounds.append((time.perf_counter() - t) / 30 * 1e6)
            row[M] = sorted(rounds)[3]
        cells = "  ".join(f"M={m} {v:.0f}" for m, v in row.items())
        print(f"({K}, {N})  {cells}  one row: {K * N * 4 / row[1] / 1e3:.1f} GB/s")


if __name__ == "__main__":
    main()
