"""quickdraft on a real model, SmolLM2-135M-Instruct (`LLM(target="smollm2")`), against
transformers on the same float32 weights, three chat workloads, measured side by side.

Workloads (quickdraft.bench.workloads; every prompt rendered with the model's chat template):
- chat: general instructions and questions;
- code: "write a function that ..." requests in several languages;
- editing: a 30-80 line held-out Python file inline and "rename X to Y, return the whole file"
  (most of a good answer is copied from the prompt).

Rows (each block = one thread count x one temperature x one workload, all rows in the same run):
- ours-plain vs hf-plain (transformers `generate`);
- ours-draft-k{k} (the shipped smollm2 draft; skipped with "draft not shipped yet" until
  quickdraft/default_models/smollm2-draft exists) vs ours-plain and vs hf-assisted
  (transformers' assisted generation with the same draft, its default assistant schedule);
- ours-{ngram,suffix,lookahead}-k{k} vs ours-plain and vs hf-prompt-lookup-k{k}
  (`prompt_lookup_num_tokens=k`).

Both libraries load the same weights: ours dequantises the catalogue GGUF into float32 at load
(`quantization="none"`: by default quickdraft runs that 4-bit file on its int4 kernel),
transformers loads a float32 folder converted once from that GGUF (`convert_gguf`, kept under the
quickdraft cache). Batch 1, one prompt per call, eos ignored by both (fixed output lengths),
temperature 0 (greedy: every output compared with ours-plain token by token) and 0.8 (no top-k /
top-p on either side; seeded per prompt, outputs differ by construction). Each block: one short
warm-up per row, then `--repeats` repeats running every row over all prompts in an order rotated
per repeat; a ratio is taken within each repeat (both rows ran in it) and its median reported
(the ratio of medians too). Suffix decoding's global cache is emptied before every repeat.
transformers' figures per step count forwards of the target (prefill included) with a hook.

With the draft: T_draft / T(1) (k draft tokens, catch-up included) and T(k+1) / T(1) (a verify
over k+1 positions against a 1-token step) measured once per thread count at a 512-token context.

The machine's load: 1-minute load average before and after each block, and the CPU time that
other processes used while the block ran, as a share of all cores (near 0 on a quiet machine).

    python benchmarks/real_model.py       # the full benchmark: ~5 h on 2 quiet Xeon cores, ~6.5 h with the draft
    python benchmarks/real_model.py --quick --out-dir /tmp/rm --name quick   # a smoke test, 2-3 minutes
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from quickdraft import LLM, SamplingParams, SpecStats
from quickdraft.bench.hardware import cpu_model, cpu_seconds, loadavg, other_cpu_share, provenance, provenance_line
from quickdraft.bench.measure import measure_propose, measure_target_steps
from quickdraft.bench.peers import load_hf, transformers_missing
from quickdraft.bench.workloads import chat_requests, code_requests, copied_lines, editing_requests
from quickdraft.errors import QuickdraftError
from quickdraft.model.gguf import convert_gguf, is_gguf_file
from quickdraft.model.eagle3 import is_eagle3_head
from quickdraft.model.sources import cache_dir, default_draft, resolve_model
from quickdraft.proposers import PROPOSERS
from quickdraft.train.corpus import load_corpus

MODEL = "smollm2"
METHODS = ("plain", "hf", "draft", "ngram", "suffix", "lookahead")  # hf: transformers' rows
CONTEXT_METHODS = ("ngram", "suffix", "lookahead")  # drafts from the context: peer = prompt lookup
WORKLOADS = ("chat", "code", "editing")
COST_CONTEXT = 512  # tokens cached when measuring T(1), T(k+1), T_draft


# --- machine ----------------------------------------------------------------------------------

# --- models -----------------------------------------------------------------------------------

def hf_folder(gguf: Path) -> Path:
    """A float32 Hugging Face folder converted once from `gguf`, kept in the quickdraft cache
    (keyed by the file's identity, so a changed file is converted again)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / "converted" / f"{gguf.stem}-float32-{key}"
    if not (folder / "model.safetensors").exists():
        print(f"converting {gguf.name} to a float32 folder for transformers: {folder}", flush=True)
        convert_gguf(gguf, folder, dtype="float32")
    return folder


def shipped_draft() -> Path | None:
    """The draft model shipped for the model (None when none is, or when what ships is an
    EAGLE-3 head: benchmarks/eagle3.py measures that)."""
    try:
        draft = default_draft(MODEL)
    except QuickdraftError:
        return None
    return None if draft is None or is_eagle3_head(draft) else draft


def draft_hf_folder(draft: Path) -> Path:
    return hf_folder(draft) if is_gguf_file(draft) else draft


# --- runners ----------------------------------------------------------------------------------

def params_for(temperature: float, n: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=seed)


def ours_runner(llm: LLM) -> Callable:
    def run(prompts: list[list[int]], n: int, temperature: float) -> tuple[list[list[int]], dict]:
        llm.stats = SpecStats()
        outs = [list(llm.generate([p], params_for(temperature, n, i))[0].token_ids) for i, p in enumerate(prompts)]
        s = llm.stats
        out = {"steps": s.num_steps, "tokens_per_step": s.tokens_per_step}
        if llm.engine.proposer is not None:  # None where nothing was drafted (no acceptance to speak of)
            out.update({"drafting_steps": s.num_drafts,
                        "draft_tokens_per_step": s.num_draft_tokens / max(1, s.num_steps),
                        "acceptance_rate": s.acceptance_rate if s.num_draft_tokens else None,
                        "mean_acceptance_length": s.mean_acceptance_length if s.num_drafts else None})
        return outs, out
    return run


def hf_runner(model, extra: dict, pad_id: int) -> Callable:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    def run(prompts: list[list[int]], n: int, temperature: float) -> tuple[list[list[int]], dict]:
        sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                    if temperature > 0 else {"do_sample": False})
        calls[0] = 0
        outs = []
        with torch.inference_mode():
            for i, x in enumerate(prompts):
                torch.manual_seed(i)
                ids = torch.tensor([x])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=1, max_new_tokens=n,
                                     eos_token_id=None, pad_token_id=pad_id, **sampling, **extra)
                outs.append(out[0, len(x):].tolist())
        return outs, {"steps": calls[0], "tokens_per_step": sum(map(len, outs)) / max(1, calls[0])}
    return run


