"""quickdraft against transformers on the same weights and prompts: plain `generate`,
assisted generation (`assistant_model=`, transformers' default assistant schedule) and
prompt lookup (`prompt_lookup_num_tokens=`).

Greedy, batch 1 (one prompt per call; transformers' assisted generation is batch 1 only),
eos ignored by both (transformers: `eos_token_id=None`, which neither stops nor suppresses
eos, as our `ignore_eos` does; `min_new_tokens` would suppress it and change the output).
Every method is warmed up once, then each repeat runs every method over all prompts in an
order rotated between repeats. Figures are medians over repeats; a ratio ours / peer is
taken per repeat (both ran in the same repeat) and its median reported. Every output is
compared with ours-plain token by token; a mismatch is reported (prompts identical, first
differing position), never hidden: in float32 they match, in bf16/fp16 a 1-token and a
k-token forward may round differently.

Pairs: ours-plain / hf-plain, ours-draft-k{k} / hf-assisted, ours-ngram-k{k} /
hf-prompt-lookup-k{k}.
"""

from __future__ import annotations

import importlib
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

from ..errors import QuickdraftError

PEER_OF = {"none": "hf-plain", "draft": "hf-assisted", "ngram": "hf-prompt-lookup"}  # ours method -> peer


def transformers_missing() -> Optional[str]:
    """None when transformers can be imported, else a one-line reason."""
    try:
        importlib.import_module("transformers")
    except ImportError:
        return "transformers is not installed (pip install transformers)"
    return None


def ours_name(method: str, k: int) -> str:
    return "ours-plain" if method == "none" else f"ours-{method}-k{k}"


def peer_name(method: str, k: int) -> str:
    return PEER_OF[method] + (f"-k{k}" if method == "ngram" else "")


def load_hf(folder: Path, dtype, device):
    from ..model.compressed import transformers_kwargs

    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    try:
        return AutoModelForCausalLM.from_pretrained(folder, **{key: dtype}, **transformers_kwargs(folder)).to(device).eval()
    except (OSError, ValueError) as exc:
        raise QuickdraftError(f"transformers cannot load {folder}: {str(exc).splitlines()[0]}") from None


