"""Self-speculation (`draft="self"`: the target's own weights in int4, or int8, drafting for it)
against plain decoding of the same target, and what it costs per step.

Two parts:

- `--model bundled`: the bundled 28M code target loaded as float32, greedy, on held-out code
  openings (quickdraft.bench.workloads.code_completion). For each draft format and k: the
  speedup over plain decoding end to end (quickdraft.bench.compare.run_bench: every prompt at
  batch 1, plain decoding in the same repeat, the order rotated per repeat, medians over
  repeats; policy "fixed": k every step, or `--policy auto`, the default policy, which may
  speculate less where a step's measured costs say it pays less; the AOT compiled steps the
  engine uses by default, built before timing), acceptance, tokens per step, and the measured
  costs c = T_propose(k) / (k T(1)) (the self-draft's drafting per token over a plain target
  step) and T(k+1) / T(1).
  Every configuration's greedy output is checked token for token against plain decoding.
- `--model big`: SmolLM2-1.7B's shape with random weights (benchmarks/llamacpp.py's, seeded),
  loaded as float32, for COST only (acceptance on random weights says nothing): the target's
  step T(1), T(k+1), the self-draft's propose time for k tokens, c and T(k+1)/T(1), and the
  acceptance rate a self-draft would need for 1x and 1.6x at those costs (i.i.d. acceptance:
  E = (1 - a^(k+1)) / (1 - a) tokens per step over (k c + T(k+1)/T(1)) plain steps). With
  `--layers`, copies with fewer decoder layers (every other dimension SmolLM2-1.7B's) are
  measured, where memory does not hold the full float32 model (6.8 GB) next to other work; two
  or more layer counts give a straight-line fit to 24 layers (the per-layer cost and the fixed
  part: embeddings, lm_head, the step's overhead), labelled as extrapolated. Eager steps (no AOT
  build of a 1.7B shape), target and draft alike.

torch uses --threads threads, the process pinned to as many cores (--cores).

    python benchmarks/self_draft.py --model bundled --formats int4 int8 --ks 2 3 4 5 --prompts 6 --repeats 3
    python benchmarks/self_draft.py --model bundled --formats int4 --ks 5 8 --policy auto
    python benchmarks/self_draft.py --model big --layers 4 8 --formats int4 int8 --ks 3 5 --iters 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.bench.hardware import loadavg, provenance, provenance_line
from quickdraft.policy.costs import expected_tokens

FULL_LAYERS = 24  # SmolLM2-1.7B


def required_alpha(k: int, cost_steps: float) -> float:
    """The i.i.d. acceptance rate at which k drafts emit `cost_steps` tokens per step (bisection)."""
    lo, hi = 0.0, 1.0
    if expected_tokens(1.0 - 1e-9, k) < cost_steps:
        return float("nan")  # even full acceptance cannot pay
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost_steps else (lo, mid)
    return (lo + hi) / 2


# ---- the bundled target: end to end ------------------------------------------------------------

def bundled(args) -> dict:
    from quickdraft.bench.compare import run_bench
    from quickdraft.bench.workloads import code_completion
    from quickdraft.train.corpus import load_corpus

    prompts = code_completion(load_corpus(None).heldout, args.prompts)
    out = {"prompts": len(prompts), "new_tokens": args.new_tokens, "policy": args.policy, "formats": {}}
    for fmt in args.formats:
        print(f"[self_draft] bundled, self-draft {fmt}: ks {args.ks}", file=sys.stderr, flush=True)
        res = run_bench(None, "self", ["draft"], {}, [1], args.ks, [0.0], prompts, args.new_tokens, args.repeats,
                        args.iters, dtype="float32", llm_options={"draft_quantization": fmt, "policy": args.policy})
        rows = []
        for r in res["runs"]:
            rows.append({key: r[key] for key in ("k", "speedup", "tokens_per_s", "plain_tokens_per_s",
                                                 "acceptance_rate", "tokens_per_step", "c", "verify_ratio",
                                                 "predicted_speedup")})
            rows[-1]["identical"] = identical(fmt, r["k"], prompts, args.new_tokens, args.policy)
        out["formats"][fmt] = {"rows": rows, "target_step_s": res["target_step_s"][0][0], "load_after": loadavg()}
    return out


def identical(fmt: str, k: int, prompts: list[str], new_tokens: int, policy: str) -> bool:
    """Greedy output of the self-draft at k equals plain decoding's, every prompt."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    spec = LLM(draft="self", draft_quantization=fmt, num_speculative_tokens=k, dtype="float32", policy=policy)
    plain = LLM(method="none", dtype="float32")
    return all(spec.generate([p], params)[0].token_ids == plain.generate([p], params)[0].token_ids for p in prompts)


