"""Where quickdraft's blocked int8 / int4 kernels stop beating the dense path (issue 19): one
FastLinear of SmolLM2's gate/up (3072x576) and down (576x1536) shapes, its kernel forced
(quant.kernels_only) against its dense path (weights converted to bf16, dense GEMM) at 8-256
rows, best of 7 calls each, ms. Chose quant.BLOCKED_DENSE_ROWS = 64 from it.

    python benchmarks/blocked_vs_dense_rows.py 1 > benchmarks/results/blocked_vs_dense_rows_cpu.txt
"""

from __future__ import annotations

import sys
import time

import torch

from quickdraft.model import quant
from quickdraft.model.quant import FastLinear

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
torch.manual_seed(0)
for (o, i) in [(3072, 576), (576, 1536)]:
    lin = torch.nn.Linear(i, o, bias=False)
    for fmt in ("int8", "int4"):
        f = FastLinear([lin], fmt)
        assert f.blocked
        row = []
        for m in (8, 16, 24, 32, 48, 64, 128, 256):
            x = torch.randn(m, i)
            res = {}
            for mode in ("kernel", "dense"):
                def call():
                    if mode == "kernel":
                        with quant.kernels_only():
                            return f(x)
                    return f(x) if m > 16 else None
                if mode == "dense" and m <= 16:
                    continue
                best = 1e9
                for r in range(7):
                    t = time.perf_counter(); call(); best = min(best, time.perf_counter() - t)
                res[mode] = best * 1e3
            row.append(f"M={m} " + "/".join(f"{v:.2f}" for v in res.values()))
        print((o, i), fmt, "kernel/dense ms:", "  ".join(row), flush=True)
