"""What `quickdraft bench` runs: plain decoding against each method over batch sizes, k values and
temperatures, measured side by side with warm-up and repeats.

Per configuration: output tokens/s, time per output token, speedup over plain decoding
(paired: plain runs in the same repeat, the order rotated per repeat), acceptance rate,
mean acceptance length, acceptance per position, the measured cost ratios c = T_propose(k)
/ (k T(1)) and T(B, k+1) / T(B, 1), and the speedup those predict,
E * T(1) / (T_propose(k) + T(k+1)) with E = (1 - a^(k+1)) / (1 - a) from the acceptance
rate a, next to the measured one (steps that drafted nothing, as prompt lookup has, are
counted as plain steps). Writes JSON, a markdown table and PNG plots.

With `--peers` (needs transformers) the same run also times transformers' plain `generate`,
assisted generation and prompt lookup on the same weights and prompts, greedy at batch 1,
against ours, with token equality checked (`quickdraft.bench.peers`).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def run_bench(target, draft, methods: list[str], spec_options: dict, batch_sizes: list[int], ks: list[int],
              temperatures: list[float], prompts: list, new_tokens: int, repeats: int, iters: int,
              progress=None, peers: bool = False, dtype: str | None = None, device: str | None = None,
              llm_options: dict | None = None) -> dict:
    """Measure every (temperature, batch size, method, k) against plain decoding; with
    `peers`, also transformers' plain, assisted and prompt-lookup generation (greedy,
    batch 1) against ours on the same prompts (result["peers"], see peers.run_peers).
    dtype and device go to every LLM (None: quickdraft's defaults), and llm_options (e.g.
    tensor_parallel_size: the LLMs then share one tensor-parallel target)."""
    from .. import LLM, SamplingParams, proposers
    from ..policy.costs import expected_tokens
    from .measure import measure_propose, measure_target_steps

    more = dict(llm_options or {})
    plain = LLM(target, method="none", dtype=dtype, device=device, **more)
    encoded = [plain.encode(p) for p in prompts]
    llms = {}
    for m in methods:
        for k in ks:
            llms[(m, k)] = LLM(target, draft=draft if proposers.get(m).needs_draft_model else None, method=m,
                               num_speculative_tokens=k,
                               spec_options=spec_options, dtype=dtype, device=device,
                               **dict({"policy": "fixed"}, **more))  # k as asked, every step
    names = [("none", 0)] + list(llms)
    for llm in [plain, *llms.values()]:  # a fresh cache's background AOT build: switch before timing
        llm.wait_for_aot()
    runs = []
    # step costs for the prediction, measured once per batch size
    qs = list(range(1, max(ks) + 2))
    steps = measure_target_steps(plain.target, batch_sizes, qs, 128, iters)
    propose = {m: measure_propose(llms[(m, max(ks))], batch_sizes, ks, 128, iters) for m in methods}
    for temp in temperatures:
        for bi, B in enumerate(batch_sizes):
            # every prompt, in batches of B (the last one filled up from the first prompts): at batch 1
            # each prompt in turn, not the first alone
            batches = [[encoded[(j + i) % len(encoded)] for i in range(B)] for j in range(0, len(encoded), B)]
            params = [SamplingParams(temperature=temp, max_tokens=new_tokens, ignore_eos=True, seed=i)
                      for i in range(B)]
            for llm in [plain, *llms.values()]:  # warm-up
                llm.generate(batches[0][:1], SamplingParams(temperature=temp, max_tokens=4, ignore_eos=True))
            per = {n: [] for n in names}
            for r in range(repeats):
                order = names[r % len(names):] + names[: r % len(names)]
                secs = {}
                for n in order:
                    llm = plain if n[0] == "none" else llms[n]
                    llm.stats = type(llm.stats)()
                    if llm.engine.proposer is not None:  # each run sees the prompts as new (no outputs of the last run)
                        llm.engine.proposer.forget_requests()
                    t0 = time.perf_counter()
                    outs = [o for batch in batches for o in llm.generate(batch, params)]
                    secs[n] = (time.perf_counter() - t0, sum(len(o.token_ids) for o in outs), llm.stats)
                for n in names:
                    s, tokens, st = secs[n]
                    per[n].append((s, tokens, secs[("none", 0)][0] / s, st))
                if progress is not None:
                    progress()
            T1 = steps[bi][0]
            for (m, k), rows in per.items():
                if m == "none":
                    continue
                a = statistics.median(st.acceptance_rate for *_, st in rows)
                # share of steps that drafted at all (prompt lookup finds no match on some)
                r_d = statistics.median(st.num_drafts / max(1, st.num_steps) for *_, st in rows)
                st = rows[0][3]
                t_prop = propose[m][bi][ks.index(k)]
                Tk1 = steps[bi][k]
                E = 1 + r_d * (expected_tokens(a, k) - 1)
                predicted = E * T1 / (t_prop + r_d * Tk1 + (1 - r_d) * T1)
                runs.append({
                    "temperature": temp, "batch_size": B, "method": m, "k": k,
                    "tokens_per_s": statistics.median(tok / s for s, tok, *_ in rows),
                    "ms_per_token": statistics.median(1e3 * s / tok for s, tok, *_ in rows),
                    "plain_tokens_per_s": statistics.median(tok / s for s, tok, *_ in per[("none", 0)]),
                    "speedup": statistics.median(x[2] for x in rows),
                    "acceptance_rate": a, "draft_rate": r_d,
                    "tokens_per_step": statistics.median(x[3].tokens_per_step for x in rows),
                    "accepted_per_pos": [v / max(1, st.num_drafts) for v in st.accepted_per_pos],
                    "c": t_prop / (k * T1), "verify_ratio": Tk1 / T1, "predicted_speedup": predicted,
                })
    result = {"runs": runs, "target_step_s": steps, "query_lengths": qs, "batch_sizes": batch_sizes,
              "propose_s": propose, "ks": ks, "target_dtype": str(plain.target.dtype).removeprefix("torch.")}
    if peers:
        from ..llm import default_model_dirs
        from .peers import PEER_OF, run_peers

        if target is None:
            target, draft = default_model_dirs()[0], draft or default_model_dirs()[1]
        ours = {("none", 0): plain, **{mk: llm for mk, llm in llms.items() if mk[0] in PEER_OF}}
        result["peers"] = run_peers(ours, target, draft, encoded, new_tokens, repeats, progress=progress)
    return result


def write_outputs(result: dict, out_dir: Path, name: str, device: str | None = None) -> list[Path]:
    """JSON, markdown and PNG of a run_bench result (with its "setup"), the JSON and markdown
    with the provenance record (hardware.provenance; device: the one measured, default cuda when
    torch initialised it)."""
    from .hardware import provenance_line

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    if "provenance" not in result:
        from .hardware import provenance

        result["provenance"] = provenance(device)
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    s = result["setup"]
    md = [f"# quickdraft bench ({s['hardware']}, torch {s['torch']})", "", provenance_line(result["provenance"]), "",
          "| T | batch | method | k | tok/s | ms/token | speedup | predicted | acceptance | tokens/step | "
          "c | T(k+1)/T(1) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        md.append(f"| {r['temperature']} | {r['batch_size']} | {r['method']} | {r['k']} | {r['tokens_per_s']:.1f} | "
                  f"{r['ms_per_token']:.2f} | {r['speedup']:.2f}x | {r['predicted_speedup']:.2f}x | "
                  f"{r['acceptance_rate']:.3f} | {r['tokens_per_step']:.2f} | {r['c']:.3f} | "
                  f"{r['verify_ratio']:.2f} |")
    peers = result.get("peers")
    if peers is not None:
        from .peers import markdown

        md += ["", "## Peers", ""] + (markdown(peers) if "methods" in peers else [f"Skipped: {peers['skipped']}."])
    paths[1].write_text("\n".join(md) + "\n")
    png = out_dir / f"{name}.png"
    return paths + ([png] if plot_bench(result, png) else [])


def plot_bench(result: dict, png: Path) -> bool:
    """PNG of a bench result: a row per temperature; per method a panel of measured speedup over
    plain decoding vs k, one line per batch size (a sequential colour scale, the predicted
    speedup dashed in the same colour), and a last panel of acceptance by draft position at
    batch 1 (one line per method, its largest k). The machine in the title. False without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = result["runs"]
    temps = sorted({r["temperature"] for r in runs})
    methods = sorted({r["method"] for r in runs})
    batches = sorted({r["batch_size"] for r in runs})
    colors = dict(zip(batches, plt.cm.viridis([i / max(1, len(batches) - 1) * 0.9 for i in range(len(batches))])))
    fig, axes = plt.subplots(len(temps), len(methods) + 1, figsize=(4.2 * (len(methods) + 1), 3.4 * len(temps)),
                             squeeze=False)
    for row, temp in zip(axes, temps):
        for ax, method in zip(row, methods):
            for b in batches:
                pts = sorted((r for r in runs if (r["temperature"], r["method"], r["batch_size"]) == (temp, method, b)),
                             key=lambda r: r["k"])
                if not pts:
                    continue
                ks = [r["k"] for r in pts]
                ax.plot(ks, [r["speedup"] for r in pts], marker="o", color=colors[b], label=f"B={b}")
                ax.plot(ks, [r["predicted_speedup"] for r in pts], ls="--", lw=0.9, color=colors[b])
            ax.axhline(1.0, color="grey", ls=":", lw=0.8)
            ax.set(title=f"{method}, T={temp}", xlabel="k (draft tokens per step)", ylabel="speedup over plain")
            ax.legend(fontsize=7, title="measured (dashed: predicted)", title_fontsize=6, loc="best")
        ax = row[-1]
        for method in methods:
            pts = [r for r in runs if (r["temperature"], r["method"], r["batch_size"]) == (temp, method, batches[0])]
            if pts:
                best = max(pts, key=lambda r: r["k"])
                acc = best["accepted_per_pos"]
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{method} k={best['k']}")
        ax.set(title=f"acceptance by position, B={batches[0]}, T={temp}", xlabel="draft position",
               ylabel="fraction of steps accepted", ylim=(0, 1.02))
        ax.legend(fontsize=7)
    s = result["setup"]
    fig.suptitle(f"quickdraft bench · {s.get('hardware', '?')} · torch {s.get('torch', '?')} · {s.get('date', '')}",
                 fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True