# --- one block --------------------------------------------------------------------------------

def run_block(rows: dict, ours: dict, pairs: list[tuple[str, str]], prompts: list[list[int]], n: int,
              temperature: float, repeats: int, expected: list[str] | None, decode: Callable) -> dict:
    names = list(rows)
    for name in names:  # warm-up: first calls pay one-time costs
        rows[name](prompts[:1], min(n, 16), temperature)
    reps: dict[str, list[dict]] = {x: [] for x in names}
    load_before, cpu0, t0 = os.getloadavg()[0], cpu_seconds(), time.perf_counter()
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        got = {}
        for name in order:
            llm = ours.get(name)
            if llm is not None and llm.engine.config.spec.method == "suffix":  # forget earlier repeats' answers
                llm.engine.proposer = PROPOSERS["suffix"].build(target=llm.target, **llm.engine.config.spec.options)
            start = time.perf_counter()
            outs, extra = rows[name](prompts, n, temperature)
            got[name] = (time.perf_counter() - start, outs, extra)
        base = got["ours-plain"][1]
        for name in names:
            secs, outs, extra = got[name]
            tokens = sum(map(len, outs))
            row = {"seconds": secs, "tokens": tokens, "tokens_per_s": tokens / secs, **extra}
            if temperature == 0:
                row["identical_prompts"] = sum(o == b for o, b in zip(outs, base))
                row["first_difference_at"] = [
                    None if o == b else next((j for j, (x, y) in enumerate(zip(o, b)) if x != y), min(len(o), len(b)))
                    for o, b in zip(outs, base)]
            if expected is not None:
                row["copied_lines"] = statistics.mean(copied_lines(decode(o), e) for o, e in zip(outs, expected))
            reps[name].append(row)
        print(f"    repeat {r + 1}/{repeats}: " + ", ".join(f"{x} {reps[x][-1]['tokens_per_s']:.1f} tok/s"
                                                             for x in names), flush=True)
    wall, cpu1 = time.perf_counter() - t0, cpu_seconds()
    methods = {}
    for name, rs in reps.items():
        m = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
             "median_s": statistics.median(x["seconds"] for x in rs)}
        for key in ("tokens_per_step", "acceptance_rate", "mean_acceptance_length", "draft_tokens_per_step",
                    "copied_lines"):
            values = [x[key] for x in rs if x.get(key) is not None]
            if key in rs[0]:
                m[key] = statistics.median(values) if values else None
        if temperature == 0:
            m["identical_to_ours_plain"] = all(x["identical_prompts"] == len(prompts) for x in rs)
            m["identical_prompts_min"] = min(x["identical_prompts"] for x in rs)
        m["repeats"] = rs
        methods[name] = m
    ratios = {}
    for a, b in pairs:
        per = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(reps[a], reps[b])]
        ratios[f"{a} / {b}"] = {"median_of_ratios": statistics.median(per), "min": min(per), "max": max(per),
                                "ratio_of_medians": methods[a]["tokens_per_s"] / methods[b]["tokens_per_s"],
                                "per_repeat": per}
    return {"methods": methods, "ratios": ratios, "seconds": wall,
            "machine": {"loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
                        "other_cpu_share": other_cpu_share(cpu0, cpu1, wall)}}


