"""Which CPU matmul path streams a model's weights fastest, at decode (1 row) and verify (k+1 rows)?

For every candidate kernel PyTorch offers on CPU (stock, MKL- and oneDNN-packed, int8 and int4
weight-only) this times the linear layers of one decode step of a model (SmolLM2-135M shapes by
default: fused q/k/v, o, fused gate/up, down, x layers, + lm_head), prints GB/s of weights read per
step, ms per step, the cost of M = 4 and 8 rows relative to 1, and the machine's read bandwidth
(`sum` over 1 GiB) so each figure is also a fraction of the roofline.

    python benchmarks/cpu_kernels.py --threads 1 2 --out benchmarks/results/cpu_kernels.json

Medians of --repeats runs, threads pinned with torch.set_num_threads; the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.bench.hardware import loadavg, median_seconds as timed, provenance, provenance_line, read_bandwidth

SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
TINY = [(192, 64), (64, 64), (256, 64), (64, 128)] * 2 + [(384, 64)]  # --tiny: a smoke test's shapes


def model_rooflines(bandwidth: float, smollm2: bool = True) -> dict:
    """Per model and precision: weight bytes one decode step reads (quickdraft's own formats) and
    the least time per token at `bandwidth` bytes/s (SmolLM2's only with `smollm2`: it may download)."""
    from quickdraft.llm import default_model_dirs
    from quickdraft.model.loader import checkpoint_dir, load_model
    from quickdraft.model.quant import bytes_read_per_token, prepare
    from quickdraft.model.sources import resolve_model

    models = {"bundled target": default_model_dirs()[0]}
    try:
        if not smollm2:
            raise RuntimeError("left out (--tiny)")
        models["SmolLM2-135M-Instruct"] = checkpoint_dir(resolve_model("smollm2"))
    except Exception as e:  # offline and not cached
        print(f"smollm2 unavailable: {e}")
    out = {}
    for name, path in models.items():
        for dtype, quant in (("float32", None), ("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4")):
            nbytes = bytes_read_per_token(prepare(load_model(path, dtype=dtype), quant))
            out[f"{name} {quant or dtype}"] = {"bytes_per_token": nbytes, "min_ms_per_token": nbytes / bandwidth * 1e3}
    return out


# Each candidate: name -> (prepare(w_f32[out, in]) -> packed, run(x, packed) -> y, activation dtype,
# bytes per weight element)
def _int8(w):
    s = w.abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s


def _int4(w, group=32):
    from quickdraft.model.formats import int4_pack  # the engine's own packing
    return int4_pack(w, group)


def candidates():
    c = {}
    c["f32 F.linear W[out,in]"] = (lambda w: w, lambda x, w: F.linear(x, w), torch.float32, 4)
    c["f32 x @ W[in,out]"] = (lambda w: w.t().contiguous(), lambda x, w: x @ w, torch.float32, 4)
    c["f32 mkl packed (_mkl_linear)"] = (
        lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w),
        lambda x, p: torch.ops.mkl._mkl_linear(x, p[0], p[1], None, x.shape[0]), torch.float32, 4)
    c["f32 onednn packed (_linear_pointwise)"] = (
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 1),
        lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), torch.float32, 4)
    c["bf16 F.linear W[out,in]"] = (lambda w: w.bfloat16(), lambda x, w: F.linear(x, w), torch.bfloat16, 2)
    c["bf16 onednn packed (_linear_pointwise)"] = (
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1),
        lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), torch.bfloat16, 2)
    c["int8 _weight_int8pack_mm, bf16 x"] = (
        lambda w: (lambda q, s: (q, s.bfloat16()))(*_int8(w)),
        lambda x, p: torch._weight_int8pack_mm(x, p[0], p[1]), torch.bfloat16, 1)
    c["int8 _weight_int8pack_mm, f32 x"] = (
        lambda w: _int8(w), lambda x, p: torch._weight_int8pack_mm(x, p[0], p[1]), torch.float32, 1)

    def onednn_int8(w):
        q, s = _int8(w)
        return torch.ops.onednn.qlinear_prepack(q, None), s.float(), torch.zeros(s.shape, dtype=torch.long)

    def onednn_int8_run(x, p):
        # dynamic per-tensor uint8 activations (what Inductor's x86 int8 lowering feeds oneDNN)
        lo, hi = x.aminmax()
        scale = float((hi - lo).clamp(min=1e-8)) / 255
        zp = int(round(-float(lo) / scale))
        qx = torch.clamp(torch.round(x / scale) + zp, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(qx, scale, zp, p[0], p[1], p[2], None, 1.0, 0,
                                                  torch.float32, "none", [], "")
    c["int8 x uint8 onednn qlinear (dynamic act.)"] = (onednn_int8, onednn_int8_run, torch.float32, 1)
    try:
        _int4(torch.randn(64, 64))
        c["int4 g32 _weight_int4pack_mm_for_cpu, bf16 x"] = (
            lambda w: _int4(w), lambda x, p: torch._weight_int4pack_mm_for_cpu(x, p[0], 32, p[1]),
            torch.bfloat16, 0.5 + 4 / 32)
    except (ImportError, RuntimeError):
        pass
    from quickdraft import kernels  # quickdraft's own small-M kernels (quickdraft/kernels), where they build
    if kernels.available():
        from quickdraft.model.formats import int4_quantize

        def q4(w):
            q, scale, zero = int4_quantize(w)
            return kernels.pack_int4(q, scale, zero - 8 * scale), w.shape[0]
        c["f32 quickdraft blocked_mm"] = (lambda w: (kernels.pack(w.t()), w.shape[0]),
                                          lambda x, p: kernels.blocked_mm(x, p[0], None, p[1]), torch.float32, 4)
        c["int8 quickdraft blocked_mm_int8, f32 x"] = (
            lambda w: (lambda q, s: (kernels.pack_int8(q), s.float(), w.shape[0]))(*_int8(w)),
            lambda x, p: kernels.blocked_mm_int8(x, p[0], p[1], None, p[2]), torch.float32, 1)
        c["int4 g32 quickdraft blocked_mm_int4, f32 x"] = (
            q4, lambda x, p: kernels.blocked_mm_int4(x, p[0], None, p[1]), torch.float32, 0.5 + 4 / 32)
    return c


def markdown(results: dict) -> str:
    """The JSON results as tables: rooflines per model and precision, then kernels per thread count."""
    lines = [f"# CPU matmul paths and the memory roofline ({results['shapes']})", "",
             provenance_line(results["provenance"]), "",
             f"torch {results['torch']}; load average before {results['load_before'][0]:.2f}, "
             f"after {results['load_after'][0]:.2f}. Medians of repeats; one decode step's linear layers.", ""]
    for threads, r in results["threads"].items():
        lines += [f"## {threads} thread(s): read bandwidth {r['read_bandwidth_GBps']:.1f} GB/s "
                  f"(best of {', '.join(f'{k} {v:.1f}' for k, v in r['probes_GBps'].items())})", "",
                  "| model, precision | MB read per token | roofline ms/token |", "|---|---:|---:|"]
        lines += [f"| {name} | {x['bytes_per_token'] / 1e6:.1f} | {x['min_ms_per_token']:.2f} |"
                  for name, x in r["rooflines"].items()]
        lines += ["", "| kernel | GB/s at 1 row | roofline fraction | ms per step | 4 rows / 1 | 8 rows / 1 |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, k in r["kernels"].items():
            if "error" in k:
                lines.append(f"| {name} | unavailable: {k['error'][:60]} | | | | |")
                continue
            lines.append(f"| {name} | {k['GBps_M1']:.1f} | {k['roofline_fraction_M1']:.0%} | {k['M=1_ms']:.1f} | "
                         f"{k.get('M=4_vs_M=1', float('nan')):.2f}x | {k.get('M=8_vs_M=1', float('nan')):.2f}x |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--only", nargs="*", default=None, help="substrings of candidate names")
    ap.add_argument("--out", type=Path, default=None, help="the JSON file to write, and its .md beside it")
    ap.add_argument("--tiny", action="store_true", help="small shapes, a 16 MiB bandwidth probe, no SmolLM2 "
                    "roofline (a smoke test)")
    args = ap.parse_args()
    shapes = TINY if args.tiny else SMOLLM2
    results = {"shapes": "tiny (--tiny)" if args.tiny else "SmolLM2-135M (fused qkv, gate/up) x30 + lm_head",
               "load_before": loadavg(),
               "torch": torch.__version__, "threads": {}}
    base = [torch.randn(o, i) / i ** 0.5 for o, i in shapes]
    for threads in args.threads:
        torch.set_num_threads(threads)
        probes = read_bandwidth(args.repeats, 1 << 24 if args.tiny else 1 << 30)
        bw = max(probes.values())
        print(f"threads={threads}: read bandwidth {bw / 1e9:.1f} GB/s "
              f"({', '.join(f'{k} {v / 1e9:.1f}' for k, v in probes.items())})")
        rows = {"read_bandwidth_GBps": bw / 1e9, "probes_GBps": {k: v / 1e9 for k, v in probes.items()},
                "rooflines": model_rooflines(bw, smollm2=not args.tiny), "kernels": {}}
        for name, r in rows["rooflines"].items():
            print(f"  roofline {name:36s} {r['bytes_per_token'] / 1e6:7.1f} MB/token  {r['min_ms_per_token']:6.2f} ms/token")
        for name, (prep, run, dt, bpe) in candidates().items():
            if args.only and not any(s in name for s in args.only):
                continue
            try:
                packed = [prep(w) for w in base]
                nbytes = sum(o * i for o, i in shapes) * bpe
                entry = {}
                for m in args.rows:
                    xs = {i: torch.randn(m, i).to(dt) for i in {i for _, i in shapes}}
                    t = timed(lambda: [run(xs[i], p) for (o, i), p in zip(shapes, packed)], args.repeats)
                    entry[f"M={m}_ms"] = t * 1e3
                t1 = entry["M=1_ms"] / 1e3
                entry["GBps_M1"] = nbytes / t1 / 1e9
                entry["roofline_fraction_M1"] = nbytes / t1 / bw
                for m in args.rows[1:]:
                    entry[f"M={m}_vs_M=1"] = entry[f"M={m}_ms"] / entry["M=1_ms"]
                rows["kernels"][name] = entry
                extra = "  ".join(f"M={m} {entry[f'M={m}_vs_M=1']:.2f}x" for m in args.rows[1:])
                print(f"  {name:48s} {entry['GBps_M1']:5.1f} GB/s ({entry['roofline_fraction_M1']:.0%}) "
                      f"{entry['M=1_ms']:6.1f} ms  {extra}", flush=True)
            except Exception as e:  # a path missing on this CPU / torch build is a result too
                rows["kernels"][name] = {"error": f"{type(e).__name__}: {e}"[:200]}
                print(f"  {name:48s} unavailable: {str(e)[:100]}")
        results["threads"][str(threads)] = rows
    results["load_after"] = loadavg()
    results["provenance"] = provenance("cpu", list(args.threads), load_before=results["load_before"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        args.out.with_suffix(".md").write_text(markdown(results))


if __name__ == "__main__":
    main()