# ---- SmolLM2-1.7B's shape: costs -----------------------------------------------------------------

def big_layers_folder(layers: int | None) -> Path:
    """benchmarks/llamacpp.py's big folder, or a copy of it with the first `layers` decoder layers."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llamacpp import big_folder

    full = big_folder()
    if layers is None or layers >= FULL_LAYERS:
        return full
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = full.with_name(f"{full.name}-{layers}layers")
    if (folder / "model.safetensors").exists():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in full.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy2(f, tmp / f.name)
    config = json.loads((full / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    keep = {}
    with safe_open(str(full / "model.safetensors"), "pt") as st:
        for name in st.keys():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers:
                keep[name] = st.get_tensor(name)
    save_file(keep, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(folder)
    return folder


def big(args) -> dict:
    import gc

    from quickdraft.bench.measure import measure_propose, measure_target_steps

    out = {"layers": {}, "context": args.context}
    qs = sorted({1, *(k + 1 for k in args.ks)})
    for layers in args.layers or [FULL_LAYERS]:
        folder = big_layers_folder(layers)
        entry = {"folder": folder.name, "formats": {}}
        for fmt in args.formats:
            print(f"[self_draft] big shape, {layers} layers, self-draft {fmt}", file=sys.stderr, flush=True)
            llm = LLM(str(folder), draft="self", draft_quantization=fmt, num_speculative_tokens=max(args.ks),
                      dtype="float32", compile=False, policy="fixed")
            if "target_step_s" not in entry:
                steps = measure_target_steps(llm.target, [1], qs, args.context, args.iters)[0]
                entry["target_step_s"] = dict(zip(map(str, qs), steps))
            T = {int(q): s for q, s in entry["target_step_s"].items()}
            propose = measure_propose(llm, [1], args.ks, args.context, args.iters)[0]
            draft_step = measure_target_steps(llm.draft, [1], [1], args.context, args.iters)[0][0]
            rows = []
            for k, t_prop in zip(args.ks, propose):
                c, v = t_prop / (k * T[1]), T[k + 1] / T[1]
                rows.append({"k": k, "propose_s": t_prop, "c": c, "verify_ratio": v, "cost_steps": k * c + v,
                             "alpha_for_1x": required_alpha(k, k * c + v),
                             "alpha_for_1.6x": required_alpha(k, 1.6 * (k * c + v))})
            entry["formats"][fmt] = {"draft_step_s": draft_step, "draft_over_target_step": draft_step / T[1],
                                     "rows": rows}
            del llm
            gc.collect()
        out["layers"][str(layers)] = entry
    if len(out["layers"]) >= 2:
        out["extrapolated_24_layers"] = extrapolate(out, args)
    return out


def extrapolate(out: dict, args) -> dict:
    """A straight line in the layer count through the measured copies, to 24 layers: T(q),
    the draft's propose time, and the ratios from them."""
    import numpy as np

    Ls = np.array([int(L) for L in out["layers"]], dtype=float)

    def fit(values: list[float]) -> float:
        slope, icpt = np.polyfit(Ls, np.array(values), 1)
        return float(slope * FULL_LAYERS + icpt)

    qs = list(next(iter(out["layers"].values()))["target_step_s"])
    T = {int(q): fit([e["target_step_s"][q] for e in out["layers"].values()]) for q in qs}
    res = {"target_step_s": {str(q): t for q, t in T.items()}, "formats": {}}
    for fmt in args.formats:
        rows = []
        for i, k in enumerate(args.ks):
            t_prop = fit([e["formats"][fmt]["rows"][i]["propose_s"] for e in out["layers"].values()])
            c, v = t_prop / (k * T[1]), T[k + 1] / T[1]
            rows.append({"k": k, "propose_s": t_prop, "c": c, "verify_ratio": v, "cost_steps": k * c + v,
                         "alpha_for_1x": required_alpha(k, k * c + v),
                         "alpha_for_1.6x": required_alpha(k, 1.6 * (k * c + v))})
        res["formats"][fmt] = {"rows": rows}
    return res