def draft_costs(plain: LLM, draft_llm: LLM, k: int, tokens: list[int], iters: int) -> dict:
    """T(1), T(k+1) of the target and T_draft(k) of the draft at a COST_CONTEXT-token context."""
    (t1, tk1), = measure_target_steps(plain.target, [1], [1, k + 1], COST_CONTEXT, iters)
    (td,), = measure_propose(draft_llm, [1], [k], COST_CONTEXT, iters, tokens=tokens)
    return {"context": COST_CONTEXT, "k": k, "iters": iters, "T1_s": t1, "Tk1_s": tk1, "T_draft_s": td,
            "T_draft_over_T1": td / t1, "Tk1_over_T1": tk1 / t1}


# --- report -----------------------------------------------------------------------------------

def _f(m: dict, key: str, fmt: str) -> str:
    """The figure formatted; "" where the row has none (transformers' rows, plain decoding),
    "-" where it has none this time (a proposer that never drafted)."""
    return "" if key not in m else "-" if m[key] is None else format(m[key], fmt)


def markdown(result: dict) -> list[str]:
    s, h = result["setup"], result["hardware"]
    threads = ", ".join(map(str, s["threads"]))
    md = [f"# quickdraft vs transformers on SmolLM2-135M-Instruct ({h['cpu_model']}, threads {threads})", "",
          *([provenance_line(result["provenance"]), ""] if "provenance" in result else []),
          f"{result['date']}. Model `{MODEL}` ({result['model']['gguf']}), float32 on CPU for both libraries "
          f"(ours dequantised from the GGUF, transformers from a float32 folder converted from it). Batch 1, "
          f"{s['new_tokens']} new tokens per prompt (eos ignored), k = {s['k']}, temperatures {s['temperatures']}, "
          f"{s['repeats']} repeats per block in rotated order after one short warm-up; tok/s are medians over "
          f"repeats, ratios medians of per-repeat ratios (rows run in the same repeat). Draft: "
          f"{result['draft']['status']}. transformers' assisted generation uses its default assistant schedule; "
          f"its tokens/step are output tokens per target forward (prefill included).", ""]
    for b in result["blocks"]:
        greedy = b["temperature"] == 0
        copy = b["workload"] == "editing"
        mach = b["machine"]
        other = "-" if mach["other_cpu_share"] is None else f"{100 * mach['other_cpu_share']:.0f}%"
        md += [f"## {b['workload']}, temperature {b['temperature']}, {b['threads']} thread(s)", "",
               f"{b['prompts']} prompts, mean {b['mean_prompt_tokens']:.0f} prompt tokens; {b['seconds']:.0f} s; "
               f"load average {mach['loadavg_1m_before']:.2f} -> {mach['loadavg_1m_after']:.2f}, other processes' "
               f"CPU {other}" + (" (the machine was shared: these timings are unreliable)."
                                 if (mach["other_cpu_share"] or 0) > 0.1 else "."), "",
               "| row | tok/s | acceptance rate | mean acceptance length | tokens/step |"
               + (" identical to ours-plain |" if greedy else "") + (" copied lines |" if copy else ""),
               "|---|---:|---:|---:|---:|" + ("---|" if greedy else "") + ("---:|" if copy else "")]
        for name, m in b["methods"].items():
            ident = ""
            if greedy:
                ident = " yes |" if m["identical_to_ours_plain"] else \
                    f" NO (min {m['identical_prompts_min']}/{b['prompts']}) |"
            md.append(f"| {name} | {m['tokens_per_s']:.1f} | {_f(m, 'acceptance_rate', '.3f')} | "
                      f"{_f(m, 'mean_acceptance_length', '.2f')} | {_f(m, 'tokens_per_step', '.2f')} |{ident}"
                      + (f" {_f(m, 'copied_lines', '.2f')} |" if copy else ""))
        md += ["", "| ratio (tokens/s) | median of per-repeat ratios | min - max | ratio of medians |",
               "|---|---:|---:|---:|"]
        for key, v in b["ratios"].items():
            md.append(f"| {key} | {v['median_of_ratios']:.2f}x | {v['min']:.2f} - {v['max']:.2f} | "
                      f"{v['ratio_of_medians']:.2f}x |")
        md.append("")
    if result["draft_costs"]:
        md += ["## Draft costs", "", f"At a {COST_CONTEXT}-token context, batch 1, medians.", "",
               "| threads | T(1) ms | T(k+1) / T(1) | T_draft / T(1) |", "|---:|---:|---:|---:|"]
        for t, c in result["draft_costs"].items():
            md.append(f"| {t} | {c['T1_s'] * 1e3:.2f} | {c['Tk1_over_T1']:.2f} | {c['T_draft_over_T1']:.2f} |")
        md.append("")
    load = (f"; load average {h['loadavg_1m_before']:.2f} before, {h['loadavg_1m_after']:.2f} after the run"
            if "loadavg_1m_before" in h else "")  # (newer results: in the provenance line)
    md += [f"Hardware: {h['cpu_model']}, {h['logical_cores']} logical cores{load}. "
           f"torch {result['software']['torch']}, transformers {result['software']['transformers']}, "
           f"Python {result['software']['python']}. Total {result['seconds']:.0f} s.", "",
           "Copied lines (editing): the share of the output's non-blank lines that are lines of the renamed file.",
           "", f"Command: `{result['command']}`", ""]
    return md