def run_peers(ours: dict, target_dir: Path, draft_dir: Optional[Path], prompts: list[list[int]], new_tokens: int,
              repeats: int, progress: Optional[Callable[[], None]] = None) -> dict:
    """Time our LLMs against transformers on the same weights and token-id prompts.

    ours: {(method, k): LLM} with ("none", 0) (plain decoding) required; methods "draft"
    and "ngram" get a transformers peer, others are ignored. The transformers models are
    loaded from target_dir (and draft_dir for assisted generation) in our plain target's
    dtype and device. `progress` is called after the warm-up and after every repeat.
    """
    import torch
    import transformers

    from .. import SamplingParams

    if ("none", 0) not in ours:
        raise QuickdraftError("peers need our plain decoding, ('none', 0)")
    if not prompts or repeats < 1 or new_tokens < 1:
        raise QuickdraftError("peers need at least one prompt, one repeat and one new token")
    ours = {mk: llm for mk, llm in ours.items() if mk[0] in PEER_OF}
    if any(m == "draft" for m, _ in ours) and draft_dir is None:
        raise QuickdraftError("peers: assisted generation needs the draft folder")
    plain = ours[("none", 0)]
    dtype, device = plain.target.dtype, plain.target.device
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate() warns about flags we set on purpose
    try:
        hf_target = load_hf(Path(target_dir), dtype, device)
        hf_draft = load_hf(Path(draft_dir), dtype, device) if any(m == "draft" for m, _ in ours) else None
        pad_id = hf_target.generation_config.pad_token_id
        if pad_id is None:
            eos = hf_target.generation_config.eos_token_id
            pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

        def run_ours(llm, ps: list[list[int]], n: int) -> list[list[int]]:
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            return [list(llm.generate([x], params)[0].token_ids) for x in ps]

        def run_hf(extra: dict, ps: list[list[int]], n: int) -> list[list[int]]:
            outs = []
            with torch.inference_mode():
                for x in ps:
                    ids = torch.tensor([x], device=device)
                    out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                             max_new_tokens=n, eos_token_id=None, pad_token_id=pad_id, **extra)
                    outs.append(out[0, len(x):].tolist())  # .tolist() synchronises the device
            return outs

        runners: dict[str, Callable] = {}
        llm_of: dict[str, object] = {}
        pairs: list[tuple[str, str]] = []
        for (m, k), llm in ours.items():
            name = ours_name(m, k)
            runners[name] = lambda ps, n, llm=llm: run_ours(llm, ps, n)
            llm_of[name] = llm
            peer = peer_name(m, k)
            if peer not in runners:
                extra = {"hf-plain": {}, "hf-assisted": {"assistant_model": hf_draft}}.get(
                    peer, {"prompt_lookup_num_tokens": k})
                runners[peer] = lambda ps, n, extra=extra: run_hf(extra, ps, n)
            pairs.append((name, peer))
        names = sorted(runners, key=lambda n: (n.startswith("hf-"), not n.endswith("-plain"), n))  # ours, then peers

        for name in names:  # warm-up: one full-length call each (first calls pay one-time costs)
            runners[name](prompts[:1], new_tokens)
        if progress is not None:
            progress()
        reps: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(repeats):
            order = names[r % len(names):] + names[: r % len(names)]
            got = {}
            for name in order:
                llm = llm_of.get(name)
                if llm is not None:
                    llm.stats = type(llm.stats)()
                t0 = time.perf_counter()
                outs = runners[name](prompts, new_tokens)
                got[name] = (time.perf_counter() - t0, outs, llm.stats if llm is not None else None)
            base = got["ours-plain"][1]
            for name in names:
                secs, outs, stats = got[name]
                tokens = sum(len(o) for o in outs)
                first_diff = [None if o == b else next((j for j, (x, y) in enumerate(zip(o, b)) if x != y),
                                                       min(len(o), len(b))) for o, b in zip(outs, base)]
                row = {"seconds": secs, "tokens": tokens, "tokens_per_s": tokens / secs,
                       "identical_prompts": sum(d is None for d in first_diff), "first_difference_at": first_diff}
                if stats is not None and stats.num_steps:
                    row["tokens_per_step"] = stats.tokens_per_step
                reps[name].append(row)
            if progress is not None:
                progress()
    finally:
        transformers.logging.set_verbosity(verbosity)

    methods = {}
    for name, rows in reps.items():
        methods[name] = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in rows),
                         "median_s": statistics.median(x["seconds"] for x in rows),
                         "identical_to_ours_plain": all(x["identical_prompts"] == len(prompts) for x in rows),
                         "identical_prompts_min": min(x["identical_prompts"] for x in rows),
                         "repeats": rows}
        if "tokens_per_step" in rows[0]:
            methods[name]["tokens_per_step"] = statistics.median(x["tokens_per_step"] for x in rows)
    ratios = {}
    for a, b in pairs:
        per = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(reps[a], reps[b])]
        ratios[f"{a} / {b}"] = {"median_of_ratios": statistics.median(per),
                                "ratio_of_medians": methods[a]["tokens_per_s"] / methods[b]["tokens_per_s"],
                                "per_repeat": per}
    gc = hf_draft.generation_config if hf_draft is not None else None
    schedule = None if gc is None else {  # None in the draft's config: transformers' global defaults apply
        k: getattr(gc, k, None) if getattr(gc, k, None) is not None else f"default ({d})"
        for k, d in (("num_assistant_tokens", 20), ("num_assistant_tokens_schedule", "constant"),
                     ("assistant_confidence_threshold", 0.4))}
    return {"transformers": transformers.__version__, "dtype": str(dtype).removeprefix("torch."),
            "device": device.type,
            "workload": {"prompts": len(prompts), "mean_prompt_tokens": statistics.mean(map(len, prompts)),
                         "new_tokens": new_tokens, "batch": 1, "greedy": True, "ignore_eos": True,
                         "repeats": repeats, "warmup": 1, "hf_assistant_schedule": schedule,
                         "timing": "wall time of all prompts' generate calls, one prompt per call"},
            "methods": methods, "ratios": ratios,
            "ratio_definition": "tokens/s of ours / tokens/s of the peer in the same repeat (> 1: ours faster)"}


def markdown(peers: dict) -> list[str]:
    """Markdown lines: the methods' table and the ratios' table."""
    w = peers["workload"]
    n = w["prompts"]
    md = [f"Peers: transformers {peers['transformers']}, same weights ({peers['dtype']}, {peers['device']}), greedy, "
          f"batch 1, {n} prompts (mean {w['mean_prompt_tokens']:.0f} tokens), {w['new_tokens']} new tokens each "
          f"(eos ignored); one warm-up, {w['repeats']} repeats in rotated order, medians. Assisted generation uses "
          f"transformers' assistant schedule {w['hf_assistant_schedule']}.", "",
          "| method | median tok/s | median s | tokens/step | identical to ours-plain |",
          "|---|---:|---:|---:|---|"]
    for name, m in peers["methods"].items():
        ident = "yes" if m["identical_to_ours_plain"] else f"NO (min {m['identical_prompts_min']}/{n} prompts)"
        mal = f"{m['tokens_per_step']:.2f}" if "tokens_per_step" in m else ""
        md.append(f"| {name} | {m['tokens_per_s']:.1f} | {m['median_s']:.2f} | {mal} | {ident} |")
    md += ["", "| ours / peer (tokens/s) | median of per-repeat ratios | ratio of medians |", "|---|---:|---:|"]
    for k, v in peers["ratios"].items():
        md.append(f"| {k} | {v['median_of_ratios']:.2f}x | {v['ratio_of_medians']:.2f}x |")
    return md
