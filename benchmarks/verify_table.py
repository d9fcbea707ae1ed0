"""A verify step's cost against a one-token step, T(q) / T(1) for q = 1..9 query rows, per
instruction-set path (kernels.use_isa: AVX-512, AVX2 + FMA forced on an AVX-512 machine) and
weight format (float32, bfloat16, int8, int4; float32 activations; int4-super: int4 in the kernel's
super-block layout, quant.INT4_SUPER_BLOCKS), on SmolLM2-135M and on a
randomly initialised model of SmolLM2-1.7B's shape (24 layers, hidden 2048, MLP 8192, 32 heads,
vocabulary 49,152; its speed is that of the real one: same shapes, same kernels). Batch 1, one
prompt's context in the cache (400 tokens by default), the whole model's forward (eager by
default; --aot: the ahead-of-time package, built first and not timed). The paths take turns
within each round (one model in memory at a time); medians over rounds of this thread's CPU
time at 1 thread (time slices other processes take do not count), wall time otherwise.
Writes JSON and a markdown table (issue 36, deliverable 3); --kernels adds where each step's
time goes: every kernel's share per q (torch.profiler, the eager forward).

    taskset -c 1 python benchmarks/verify_table.py --model smollm2,1.7b --isa avx512,avx2 \\
        --format f32,bf16,int8,int4 --out benchmarks/results/verify_table_cpu.json
    python benchmarks/verify_table.py --tiny   # a smoke test: the bundled target, f32 and int4, 2 layers, q 1, 2, 6
    taskset -c 1 python benchmarks/verify_table.py --isa avx512:on,avx512:off --format int8,int4
        # AMX (int8 / int4 from kernels.amx_rows() rows; :every on every call) against the AVX-512 kernels alone
    taskset -c 1 python benchmarks/verify_table.py --model smollm2 --format int4 --rows 1,6 --kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

FORMATS = {"f32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("float32", "int8"),
           "int4": ("float32", "int4"), "int4-super": ("float32", "int4")}  # int4-super: its super-block layout
# SmolLM2-1.7B's config.json (HuggingFaceTB/SmolLM2-1.7B-Instruct), weights random
SHAPE_17B = dict(model_type="llama", vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                 num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32, head_dim=64,
                 rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True)


def load(model: str, fmt: str, layers: int | None):
    """The model prepared for inference in `fmt` (the format prepare picks for its dtype and
    quantization), with its first `layers` decoder layers only where given (a smoke test)."""
    from quickdraft.config import ModelConfig, RopeConfig
    from quickdraft.llm import default_model_dirs
    from quickdraft.model.loader import load_model
    from quickdraft.model.quant import prepare
    from quickdraft.model.sources import resolve_model
    from quickdraft.model.transformer import Transformer

    dtype, quantization = FORMATS[fmt]
    if model in ("smollm2", "bundled"):
        path = resolve_model("smollm2", progress=False) if model == "smollm2" else default_model_dirs()[0]
        net = load_model(path, dtype=dtype, quantization=quantization)
    elif model == "1.7b":
        cfg = ModelConfig(**{**SHAPE_17B, "num_hidden_layers": layers or SHAPE_17B["num_hidden_layers"]},
                          rope=RopeConfig(theta=130000.0))
        torch.manual_seed(0)
        with torch.no_grad():
            net = Transformer(cfg)
            for p in net.parameters():  # (the default init's scale makes no difference to the speed)
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        net = net.to(getattr(torch, dtype)).eval()
    else:
        raise SystemExit(f"unknown model {model!r}: smollm2, 1.7b or bundled")
    if layers is not None:
        net.model.layers = net.model.layers[:layers]
    from quickdraft.model import quant

    with quant.int4_super_blocks(fmt == "int4-super"):
        return prepare(net, quantization)


def measure(args, model: str, fmt: str) -> dict:
    from quickdraft import kernels
    from quickdraft.cache import KVCache

    net = load(model, fmt, args.layers)
    formats = sorted({m.fmt for m in net.modules() if hasattr(m, "fmt")})
    step = net
    if args.aot:
        from quickdraft import aot

        step = aot.load_or_build(net) or net
    rows, context = args.rows, args.context
    cache = KVCache.for_model(net, 1, context + max(rows) + 1)
    ids = torch.randint(0, 1000, (1, context + max(rows)), generator=torch.Generator().manual_seed(0))
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    times: dict[str, dict[int, list[float]]] = {isa: {q: [] for q in rows} for isa in args.isa}
    with torch.inference_mode():
        view = cache.rows(0, 1)
        net(ids[:, :context], torch.arange(context)[None], view, kv_len=context)

        def call(q):  # the q rows after the context (they overwrite the same cache slots each time)
            return step(ids[:, context:context + q], torch.arange(context, context + q)[None], view,
                        kv_len=context + q)

        kernel_ms: dict[str, dict[int, dict[str, list[float]]]] = {isa: {q: {} for q in rows} for isa in args.isa}
        for r in range(args.rounds):
            for isa in (args.isa if r % 2 == 0 else args.isa[::-1]):
                path, _, amx = isa.partition(":")  # (avx512:off, avx512:every: AMX's settings; on by default)
                with kernels.use_isa(path), kernels.use_amx(amx != "off", every_call=amx == "every"):
                    for q in rows:
                        call(q)
                        start = clock()
                        for _ in range(args.calls):
                            call(q)
                        times[isa][q].append((clock() - start) / args.calls * 1e3)
                        if args.kernels:  # (untimed above: the profiler's own cost stays out of T(q))
                            for name, ms in kernel_times(lambda: call(q), args.calls).items():
                                kernel_ms[isa][q].setdefault(name, []).append(ms)
    out = {"formats": formats, "step": type(step).__name__}
    for isa, per in times.items():
        ms = {q: statistics.median(v) for q, v in per.items()}
        out[isa] = {"ms": {str(q): round(v, 3) for q, v in ms.items()},
                    "ratio": {str(q): round(v / ms[rows[0]], 3) for q, v in ms.items()}}
        if args.kernels:
            out[isa]["kernels_ms"] = {str(q): {name: round(statistics.median(v), 3) for name, v in per.items()}
                                      for q, per in kernel_ms[isa].items()}
    return out


def kernel_times(fn, calls: int) -> dict[str, float]:
    """ms per call of each of quickdraft's kernels (torch.profiler's self CPU time of its
    quickdraft:: ops) and of everything else the step ran ("other ops")."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    ours, total = {}, 0.0
    for e in prof.key_averages():
        total += e.self_cpu_time_total
        if e.key.startswith("quickdraft::"):
            ours[e.key.removeprefix("quickdraft::")] = e.self_cpu_time_total / calls / 1e3
    ours["other ops"] = (total / calls / 1e3) - sum(ours.values())
    return ours


