"""What `quickdraft select` runs: every speculation method (and draft, and k) on the user's own
prompts, on this machine, end to end against plain decoding; the fastest is the choice.

Candidates: the free proposers (suffix, n-gram), a self-draft (the target's own weights in
int4: `draft="self"`) where the target is not stored in 4 bits, the target's own draft (bundled
and named models), and every draft model or EAGLE-3 head given. Each is measured by
`bench.compare.run_bench` (the same harness as `quickdraft bench`): per k, output tokens/s
over the workload, paired with plain decoding in the same repeat (the order rotated per
repeat), acceptance, and the step costs c = T_propose(k) / (k T(1)) and T(k+1) / T(1). A
candidate's runs are measured next to a plain run of their own, one candidate at a time (so
only its models are in memory).

The choice is the (method, draft, k) of the highest paired speedup, a speedup counted at most as
its tokens per step (more is the machine's noise: `credible`); if none is faster than
plain decoding, the choice is plain decoding (method "none"): `select` never picks a method
that measured slower, nor one that emitted one token per step (it cannot be faster: a speedup
it shows is noise). Where several rows come within RUNOFF (5%) of the fastest, a single measurement
cannot tell them apart on a real machine (four n-gram k within 5% of each other, re-measured:
k = 4 chosen at 1.19x, k = 2 1.25x), so those contenders (at most RUNOFF_MOST) are measured once
more, side by side with each other and plain decoding, and the choice is the contender of the best
mean of its two credible speedups. It is written as a `Profile` (quickdraft.policy.costs) with its `choice`,
the target's step times and the chosen method's costs and acceptance (so `--policy goodput`
can use it too); `LLM(profile=...)`, `generate --profile` and `serve --profile` run the choice.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import QuickdraftError

RUNOFF = 0.05  # rows within this fraction of the fastest are measured again before choosing
RUNOFF_MOST = 4  # the most rows measured again
WORKLOADS = ("code", "editing", "chat", "code-chat", "editing-chat")  # built-in: see `workload_prompts`
FREE_METHODS = ("suffix", "ngram")  # proposers that need no model


@dataclass(frozen=True)
class Candidate:
    method: str
    draft: str | None = None  # LLM's draft argument ("self", a folder, a named model), None for free methods

    @property
    def label(self) -> str:
        if self.draft is None:
            return self.method
        if self.draft == "self":
            return "self"
        return f"{self.method}:{Path(self.draft).name or self.draft}"


@dataclass(frozen=True)
class SelectConfig:
    target: str | None = None  # a folder, .gguf, named model or Hub id; None = the bundled target
    drafts: tuple[str, ...] = ()  # candidate draft models / EAGLE-3 heads besides the automatic ones
    methods: tuple[str, ...] = ()  # only these methods (suffix, ngram, draft, eagle3, self); () = all
    ks: tuple[int, ...] = (2, 3, 4, 5)  # the k grid
    prompts: Path | None = None  # the user's prompts (see `read_user_prompts`); None = `workload`
    workload: str = "code"  # built-in workload (WORKLOADS)
    num_prompts: int = 4
    max_tokens: int = 64  # new tokens per prompt
    temperature: float = 0.0
    repeats: int = 3  # paired end-to-end repeats per candidate
    iters: int = 3  # timed repetitions of each step-cost measurement
    out: Path = Path("quickdraft-select.json")
    plot: Path | None = None  # PNG; needs matplotlib
    dtype: str | None = None
    device: str | None = None
    command: str = ""

    def __post_init__(self) -> None:
        from ..config import check_num_speculative_tokens

        if not self.ks or any(a >= b for a, b in zip(self.ks, self.ks[1:])):
            raise QuickdraftError("--ks must be increasing speculation lengths")
        for k in self.ks:
            check_num_speculative_tokens(k)
        if self.prompts is None and self.workload not in WORKLOADS:
            raise QuickdraftError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if min(self.num_prompts, self.max_tokens - 1, self.repeats, self.iters) < 1:
            raise QuickdraftError("num prompts, repeats and iters must be >= 1, max tokens >= 2")
        unknown = set(self.methods) - {*FREE_METHODS, "draft", "eagle3", "self", "lookahead"}
        if unknown:
            raise QuickdraftError(f"select measures suffix, ngram, lookahead, draft, eagle3 and self; "
                                  f"unknown: {', '.join(sorted(unknown))}")


@dataclass
class SelectResult:
    rows: list[dict[str, Any]]  # one per (candidate, k), ranked by credible speedup (fastest first)
    plain_tokens_per_s: float  # plain decoding's median over every candidate's paired runs
    choice: Any  # policy.costs.Choice
    profile: Any  # policy.costs.Profile (written to config.out)
    skipped: dict[str, str] = field(default_factory=dict)  # candidate label -> why it was not measured


# ---- prompts --------------------------------------------------------------------------------

def read_user_prompts(path: Path) -> list:
    """A prompts file: `.jsonl`, one {"prompt": text or token ids} or {"messages": [{"role",
    "content"}, ...]} per line (chat, rendered with the model's template); any other name, plain
    text, one prompt per line."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise QuickdraftError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    if not lines:
        raise QuickdraftError(f"{path}: no prompts")
    if Path(path).suffix.lower() != ".jsonl":
        return lines  # plain text, one prompt per line
    out: list = []
    for n, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise QuickdraftError(f"{path}:{n}: not a JSON object (a JSONL prompts file has one per line)") from None
        if isinstance(obj, dict) and "messages" in obj:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs):
                raise QuickdraftError(f"{path}:{n}: \"messages\" must be a list of {{\"role\", \"content\"}} strings")
            out.append(msgs)
            continue
        p = obj.get("prompt") if isinstance(obj, dict) else None
        if not (isinstance(p, str) and p) and not (isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p)):
            raise QuickdraftError(f"{path}:{n}: expected {{\"prompt\": text or token ids}} or {{\"messages\": [...]}}")
        out.append(p)
    return out


