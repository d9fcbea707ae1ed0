"""Small-M float32 matmuls on this CPU (issue 19: verify steps of k + 1 rows): SmolLM2's
shapes, MKL through `x @ W^T` (the `transposed` format) against oneDNN's packed float32 linear
(`mkldnn._reorder_linear_weight` with a batch hint of 4), one thread, median ms of 20 calls.

    python benchmarks/small_m_gemm.py --out benchmarks/results/small_m_gemm_cpu.json
    python benchmarks/small_m_gemm.py --tiny --out /tmp/x.json   # a smoke test
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from quickdraft.bench.hardware import loadavg, median_seconds as timed, provenance

SHAPES = {"lm_head": (576, 49152), "gate_up": (576, 3072), "down": (1536, 576), "qkv": (576, 960)}
TINY = {"small": (64, 128)}  # --tiny: a smoke test


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="one small shape, medians of 3 calls (a smoke test)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before, calls = loadavg(), 3 if args.tiny else 20
    out = {"threads": args.threads, "calls": calls, "torch": torch.__version__, "shapes": {}}
    for name, (k, n) in (TINY if args.tiny else SHAPES).items():
        w = torch.randn(n, k)
        wt = w.t().contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
        rows = {}
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k)
            rows[m] = {"mkl_ms": round(timed(lambda: x @ wt, calls) * 1e3, 3),
                       "onednn_packed_ms": round(timed(lambda: torch.ops.mkldnn._linear_pointwise(
                           x, packed, None, "none", [], ""), calls) * 1e3, 3)}
        out["shapes"][name] = {"in": k, "out": n, "rows": rows}
        print(name, rows, flush=True)
    out["provenance"] = provenance("cpu", args.threads, load_before=load_before)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