def markdown(result: dict, rows: list[int]) -> str:
    from quickdraft.bench.hardware import provenance_line

    a = result["args"]
    lines = [f"# Verify step cost T(q) / T(1), {a['context']}-token context, batch 1, {a['threads']} thread(s), "
             f"{'AOT package' if a['aot'] else 'eager forward'}, {a['clock']} (median of {a['rounds']} rounds)", "",
             provenance_line(result["provenance"]), "",
             "| model | format | path | T(1) ms | " + " | ".join(f"T({q})/T(1)" for q in rows[1:]) + " |",
             "|---|---|---|---|" + "---|" * (len(rows) - 1)]
    for model, per_fmt in result["results"].items():
        for fmt, per in per_fmt.items():
            for isa in a["isa"]:
                r = per[isa]
                lines.append(f"| {model} | {fmt} | {isa} | {r['ms'][str(rows[0])]:.1f} | "
                             + " | ".join(f"{r['ratio'][str(q)]:.2f}" for q in rows[1:]) + " |")
    if a.get("kernels"):
        lines += ["", "Per kernel, ms per step (torch.profiler's self CPU time of quickdraft's ops, median of the "
                  "rounds; \"other ops\": the forward's other ops; the Python between ops counts in T(q) alone), at each q:", "",
                  "| model | format | path | kernel | " + " | ".join(f"q={q}" for q in rows) + " |",
                  "|---|---|---|---|" + "---:|" * len(rows)]
        for model, per_fmt in result["results"].items():
            for fmt, per in per_fmt.items():
                for isa in a["isa"]:
                    k = per[isa]["kernels_ms"]
                    for name in sorted({n for q in rows for n in k[str(q)]}, key=lambda n: (n == "other ops", n)):
                        lines.append(f"| {model} | {fmt} | {isa} | {name} | "
                                     + " | ".join(f"{k[str(q)].get(name, 0.0):.2f}" for q in rows) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from quickdraft import kernels
    from quickdraft.bench.hardware import loadavg, provenance, steady_steps

    steady_steps()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, 1.7b, bundled (the bundled target; comma-separated)")
    p.add_argument("--isa", default=None, help="kernel paths (comma-separated; this CPU must have each; default: "
                   "every vector path it has, e.g. avx512,avx2 on an AVX-512 machine, avx2 on Zen 3), "
                   "each with :on (the default), :every or :off for AMX's setting (int8 / int4 on avx512)")
    p.add_argument("--format", default="f32,bf16,int8,int4", help=f"{', '.join(FORMATS)} (comma-separated)")
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,9", help="query rows per step; the first is the baseline")
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="timed calls per measurement")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (smoke tests)")
    p.add_argument("--aot", action="store_true", help="time the ahead-of-time package (built first, not timed)")
    p.add_argument("--kernels", action="store_true", help="also each kernel's time per step (torch.profiler, eager "
                   "forward: the package's kernels are not ops it sees)")
    p.add_argument("--out", type=Path, default=None, help="JSON out; the markdown table beside it (.md)")
    p.add_argument("--tiny", action="store_true", help="a smoke test: the bundled target, f32 and int4, 2 layers, "
                   "a 32-token context, q 1, 2, 6, 1 round")
    args = p.parse_args()
    if args.tiny:
        args.model, args.format, args.layers, args.context, args.rows = "bundled", "f32,int4", 2, 32, "1,2,6"
        args.rounds, args.calls = 1, 1
    has = [isa for isa in kernels.cpu_isas() if isa != "portable"]
    args.isa = args.isa.split(",") if args.isa else has
    if not args.isa:
        raise SystemExit("quickdraft's kernels have no vector path on this CPU (kernels.cpu_isas())")
    for isa in args.isa:
        if isa.partition(":")[0] not in has:
            raise SystemExit(f"--isa {isa}: this CPU runs {', '.join(has) or 'no vector path'}")
        if isa.partition(":")[2] not in ("", "on", "every", "off"):
            raise SystemExit(f"--isa {isa}: AMX's setting is on, every or off")
    if args.kernels and args.aot:
        raise SystemExit("--kernels times the eager forward's ops: drop --aot")
    args.rows = [int(q) for q in args.rows.split(",")]
    for fmt in args.format.split(","):
        if fmt not in FORMATS:
            raise SystemExit(f"unknown format {fmt!r}: {', '.join(FORMATS)}")
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    results: dict[str, dict] = {}
    for model in args.model.split(","):
        for fmt in args.format.split(","):
            t0 = time.perf_counter()
            results.setdefault(model, {})[fmt] = r = measure(args, model, fmt)
            print(f"{model} {fmt} ({', '.join(r['formats'])}; {time.perf_counter() - t0:.0f} s): "
                  + "; ".join(f"{isa} T(1) {r[isa]['ms'][str(args.rows[0])]:.1f} ms, "
                              + " ".join(f"{q}:{v:.2f}" for q, v in r[isa]["ratio"].items()) for isa in args.isa),
                  flush=True)
    result = {"args": {**vars(args), "out": str(args.out),
                       "clock": "thread CPU time" if args.threads == 1 else "wall time"},
              "results": results, "provenance": provenance("cpu", args.threads, load_before=load_before)}
    table = markdown(result, args.rows)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