# ---- report --------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    lines = [f"# Self-speculation (draft=\"self\") on {result['model']}", "", provenance_line(result["provenance"]), "",
             f"Command: `{result['provenance']['command']}`", "",
             f"Load average (1 min) before / after: {result['load_before'][0] if result['load_before'] else '?'} / "
             f"{result['load_after'][0] if result['load_after'] else '?'} on a 2-core machine shared with other "
             "work; one core pinned.", ""]
    if result["model"] == "bundled":
        b = result["bundled"]
        lines += [f"Bundled target as float32, {b['prompts']} held-out code openings x {b['new_tokens']} new tokens, "
                  f"batch 1, greedy, policy {b.get('policy', 'fixed')}. Speedup: median over repeats of plain's time / the configuration's "
                  "(paired). c: the self-draft's drafting per token / a plain target step; T(k+1)/T(1): the verify "
                  "step over a plain step.", "",
                  "| draft | k | speedup | predicted | acceptance | tokens/step | c | T(k+1)/T(1) | output = plain |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for fmt, f in b["formats"].items():
            for r in f["rows"]:
                lines.append(f"| {fmt} | {r['k']} | {r['speedup']:.2f}x | {r['predicted_speedup']:.2f}x | "
                             f"{r['acceptance_rate']:.3f} | {r['tokens_per_step']:.2f} | {r['c']:.3f} | "
                             f"{r['verify_ratio']:.2f} | {'yes' if r['identical'] else 'NO'} |")
        return "\n".join(lines) + "\n"
    g = result["big"]
    lines += ["SmolLM2-1.7B's shape, random weights, float32, eager steps, batch 1, "
              f"{g['context']} tokens of context. Costs only: acceptance on random weights says nothing. "
              "c: the self-draft's propose time per drafted token / a plain target step; cost: k c + T(k+1)/T(1), "
              "a step's time in plain steps; the acceptance rates (i.i.d.) at which that step breaks even and "
              "gives 1.6x.", ""]
    blocks = [(f"{L} layers (measured)", e) for L, e in g["layers"].items()]
    if "extrapolated_24_layers" in g:
        blocks.append(("24 layers (extrapolated: a straight line in the layer count through the rows above)",
                       g["extrapolated_24_layers"]))
    for title, e in blocks:
        T = e["target_step_s"]
        lines += [f"## {title}", "", "Target step: " + ", ".join(f"T({q}) {1e3 * t:.1f} ms" for q, t in T.items()), "",
                  "| draft | k | propose (ms) | c | T(k+1)/T(1) | step cost (plain steps) | acceptance for 1x | "
                  "for 1.6x |", "|---|---|---|---|---|---|---|---|"]
        for fmt, f in e["formats"].items():
            for r in f["rows"]:
                need = [f"{a:.2f}" if a == a else "out of reach" for a in (r["alpha_for_1x"], r["alpha_for_1.6x"])]
                lines.append(f"| {fmt} | {r['k']} | {1e3 * r['propose_s']:.1f} | {r['c']:.3f} | "
                             f"{r['verify_ratio']:.2f} | {r['cost_steps']:.2f} | {need[0]} | {need[1]} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["bundled", "big"], default="bundled")
    ap.add_argument("--formats", nargs="+", choices=["int4", "int8"], default=["int4", "int8"])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5])
    ap.add_argument("--policy", choices=["fixed", "auto"], default="fixed",
                    help="bundled: k every step (fixed) or the default policy's choice up to k (auto)")
    ap.add_argument("--prompts", type=int, default=6, help="bundled: held-out code openings")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5, help="timed repetitions of each step-cost measurement")
    ap.add_argument("--layers", type=int, nargs="*", default=None,
                    help="big: decoder layers of the copies measured (default: all 24)")
    ap.add_argument("--context", type=int, default=128, help="big: tokens cached before the timed steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cores", type=int, nargs="*", default=None, help="pin to these cores (default: the first --threads)")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    if sorted(set(args.ks)) != args.ks or args.ks[0] < 1:
        ap.error("--ks must be increasing and >= 1")
    torch.set_num_threads(args.threads)
    cores = args.cores or (sorted(os.sched_getaffinity(0))[:args.threads] if hasattr(os, "sched_getaffinity") else None)
    if cores:
        os.sched_setaffinity(0, cores)
    load_before = loadavg()
    result = {"model": args.model, "threads": args.threads, "pinned_cores": cores, "load_before": load_before}
    if args.model == "bundled":
        result["bundled"] = bundled(args)
    else:
        result["big"] = big(args)
    result["load_after"] = loadavg()
    result["provenance"] = provenance("cpu", threads=args.threads, load_before=load_before)
    name = args.name or f"self_draft_{args.model}_cpu"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / f"{name}.md").write_text(markdown(result))
    print((args.out_dir / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