def workload_prompts(name: str, n: int) -> list:
    """A built-in workload: code / editing (raw text, for base code models like the bundled one);
    chat / code-chat / editing-chat (conversations, for instruction-tuned models)."""
    from ..train.corpus import load_corpus
    from . import workloads

    if name == "chat":
        return workloads.chat_requests(n)
    if name == "code-chat":
        return workloads.code_requests(n)
    docs = load_corpus(None).heldout
    if name == "code":
        return workloads.code_completion(docs, n)
    if name == "editing":
        return [e.text for e in workloads.editing(docs, n, excerpt_chars=400)]
    return [e.messages for e in workloads.editing_requests(docs, n)]


def encode_prompts(tokenizer, prompts: list) -> list[list[int]]:
    encoded = []
    for p in prompts:
        if isinstance(p, list) and p and isinstance(p[0], dict):
            encoded.append(tokenizer.encode_chat([dict(m) for m in p]))
        elif isinstance(p, str):
            encoded.append(tokenizer.encode(p))
        else:
            encoded.append(list(p))
    return encoded


# ---- candidates -----------------------------------------------------------------------------

def candidates(config: SelectConfig, target_dir: Path, automatic_draft: str | None) -> tuple[list[Candidate], dict]:
    """Every candidate to measure (see the module doc), and the ones left out with the reason."""
    from ..model.eagle3 import is_eagle3_head
    from ..model.gguf import four_bit_type, gguf_source
    from ..model.sources import resolve_model

    wanted = set(config.methods) or {*FREE_METHODS, "draft", "eagle3", "self"}
    out = [Candidate(m) for m in (*FREE_METHODS, "lookahead") if m in wanted]
    skipped: dict[str, str] = {}
    if "self" in wanted:
        source = gguf_source(target_dir)
        kind = four_bit_type(source) if source is not None else None
        if kind is None:
            out.append(Candidate("draft", "self"))
        else:
            skipped["self"] = f"the target is stored in 4 bits ({kind}): a self-draft cannot pay"
    for d in ([automatic_draft] if automatic_draft else []) + list(config.drafts):
        if d == "self":
            continue
        method = "eagle3" if is_eagle3_head(resolve_model(d)) else "draft"
        c = Candidate(method, str(d))
        if method in wanted and c not in out:
            out.append(c)
    if not out:
        raise QuickdraftError("nothing to measure: no method left (--method) or no draft for 'draft' / 'eagle3'")
    return out, skipped


# ---- measuring ------------------------------------------------------------------------------

def credible(row: dict[str, Any]) -> float:
    """A row's measured speedup, at most its tokens per step: every step costs at least a plain
    step (a verify forward is never cheaper than a one-token one, proposing is never free), so a
    speedup above the tokens per step is the machine's noise (on a loaded machine, select measured
    n-gram lookup at 2.14x while it emitted 1.62 tokens per step; measured again, 1.52x)."""
    return min(row["speedup"], row["tokens_per_step"])


def _eligible(row: dict[str, Any]) -> bool:
    """Beat plain decoding and actually speculated (a run of one token per step does plain
    decoding's work and more: a speedup it shows is the machine's noise)."""
    return credible(row) > 1.0 and row["tokens_per_step"] > 1.0 + 1e-9


