"""The blocked kernels' time per call by row count, per instruction-set path and weight format:
whether k + 1 rows cost about one row (a verify step about a decode step), and what each path
(AVX-512, AVX2 + FMA, portable C++; kernels.use_isa) costs on the same machine. One thread by
default (--threads), median of rounds, us per call; SmolLM2-135M's shapes by default (fused qkv, o, fused gate/up,
down, lm_head).

    taskset -c 1 python benchmarks/blocked_rows.py --isa avx512,avx2,portable --format f32,bf16,int8,int4 \
        --out benchmarks/results/blocked_rows_cpu.txt
    python benchmarks/blocked_rows.py --shapes bundled   # the bundled target's and SmolLM2's (K, N) of before
    python benchmarks/blocked_rows.py --shapes 1.7b --rows 1,2,3,4,5,6,7,8,9 --clock thread   # SmolLM2-1.7B's
    python benchmarks/blocked_rows.py --shapes 1.7b --format int4 --dram 1000 --clock thread   # weights from DRAM
        # (with --dram also each call's GB/s, and what plain reads stream: quickdraft.bench.hardware)
    python benchmarks/blocked_rows.py --tiny             # a smoke test: one small shape, few calls
    python benchmarks/blocked_rows.py --format int8,int4 --rows 1,6,64,338 --threads 2   # prefill-sized calls too
    python benchmarks/blocked_rows.py --isa avx512 --format int8,int4 --amx every,off --clock thread
        # int8 / int4 on AMX tiles at every row count against the AVX-512 kernels, side by side
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from pathlib import Path

import torch

from quickdraft import kernels
from quickdraft.bench.hardware import cpu_model, loadavg, provenance, provenance_line, read_bandwidth

SHAPES = {  # (K in, N out)
    "smollm2": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
                ("lm_head", 576, 49152)],
    "bundled": [("up", 576, 1536), ("down", 1536, 576), ("mlp", 512, 1408), ("lm_head", 576, 49152)],
    "1.7b": [("qkv", 2048, 6144), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048),
             ("lm_head", 2048, 49152)],  # SmolLM2-1.7B's (weights from DRAM)
    "tiny": [("tiny", 64, 128)],
    # one output width, inputs from 2,048 to 12,288 (an 8B model's down projection is 14,336): where a
    # call's activations outgrow L1 (the AVX-512 int8 kernel's chunks of the inputs, QUICKDRAFT_KSPLIT)
    "ksweep": [(f"k{k}", k, 4096) for k in (2048, 4096, 6144, 8192, 12288)],
}


def _operands(fmt: str, K: int, N: int, dram_bytes: int = 0):
    """A callable x -> the kernel's product with a (K, N) weight of format `fmt`; with dram_bytes, as
    many copies of the weight as exceed that many bytes, one call after another reading the next
    (weights from DRAM, as a model's layers stream every step, rather than from the caches)."""
    f, nbytes = _operand(fmt, K, N)
    if not dram_bytes:
        f.copies, f.nbytes = 1, nbytes
        return f
    n = -(-dram_bytes // nbytes)
    copies = itertools.cycle([f] + [_operand(fmt, K, N)[0] for _ in range(n - 1)])
    g = lambda x: next(copies)(x)  # noqa: E731
    g.copies, g.nbytes = n, nbytes
    return g


def _operand(fmt: str, K: int, N: int):
    """(the callable, its packed weight's bytes)"""
    g = torch.Generator().manual_seed(0)
    if fmt == "f32":
        packed = kernels.pack(torch.randn(K, N, generator=g))
        return lambda x: kernels.blocked_mm(x, packed, None, N), packed.nbytes
    if fmt == "bf16":  # half float32's bytes, widened in registers (the float32 kernel's bits)
        packed = kernels.pack_bf16(torch.randn(K, N, generator=g))
        return lambda x: kernels.blocked_mm_bf16(x, packed, None, N), packed.nbytes
    if fmt == "int8":
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        packed = kernels.pack_int8(q) if hasattr(kernels, "pack_int8") else kernels.pack(q.t())  # (before its layout: A/B runs)
        scale = torch.rand(N, generator=g)
        return lambda x: kernels.blocked_mm_int8(x, packed, scale, None, N), packed.nbytes
    if fmt == "int4":
        scale = torch.rand(N, K // 32, generator=g) / 50
        packed = kernels.pack_int4(torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g), scale, -8 * scale)
        return lambda x: kernels.blocked_mm_int4(x, packed, None, N), packed.nbytes
    if fmt == "int4s":  # int4's super-block layout (4.625 bits a weight against 5): what quantization="int4" packs
        codes = torch.randint(0, 256, (N, K // 32), generator=g), torch.randint(-128, 128, (N, K // 32), generator=g)
        factors = [(torch.rand(N, K // 256, generator=g) / 2000 + 1e-6).half().float() for _ in range(2)]
        packed = kernels.pack_int4_super(torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g), *codes, *factors)
        return lambda x: kernels.blocked_mm_int4(x, packed, None, N), packed.nbytes
    raise SystemExit(f"unknown format {fmt!r}: f32, bf16, int8, int4 or int4s")


def _time(f, x, budget_s: float, rounds: int, clock) -> float:
    """Median us per call over `rounds` rounds of as many calls as fill budget_s / rounds, after a
    warm-up of every copy of the weight (f.copies) and at least a round's time: without it the first
    row count measured read 5-40% slower than the same calls later in the run (1.7B shape, --dram
    1500, an Intel Xeon: `--rows 1,2` put one row at 1.06-1.75x two rows' time, `--rows 2,1` at
    0.58-1.02x), which skewed T(q)/T(1)."""
    t0 = time.perf_counter()
    done = 0
    while done < getattr(f, "copies", 1) or time.perf_counter() - t0 < budget_s / rounds:
        f(x)
        done += 1
    t = clock()
    f(x)
    once = clock() - t
    calls = max(1, int(budget_s / rounds / max(once, 1e-6)))
    times = []
    for _ in range(rounds):
        t = clock()
        for _ in range(calls):
            f(x)
        times.append((clock() - t) / calls * 1e6)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--isa", default=None, help="paths, comma-separated (default: every one this CPU has)")
    p.add_argument("--format", default="f32,int8,int4", help="f32, bf16, int8, int4, int4s (int4's super-block "
                   "layout, where K is a multiple of 256) (comma-separated)")
    p.add_argument("--rows", default="1,2,4,6,9")
    p.add_argument("--shapes", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--only", default=None, help="these shapes of --shapes alone, by name (e.g. gate_up,lm_head)")
    p.add_argument("--budget", type=float, default=0.25, help="seconds per measurement (vector paths)")
    p.add_argument("--dram", type=float, default=0, help="MiB: each shape's weight copied until the copies pass "
                   "this size, the calls taking them in turn, so the weights stream from DRAM (e.g. 96 on a 32 MiB "
                   "L3) rather than stay in the caches")
    p.add_argument("--clock", default="wall", choices=["wall", "thread"],
                   help="wall: perf_counter; thread: this thread's CPU time (time slices other processes take on a "
                        "shared machine do not count; their cache traffic still does)")
    p.add_argument("--amx", default="on", help="AMX settings to compare, comma-separated: on (the default: from "
                   "kernels.amx_rows() rows), every (every row count), off; int8 / int4 on the avx512 path only")
    p.add_argument("--threads", type=int, default=1, help="PyTorch's threads for the kernels (wall clock past 1)")
    p.add_argument("--out", type=Path, default=None, help="also write the table to this text file")
    p.add_argument("--tiny", action="store_true", help="a smoke test: one (64, 128) shape, 1-2 rows, f32 only")
    args = p.parse_args()
    if args.tiny:
        args.shapes, args.rows, args.format, args.budget = "tiny", "1,2", "f32", 0.01
    if args.threads < 1:
        raise SystemExit(f"--threads must be at least 1, got {args.threads}")
    if args.threads > 1 and args.clock == "thread":
        raise SystemExit("--clock thread times one thread: with --threads > 1 use the wall clock")
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    if not kernels.available():
        raise SystemExit("quickdraft's kernels are not available here")
    isas = args.isa.split(",") if args.isa else list(kernels.cpu_isas())
    rows = [int(r) for r in args.rows.split(",")]
    amx_settings = args.amx.split(",")
    if not set(amx_settings) <= {"on", "every", "off"}:
        raise SystemExit(f"--amx takes on, every and off, got {args.amx!r}")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    say(f"# {cpu_model()}, paths {', '.join(kernels.cpu_isas())}; torch {torch.__version__}, {args.threads} thread(s); "
          f"load average {os.getloadavg()[0]:.2f} before; us per call ({args.clock} clock, median), "
          "T(q)/T(1) in brackets")
    for fmt in args.format.split(","):
        for name, K, N in SHAPES[args.shapes]:
            if args.only and name not in args.only.split(","):
                continue
            f = _operands(fmt, K, N, int(args.dram * 2 ** 20))
            for isa in isas:
                amx = amx_settings if fmt in ("int8", "int4", "int4s") and isa == "avx512" else ["on"]
                portable = isa == "portable"  # (scalar: seconds per call on lm_head; fewer rounds)
                t: dict[str, dict[int, float]] = {a: {} for a in amx}
                with kernels.use_isa(isa):
                    for m in rows:  # (the AMX settings side by side at each row count)
                        x = torch.randn(m, K)
                        for a in amx:
                            with kernels.use_amx(a != "off", every_call=a == "every"):
                                t[a][m] = _time(f, x, 3 * args.budget if portable else args.budget,
                                                3 if portable else 7, clock)
                for a in amx:
                    one = t[a][rows[0]]
                    cells = "  ".join(f"{m}: {v:8.0f} ({v / one:.2f})" for m, v in t[a].items())
                    label = isa if len(amx) == 1 else f"{isa}/amx={a}"
                    say(f"{fmt:4s} {name:8s} {K:5d}x{N:<6d} {label:8s} {cells}")
                    if args.dram:  # the weight's bytes over each call's time: the kernel's DRAM stream
                        rates = "  ".join(f"{m}: {f.nbytes / v / 1e3:8.1f}       " for m, v in t[a].items())
                        say(f"{fmt:4s} {name:8s} {K:5d}x{N:<6d} {'GB/s':8s} {rates}")
                if len(amx) > 1:
                    base = amx[-1]
                    for a in amx[:-1]:
                        cells = "  ".join(f"{m}: {t[a][m] / t[base][m]:.2f}" for m in rows)
                        say(f"{fmt:4s} {name:8s} {K:5d}x{N:<6d} amx={a} / amx={base}: {cells}")
    if args.dram:  # what plain reads of 1 GiB stream at this thread count (quickdraft.bench.hardware)
        probes = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in read_bandwidth(5).items())
        say(f"# read bandwidth probes (GB/s, 1 GiB float32, {args.threads} thread(s)): {probes}")
    say(f"# load average {os.getloadavg()[0]:.2f} after")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        header = f"# {provenance_line(provenance('cpu', args.threads, load_before=load_before))}"
        args.out.write_text("\n".join([header] + lines) + "\n")


if __name__ == "__main__":
    main()
