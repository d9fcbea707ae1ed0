"""Attention's cost per (query row x key) as the rows per kv head grow (issue 31: a prefill chunk
deep in a long prompt): quickdraft's `kernels.attend` on each of its vector paths against PyTorch's
scaled_dot_product_attention on the same inputs, one layer of SmolLM2's shape (3 kv heads, D 64).

Rows per kv head R = T * G: R = 1 is one query head per kv head (G 1, T 1); otherwise G = 3 (SmolLM2)
and T = R / 3 query positions, the last T positions of L keys under the causal mask the engine
builds. Timing: this thread's CPU clock (`time.thread_time_ns`) over `--calls` calls, one thread;
per repeat the implementations alternate; reported: median over repeats of ns per (row x key)
(the whole call over 3 * R * L), and ours / PyTorch per repeat (median).

With `--before DIR` (another checkout, e.g. `git worktree add /tmp/before main`) each repeat also
runs the same table with DIR's quickdraft (its own kernel library) in a child process, in
alternating order, and reports after / before per repeat (median): a paired A/B of a kernel change.

    python benchmarks/attention_rows.py --isas avx512 avx2 --before /tmp/before --out benchmarks/results/attention_rows_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HKV, G, D = 3, 3, 64  # SmolLM2-135M: 9 query heads over 3 kv heads, head size 64


def shape(rows: int) -> tuple[int, int]:
    """(query heads per kv head, query positions) for `rows` rows per kv head."""
    if rows == 1:
        return 1, 1
    if rows % G:
        raise SystemExit(f"--rows: {rows} is not 1 or a multiple of {G} (G = {G} query heads per kv head)")
    return G, rows // G


def measure(isas: list[str], keys: list[int], rows: list[int], calls: int, sdpa: bool) -> dict:
    """One repeat of the table in this process: {"isa/L/R": {"ours": ns, "sdpa": ns}} per (row x key)."""
    import torch
    import torch.nn.functional as F

    from quickdraft import kernels

    torch.set_num_threads(1)
    if not kernels.available():
        raise SystemExit("quickdraft's kernel library is not available here")
    g = torch.Generator().manual_seed(0)
    out = {}
    for L in keys:
        k = torch.randn(1, HKV, L, D, generator=g)
        v = torch.randn(1, HKV, L, D, generator=g)
        for R in rows:
            gq, T = shape(R)
            q = torch.randn(1, HKV * gq, T, D, generator=g)
            mask = (torch.arange(L) <= torch.arange(L - T, L)[:, None])[None, None]
            work = HKV * R * L

            def clock(fn):
                fn()  # warm: caches, the scores buffer
                t = time.thread_time_ns()
                for _ in range(calls):
                    fn()
                return (time.thread_time_ns() - t) / calls / work

            for isa in isas:
                with kernels.use_isa(isa):
                    row = {"ours": clock(lambda: kernels.attend(q, k, v, mask, D ** -0.5))}
                if sdpa:
                    row["sdpa"] = clock(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                enable_gqa=gq > 1))
                out[f"{isa}/{L}/{R}"] = row
    return out


def child(tree: Path, args: argparse.Namespace) -> dict:
    """One repeat measured by `tree`'s quickdraft (this script, that package, that kernel library)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", "--calls", str(args.calls), "--isas", *args.isas,
           "--keys", *map(str, args.keys), "--rows", *map(str, args.rows)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: the measurement failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isas", nargs="+", default=None,
                    help="the kernels' paths to measure (default: every vector path this CPU has)")
    ap.add_argument("--keys", type=int, nargs="+", default=[512, 2000, 4000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 12, 60], help="query rows per kv head (T * G)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--before", type=Path, help="another checkout to pair against (its kernels, child processes)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="the JSON file to write (default: print only)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.isas, args.keys, args.rows, args.calls, sdpa=False)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from quickdraft import kernels
    from quickdraft.bench.hardware import provenance

    if args.isas is None:
        args.isas = [isa for isa in kernels.cpu_isas() if isa != "portable"] or ["portable"]

    here = Path(__file__).resolve().parents[1]
    load_before = list(os.getloadavg())
    reps = []
    for r in range(args.repeats):
        rep = {"after": measure(args.isas, args.keys, args.rows, args.calls, sdpa=True)}
        if args.before:  # alternate which tree runs first
            pair = [("before", args.before), ("after_child", here)]
            for name, tree in (pair if r % 2 else pair[::-1]):
                rep[name] = child(tree, args)
        reps.append(rep)
    table = []
    for key in reps[0]["after"]:
        isa, L, R = key.split("/")
        row = {"isa": isa, "keys": int(L), "rows": int(R),
               "ours_ns": statistics.median(x["after"][key]["ours"] for x in reps),
               "sdpa_ns": statistics.median(x["after"][key]["sdpa"] for x in reps),
               "ours_over_sdpa": statistics.median(x["after"][key]["ours"] / x["after"][key]["sdpa"] for x in reps)}
        line = (f"{isa:7s} L={L:>5s} R={R:>3s}: ours {row['ours_ns']:6.3f} ns/(row*key)  sdpa {row['sdpa_ns']:6.3f}"
                f"  ours/sdpa {row['ours_over_sdpa']:.2f}")
        if args.before:  # the paired A/B: both trees in child processes, same conditions
            row["before_ns"] = statistics.median(x["before"][key]["ours"] for x in reps)
            row["after_child_ns"] = statistics.median(x["after_child"][key]["ours"] for x in reps)
            row["after_over_before"] = statistics.median(x["after_child"][key]["ours"] / x["before"][key]["ours"]
                                                         for x in reps)
            line += (f"  before {row['before_ns']:6.3f} after {row['after_child_ns']:6.3f}"
                     f"  after/before {row['after_over_before']:.2f}")
        table.append(row)
        print(line, flush=True)
    out = {"benchmark": "attention_rows", "unit": "ns per (query row x key), thread CPU clock, 1 thread",
           "kv_heads": HKV, "head_dim": D, "repeats": args.repeats, "calls": args.calls,
           "before": str(args.before) if args.before else None, "loadavg_before": load_before,
           "loadavg_after": list(os.getloadavg()), "table": table,
           "command": "python benchmarks/attention_rows.py " + " ".join(sys.argv[1:]),
           "provenance": provenance("cpu", 1)}
    print(f"load: {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