def _score(row: dict[str, Any]) -> float:
    """A row's credible speedup; after a runoff, the mean of its two measurements'."""
    again = row.get("runoff")
    return credible(row) if again is None else (credible(row) + credible(again)) / 2


def choose(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest eligible row (by its credible speedup, pooled with a runoff's where it had
    one, each measurement eligible); None: plain decoding is the choice."""
    eligible = [r for r in rows if _eligible(r) and (r.get("runoff") is None or _eligible(r["runoff"]))]
    return max(eligible, key=_score, default=None)


def contenders(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eligible rows within RUNOFF of the fastest (at most RUNOFF_MOST, fastest first), which a
    runoff measures again; none where one row stands alone."""
    eligible = sorted((r for r in rows if _eligible(r)), key=lambda r: -credible(r))
    top = [r for r in eligible if credible(r) >= (1 - RUNOFF) * credible(eligible[0])][:RUNOFF_MOST] \
        if eligible else []
    return top if len(top) > 1 else []

def select(config: SelectConfig, progress: Callable[[str, float], None] | None = None) -> SelectResult:
    """Measure every candidate (module doc), write config.out (and config.plot)."""
    import statistics

    import torch

    from ..llm import named_default_draft, default_model_dirs
    from ..model.loader import checkpoint_dir, resolve_device
    from ..model.sources import BUNDLED_TARGET, resolve_model
    from ..model.tokenizer import Tokenizer
    from ..policy.costs import Choice, MethodProfile, Profile, solve_alpha
    from .compare import run_bench
    from .hardware import device_name
    from .tune import check_plot, now, write_profile

    check_plot(config.plot)
    if config.target is None or config.target == BUNDLED_TARGET:
        target_path, bundled_draft = default_model_dirs()
        automatic = str(bundled_draft) if bundled_draft.exists() else None
        target_name = str(target_path)
    else:
        target_path = resolve_model(config.target)
        named = named_default_draft(config.target)
        automatic = str(named) if named is not None else None
        target_name = str(config.target)
    target_dir = checkpoint_dir(target_path)
    tokenizer = Tokenizer.from_dir(target_dir)
    raw = read_user_prompts(config.prompts) if config.prompts is not None else \
        workload_prompts(config.workload, config.num_prompts)
    if tokenizer is None and any(not (isinstance(p, list) and p and isinstance(p[0], int)) for p in raw):
        raise QuickdraftError("the target has no tokenizer.json: give prompts as token ids")
    encoded = encode_prompts(tokenizer, raw)
    cands, skipped = candidates(config, target_dir, automatic)
    ks = list(config.ks)

    rows: list[dict[str, Any]] = []
    results: dict[Candidate, dict] = {}
    for i, cand in enumerate(cands):
        if progress:
            progress(cand.label, i / len(cands))
        gc.collect()
        try:
            res = run_bench(config.target, cand.draft, [cand.method], {}, [1], ks, [config.temperature], encoded,
                            config.max_tokens, config.repeats, config.iters, dtype=config.dtype,
                            device=config.device)
        except QuickdraftError as exc:  # a candidate that cannot run here is reported, not fatal
            skipped[cand.label] = str(exc)
            continue
        results[cand] = res
        for r in res["runs"]:
            rows.append({"candidate": cand.label, "method": cand.method, "draft": cand.draft, "k": r["k"],
                         "tokens_per_s": r["tokens_per_s"], "plain_tokens_per_s": r["plain_tokens_per_s"],
                         "speedup": r["speedup"], "acceptance_rate": r["acceptance_rate"],
                         "tokens_per_step": r["tokens_per_step"], "c": r["c"], "verify_ratio": r["verify_ratio"],
                         "accepted_per_pos": r["accepted_per_pos"], "draft_rate": r["draft_rate"]})
    if not results:
        raise QuickdraftError("no candidate could be measured: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    rows.sort(key=lambda r: -credible(r))
    top = contenders(rows)
    by_draft: dict[str | None, list[dict[str, Any]]] = {}
    for r in top:  # (a free method's draft is None: one runoff per draft, side by side within it)
        by_draft.setdefault(r["draft"], []).append(r)
    for draft, group in by_draft.items():
        if progress:
            progress("runoff: " + ", ".join(f"{r['candidate']} k={r['k']}" for r in group), 1.0)
        gc.collect()
        again = run_bench(config.target, draft, sorted({r["method"] for r in group}), {}, [1],
                          sorted({r["k"] for r in group}), [config.temperature], encoded, config.max_tokens,
                          config.repeats, config.iters, dtype=config.dtype, device=config.device)
        for r in group:
            run = next(x for x in again["runs"] if x["method"] == r["method"] and x["k"] == r["k"])
            r["runoff"] = {key: run[key] for key in ("speedup", "tokens_per_step", "tokens_per_s")}
    plain_tps = statistics.median(r["plain_tokens_per_s"] for r in rows)
    workload = str(config.prompts) if config.prompts is not None else f"built-in {config.workload}"
    best = choose(rows)
    if best is not None:
        choice = Choice(best["method"], best["k"], best["draft"], {}, round(_score(best), 4), workload)
        cand = Candidate(best["method"], best["draft"])
    else:  # nothing beat plain decoding on this machine: plain decoding is the choice
        choice, cand = Choice("none", 0, None, {}, 1.0, workload), next(iter(results))
    res = results[cand]
    methods = {}
    if choice.method != "none":
        at_max = next(r for r in rows if r["candidate"] == cand.label and r["k"] == ks[-1])
        per_pos = (list(at_max["accepted_per_pos"]) + [0.0] * ks[-1])[:ks[-1]]
        for j in range(1, len(per_pos)):  # a run's later positions never exceed earlier ones
            per_pos[j] = min(per_pos[j], per_pos[j - 1])
        methods[choice.method] = MethodProfile({}, ks, res["propose_s"][choice.method], per_pos,
                                               solve_alpha(1.0 + sum(per_pos), ks[-1]), at_max["draft_rate"])
    device = resolve_device(config.device)
    profile = Profile(device.type, device_name(device), torch.__version__, target_name, res["target_dtype"], 128,
                      res["batch_sizes"], res["query_lengths"], res["target_step_s"], methods,
                      created=now(), command=config.command, threads=torch.get_num_threads(), choice=choice)
    # the measured table rides along
    write_profile(profile, config.out, device,
                  select={"rows": rows, "skipped": skipped, "plain_tokens_per_s": plain_tps})
    result = SelectResult(rows, plain_tps, choice, profile, skipped)
    if config.plot is not None:
        plot_select(result, config.plot)
    return result


# ---- reporting ------------------------------------------------------------------------------

def ranked_table(result: SelectResult):
    """A rich Table: every (candidate, k), fastest first, the choice marked, plain decoding's row."""
    from rich.table import Table

    table = Table(title="quickdraft select: measured end to end, paired with plain decoding",
                  caption=f"plain decoding: {result.plain_tokens_per_s:.1f} tok/s (median of the paired runs); "
                          "c = T_propose(k) / (k T(1))")
    runoff = any("runoff" in r for r in result.rows)  # a column for the contenders' second measurement
    for name, justify in (("", "left"), ("#", "right"), ("method", "left"), ("k", "right"), ("tok/s", "right"),
                          ("speedup", "right")) + ((("again", "right"),) if runoff else ()) + (
                          ("acceptance", "right"), ("tokens/step", "right"), ("c", "right"), ("T(k+1)/T(1)", "right")):
        table.add_column(name, justify=justify)
    ch = result.choice
    for i, r in enumerate(result.rows, 1):
        chosen = ch.method == r["method"] and ch.draft == r["draft"] and ch.k == r["k"]
        style = "bold green" if chosen else ("dim" if r["speedup"] <= 1.0 else None)
        again = ([f"{r['runoff']['speedup']:.2f}x" if "runoff" in r else ""] if runoff else [])
        table.add_row("→" if chosen else "", str(i), r["candidate"], str(r["k"]), f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup']:.2f}x", *again, f"{r['acceptance_rate']:.2f}", f"{r['tokens_per_step']:.2f}",
                      f"{r['c']:.3f}", f"{r['verify_ratio']:.2f}", style=style)
    table.add_row("→" if ch.method == "none" else "", "", "plain decoding", "0", f"{result.plain_tokens_per_s:.1f}",
                  "1.00x", *([""] if runoff else []), "", "1.00", "", "1.00",
                  style="bold green" if ch.method == "none" else None)
    return table


def plot_select(result: SelectResult, path: Path) -> None:
    """PNG: measured speedup over plain decoding vs k, one line per candidate, the choice ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label in dict.fromkeys(r["candidate"] for r in result.rows):
        pts = sorted((r["k"], r["speedup"]) for r in result.rows if r["candidate"] == label)
        ax.plot([k for k, _ in pts], [s for _, s in pts], marker="o", label=label)
    ch = result.choice
    if ch.method != "none":
        ax.plot([ch.k], [ch.speedup], marker="o", markersize=14, fillstyle="none", color="black",
                label=f"choice: {Candidate(ch.method, ch.draft).label} k={ch.k}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="plain decoding")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set(xlabel="k (draft tokens per step)", ylabel="speedup over plain decoding (paired)",
           title=f"quickdraft select · {result.profile.cpu_or_gpu_name} · {result.profile.dtype}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