# --- main -------------------------------------------------------------------------------------

def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None, help="default: all")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                    help="default: all; plain always runs (every ratio needs it); hf = transformers' rows")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="torch threads, one block each (default 1 2)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=None, help="default 0 0.8")
    ap.add_argument("--repeats", type=int, default=None, help="default 3")
    ap.add_argument("--new-tokens", type=int, default=None, help="per prompt (default 128)")
    ap.add_argument("--prompts", type=int, default=None, help="per workload (default 8, at most 12)")
    ap.add_argument("-k", type=int, default=5, help="draft tokens per step, and prompt_lookup_num_tokens")
    ap.add_argument("--cost-iters", type=int, default=None, help="timings per draft-cost figure (default 20)")
    ap.add_argument("--draft", type=Path, default=None, help="a draft folder or .gguf to use instead of the shipped "
                    "one (e.g. a candidate before it ships)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: 1 prompt per workload, 8 new tokens, "
                    "1 repeat, 1 thread (flags given explicitly still apply)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="real_model_smollm2_cpu")
    args = ap.parse_args()
    quick = {"workloads": list(WORKLOADS), "methods": list(METHODS), "threads": [1], "temperatures": [0.0, 0.8],
             "repeats": 1, "new_tokens": 8, "prompts": 1, "cost_iters": 3}
    full = {"workloads": list(WORKLOADS), "methods": list(METHODS), "threads": [1, 2], "temperatures": [0.0, 0.8],
            "repeats": 3, "new_tokens": 128, "prompts": 8, "cost_iters": 20}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.repeats, args.new_tokens, args.prompts, args.k, args.cost_iters, *args.threads) < 1:
        ap.error("--repeats, --new-tokens, --prompts, -k, --cost-iters and --threads must be >= 1")
    if any(t < 0 for t in args.temperatures):
        ap.error("--temperatures must be >= 0")
    methods = ["plain"] + [m for m in METHODS[1:] if m in args.methods]
    if "hf" in methods:
        missing = transformers_missing()
        if missing:
            sys.exit(f"error: {missing}")
        import transformers
        transformers.logging.set_verbosity_error()  # generate() warns about flags set on purpose
    started, load_before = time.perf_counter(), loadavg()

    try:
        gguf = resolve_model(MODEL)
    except QuickdraftError as exc:
        sys.exit(f"error: {exc}")
    draft = (args.draft or shipped_draft()) if "draft" in methods else None
    if args.draft is not None and not args.draft.exists():
        sys.exit(f"error: --draft {args.draft}: no such file or folder")
    if "draft" in methods and draft is None:
        print(f"draft not shipped yet (quickdraft/default_models/{MODEL}-draft): skipping the draft rows", flush=True)
        methods.remove("draft")
    draft_status = "not requested" if "draft" not in args.methods else \
        f"{'given' if args.draft else 'shipped'} ({draft})" if draft is not None else \
        "draft not shipped yet (rows skipped)"

    # float32 as transformers loads it ("none": the catalogue's Q4_1 GGUF dequantised, not its int4 default)
    kw = {"dtype": "float32", "quantization": "none", "device": "cpu", "num_speculative_tokens": args.k}
    ours: dict[str, LLM] = {"ours-plain": LLM(MODEL, method="none", **kw)}
    if "draft" in methods:
        ours[f"ours-draft-k{args.k}"] = LLM(MODEL, draft=draft, method="draft", **kw, policy="fixed")
    for m in CONTEXT_METHODS:
        if m in methods:
            ours[f"ours-{m}-k{args.k}"] = LLM(MODEL, method=m, **kw, policy="fixed")
    plain = ours["ours-plain"]
    rows: dict[str, Callable] = {name: ours_runner(llm) for name, llm in ours.items()}
    pairs = [(name, "ours-plain") for name in ours if name != "ours-plain"]
    if "hf" in methods:
        folder = hf_folder(gguf)
        hf_target = load_hf(folder, torch.float32, torch.device("cpu"))
        pad = hf_target.generation_config.eos_token_id
        pad = (pad[0] if isinstance(pad, list) else pad) if pad is not None else 0
        rows["hf-plain"] = hf_runner(hf_target, {}, pad)
        pairs.insert(0, ("ours-plain", "hf-plain"))
        if "draft" in methods:
            hf_draft = load_hf(draft_hf_folder(draft), torch.float32, torch.device("cpu"))
            rows["hf-assisted"] = hf_runner(hf_target, {"assistant_model": hf_draft}, pad)
            pairs += [(f"ours-draft-k{args.k}", "hf-assisted"), ("hf-assisted", "hf-plain")]
        if any(m in methods for m in CONTEXT_METHODS):
            lookup = f"hf-prompt-lookup-k{args.k}"
            rows[lookup] = hf_runner(hf_target, {"prompt_lookup_num_tokens": args.k}, pad)
            pairs += [(f"ours-{m}-k{args.k}", lookup) for m in CONTEXT_METHODS if m in methods]
            pairs.append((lookup, "hf-plain"))

    docs = load_corpus(None).heldout
    workloads: dict[str, tuple[list[list[int]], list[str] | None]] = {}
    for w in args.workloads:
        if w == "chat":
            workloads[w] = ([plain.encode_chat(c) for c in chat_requests(args.prompts)], None)
        elif w == "code":
            workloads[w] = ([plain.encode_chat(c) for c in code_requests(args.prompts)], None)
        else:
            eds = editing_requests(docs, args.prompts)
            workloads[w] = ([plain.encode_chat(e.messages) for e in eds], [e.expected for e in eds])
    decode = plain.tokenizer.decode
    print(f"rows: {', '.join(rows)}; workloads: " + ", ".join(
        f"{w} ({len(p)} prompts, mean {statistics.mean(map(len, p)):.0f} tokens)" for w, (p, _) in workloads.items()),
        flush=True)

    blocks, costs = [], {}
    stream = [t for p, _ in workloads.values() for x in p for t in x]  # real text for the draft's contexts
    for threads in args.threads:
        torch.set_num_threads(threads)
        if "draft" in methods:
            costs[str(threads)] = draft_costs(plain, ours[f"ours-draft-k{args.k}"], args.k, stream,
                                              args.cost_iters)
            c = costs[str(threads)]
            print(f"threads {threads}: T(1) {c['T1_s'] * 1e3:.2f} ms, T(k+1)/T(1) {c['Tk1_over_T1']:.2f}, "
                  f"T_draft/T(1) {c['T_draft_over_T1']:.2f}", flush=True)
        for temperature in args.temperatures:
            for w, (prompts, expected) in workloads.items():
                print(f"threads {threads}, temperature {temperature}, {w}:", flush=True)
                b = run_block(rows, ours, pairs, prompts, args.new_tokens, temperature, args.repeats, expected, decode)
                blocks.append({"threads": threads, "temperature": temperature, "workload": w,
                               "prompts": len(prompts), "mean_prompt_tokens": statistics.mean(map(len, prompts)),
                               **b})
                print("    " + ", ".join(f"{k} {v['median_of_ratios']:.2f}x" for k, v in b["ratios"].items()),
                      flush=True)

    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    cmd = "python benchmarks/real_model.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = {
        "benchmark": "real_model",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": cmd,
        "seconds": time.perf_counter() - started,
        "model": {"name": MODEL, "gguf": str(gguf), "dtype": "float32", "device": "cpu"},
        "draft": {"status": draft_status, "path": None if draft is None else str(draft)},
        "setup": {"workloads": list(workloads), "rows": list(rows), "threads": args.threads,
                  "temperatures": args.temperatures, "repeats": args.repeats, "new_tokens": args.new_tokens,
                  "prompts": args.prompts, "k": args.k, "batch": 1, "ignore_eos": True, "quick": args.quick,
                  "warmup": "one call per row per block, first prompt, min(new_tokens, 16) tokens",
                  "timing": "wall time of all prompts' generate calls, one prompt per call",
                  "seeds": "prompt i of a block uses seed i (ours: SamplingParams.seed; transformers: "
                           "torch.manual_seed)"},
        "hardware": {"device": "cpu", "cpu_model": cpu_model(), "logical_cores": os.cpu_count()},
        "provenance": provenance("cpu", args.threads, load_before=load_before),
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": hf_version},
        "blocks": blocks,
        "draft_costs": costs,
        "ratio_definition": "tokens/s of the first row / tokens/s of the second in the same repeat (> 1: first faster)",
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (args.out_dir / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"wrote {args.out_dir / args.name}.json and .md")


if __name__ == "__main__":
    main()
