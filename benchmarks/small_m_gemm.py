"""Small-M float32 matmuls on this CPU (issue 19: verify steps of k + 1 rows): SmolLM2's
shapes, MKL through `x @ W^T` (the `transposed` format) against oneDNN's packed float32 linear
(`mkldnn._reorder_linear_weight` with a batch hint of 4), one thread, median ms of 20 calls.

    python benchmarks/small_m_gemm.py --out benchmarks/results/small_m_gemm_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from cpu_kernels import timed  # benchmarks/cpu_kernels.py: median seconds of repeated calls

SHAPES = {"lm_head": (576, 49152), "gate_up": (576, 3072), "down": (1536, 576), "qkv": (576, 960)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"threads": args.threads, "loadavg_1m_before": os.getloadavg()[0], "torch": torch.__version__, "shapes": {}}
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k)
        wt = w.t().contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
        rows = {}
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k)
            rows[m] = {"mkl_ms": round(timed(lambda: x @ wt, 20) * 1e3, 3),
                       "onednn_packed_ms": round(timed(lambda: torch.ops.mkldnn._linear_pointwise(
                           x, packed, None, "none", [], ""), 20) * 1e3, 3)}
        out["shapes"][name] = {"in": k, "out": n, "rows": rows}
        print(name, rows, flush=True)
    out["loadavg_1m_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
