"""What `quickdraft tune` runs: measure this hardware's costs and pick k per batch size.

For each method: the acceptance per draft position on a workload (speculating k_max tokens),
and the proposer's time per propose() for every batch size and k; then the target's step
time T(B, q) for every batch size and query length. The cost model (`quickdraft.policy.costs`) turns these
into predicted goodput and the best k per batch size, written as a JSON profile (and,
with --plot, a PNG: predicted speedup vs k per batch size, and T(B, q) / T(B, 1)).
"""

from __future__ import annotations

import datetime
import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import QuickdraftError


@dataclass(frozen=True)
class TuneConfig:
    target: Path | None = None  # target folder; None = the bundled target (and draft)
    draft: Path | None = None  # draft folder, for methods that need a draft model
    methods: tuple[str, ...] = ()  # proposers to profile; () = draft if a draft is available, else ngram
    k_max: int = 8  # longest speculation measured: ks are 1..k_max
    spec_options: dict[str, Any] = field(default_factory=dict)  # passed to every method's proposer
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    context: int = 256  # tokens cached per row while timing (a typical mid-generation length)
    prompts: Path | None = None  # JSONL of {"prompt": text or token ids}; None = built-in code workload
    num_prompts: int = 8  # built-in workload size
    max_tokens: int = 128  # new tokens per prompt in the acceptance run
    temperature: float = 0.0  # sampling temperature of the acceptance run and of proposing
    iters: int = 10  # timed repetitions per measurement (medians)
    out: Path = Path("quickdraft-profile.json")
    plot: Path | None = None  # PNG; needs matplotlib
    dtype: str | None = None
    device: str | None = None
    command: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.k_max <= 64:
            raise QuickdraftError(f"k max must be between 1 and 64, got {self.k_max}")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise QuickdraftError("batch sizes must be positive integers")
        if self.context < 1 or self.iters < 1 or self.num_prompts < 1 or self.max_tokens < 1:
            raise QuickdraftError("context, iters, num prompts and max tokens must be >= 1")
        if len(set(self.methods)) != len(self.methods):
            raise QuickdraftError("a method is listed twice")
        if "none" in self.methods:
            raise QuickdraftError("method 'none' is plain decoding, which tune always measures (k = 0)")


def tune(config: TuneConfig, console=None):
    """Measure, write config.out (and config.plot); returns the Profile."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..llm import LLM, default_model_dirs
    from .. import proposers
    from ..sampling import SamplingParams
    from .hardware import device_name
    from ..policy.costs import Profile
    from .measure import measure_acceptance, measure_propose, measure_target_steps
    from .workloads import read_prompts

    console = console or Console(stderr=True, highlight=False)
    check_plot(config.plot)
    draft = config.draft if config.draft is not None or config.target is not None else default_model_dirs()[1]
    methods = list(config.methods) or ["draft" if draft is not None else "ngram"]
    for m in methods:
        if proposers.get(m) is None:
            raise QuickdraftError("method 'none' is plain decoding, which tune always measures (k = 0)")
    ks = list(range(1, config.k_max + 1))
    bs = list(config.batch_sizes)
    params = SamplingParams(temperature=config.temperature, max_tokens=config.max_tokens, ignore_eos=True, seed=0)
    raw_prompts = read_prompts(config.prompts) if config.prompts is not None else None

    per_b = len(bs) * len(ks)
    bar = Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=False)
    results: dict[str, dict] = {}
    with bar:
        task = bar.add_task("loading", total=len(methods) * (1 + per_b) + len(bs) * (config.k_max + 1))

        def tick(share: float = 1.0) -> None:
            bar.advance(task, share)

        llm = workload = None
        for method in methods:
            bar.update(task, description=f"{method}: loading")
            llm = None
            gc.collect()
            needs_draft = proposers.get(method).needs_draft_model
            llm = LLM(config.target, draft=draft if needs_draft else None, method=method,
                      num_speculative_tokens=config.k_max, dtype=config.dtype, device=config.device,
                      spec_options=config.spec_options, policy="fixed")  # acceptance at k_max
            llm.wait_for_aot()  # a fresh cache's background AOT build: time the steps it switches to
            proposer = llm.engine.proposer
            longest = config.context + 1 + proposer.max_draft_tokens(config.k_max)
            if longest > llm.target.config.max_position_embeddings:
                raise QuickdraftError(f"--context {config.context} + {longest - config.context} query tokens exceeds "
                                      f"the target's context length ({llm.target.config.max_position_embeddings})")
            if workload is None:  # one target for every method: encode once
                workload = raw_prompts if raw_prompts is not None else _builtin_prompts(llm, config.num_prompts)
            bar.update(task, description=f"{method}: acceptance")
            acc = measure_acceptance(llm, workload, config.k_max, params)
            tick()
            stream = [t for o in acc.outputs for t in o.prompt_token_ids + o.token_ids]
            bar.update(task, description=f"{method}: propose times")
            propose_s = measure_propose(llm, bs, ks, config.context, config.iters, temperature=config.temperature,
                                        tokens=stream, progress=tick)
            results[method] = {"options": dict(config.spec_options), "ks": ks, "propose_s": propose_s,
                               "acceptance_per_pos": acc.per_pos, "alpha": acc.alpha,
                               "draft_rate": acc.draft_rate,
                               "verify_q": [1 + proposer.max_draft_tokens(k) for k in ks]}
        target = llm.target
        qs = sorted(set(range(1, config.k_max + 2)).union(*(r["verify_q"] for r in results.values())))
        bar.update(task, total=len(methods) * (1 + per_b) + len(bs) * len(qs), description="target step times")
        steps = measure_target_steps(target, bs, qs, config.context, config.iters, progress=tick)
        bar.update(task, description="done")

    data = {"version": 1, "device": target.device.type, "cpu_or_gpu_name": device_name(target.device),
            "torch": torch.__version__, "target": str(config.target or default_model_dirs()[0]),
            "dtype": str(target.dtype).removeprefix("torch."), "context": config.context,
            "batch_sizes": bs, "query_lengths": qs, "target_step_s": steps, "methods": results, "best_k": {},
            "created": now(), "command": config.command, "threads": torch.get_num_threads()}
    profile = Profile.from_dict(data)
    write_profile(profile, config.out, target.device)
    if config.plot is not None:
        plot_profile(profile, config.plot)
    return profile


# ---- shared with `quickdraft select` (bench/select.py), which writes a profile too -------------

def check_plot(plot: Path | None) -> None:
    """Before measuring: a --plot needs matplotlib (a clear error now, not after the run)."""
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise QuickdraftError("--plot needs matplotlib: pip install matplotlib") from None


def now() -> str:
    """A profile's `created` stamp (UTC, seconds)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_profile(profile, out: Path, device, **extra) -> None:
    """Fill in the best k per batch size and write `profile` to `out`, with the provenance
    record of `device` and the `extra` keys riding along (load_profile ignores keys it does not
    know)."""
    from ..policy.costs import save_profile
    from .hardware import provenance

    profile.best_k_by_batch = profile.best_k_table()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(out, {**profile.to_dict(), **extra, "provenance": provenance(device)})


def _builtin_prompts(llm, n: int) -> list[list[int]]:
    from ..train.corpus import load_corpus
    from .workloads import code_completion

    if llm.tokenizer is None:
        raise QuickdraftError("the built-in workload needs the target's tokenizer; pass --prompts FILE.jsonl "
                              "with token ids")
    return [llm.encode(t) for t in code_completion(load_corpus(None).heldout, n)]


def summary_table(profile):
    """A rich Table: per batch size, plain decoding's predicted tok/s and, per method, the
    best k and its predicted speedup over plain decoding."""
    from rich.table import Table

    table = Table(title=f"best k per batch size ({profile.cpu_or_gpu_name}, {profile.dtype})",
                  caption="speedup: predicted goodput at the best k / plain decoding's")
    table.add_column("batch", justify="right")
    table.add_column("plain tok/s", justify="right")
    for name in profile.methods:
        table.add_column(f"{name}\nk  speedup", justify="right")
    for b in profile.batch_sizes:
        plain = profile.goodput(next(iter(profile.methods)), b, 0)
        cells = [str(b), f"{plain:.1f}"]
        for name in profile.methods:
            k = profile.best_k(name, b)
            cells.append(f"{k}  {profile.goodput(name, b, k) / plain:.2f}x")
        table.add_row(*cells)
    return table


def plot_profile(profile, path: Path) -> None:
    """PNG: per method, predicted goodput over plain decoding vs k, one line per batch size
    (the best k marked); and the target's T(B, q) / T(B, 1) vs q."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(profile.methods)
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(5.2 * (len(names) + 1), 4.2), squeeze=False)
    colors = plt.cm.viridis([i / max(1, len(profile.batch_sizes) - 1) for i in range(len(profile.batch_sizes))])
    for ax, name in zip(axes[0], names):
        ks = [0] + profile.methods[name].ks
        for b, c in zip(profile.batch_sizes, colors):
            plain = profile.goodput(name, b, 0)
            ys = [profile.goodput(name, b, k) / plain for k in ks]
            ax.plot(ks, ys, marker=".", color=c, label=f"B={b}")
            best = profile.best_k(name, b)
            ax.plot([best], [ys[ks.index(best)]], marker="o", markersize=9, fillstyle="none", color=c)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(title=f"{name}: predicted goodput / plain", xlabel="k (draft tokens per step)",
               ylabel="speedup over plain decoding")
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    for i, (b, c) in enumerate(zip(profile.batch_sizes, colors)):
        row = profile.target_step_s[i]
        ax.plot(profile.query_lengths, [t / row[0] for t in row], marker=".", color=c, label=f"B={b}")
    ax.set(title=f"target step time, context {profile.context}", xlabel="q (query tokens per row)",
           ylabel="T(B, q) / T(B, 1)")
    ax.legend(fontsize=7)
    fig.suptitle(f"{profile.cpu_or_gpu_name} · {profile.dtype} · torch {profile.torch}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
