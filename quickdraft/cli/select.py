"""`quickdraft select`: measure every method, draft and k on your own prompts, on this machine,
and write the profile that `generate --profile` and `serve --profile` run (the measuring is
quickdraft.bench.select)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import common as opts
from .common import command_line, parse_ints, user_errors
from .common import out as stdout


@user_errors
def select_command(
    target: Optional[str] = opts.TARGET,
    draft: Optional[list[str]] = typer.Option(None, "--draft", help="A candidate draft model or EAGLE-3 head, given "
                                              "like --target (repeatable); the target's own draft and a self-draft "
                                              "are candidates anyway."),
    method: Optional[list[str]] = typer.Option(None, "--method", help="Only these (repeatable): suffix | ngram | "
                                               "lookahead | draft | eagle3 | self (default: all but lookahead)."),
    ks: str = typer.Option("2,3,4,5", "--ks", help="Comma-separated speculation lengths k to measure."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Your prompts: one per line, or a .jsonl "
                                           "file of {\"prompt\": text or token ids} or {\"messages\": [...]} (chat)."),
    workload: str = typer.Option("code", "--workload", help="Built-in workload when no --prompts: code | editing "
                                 "(raw text) | chat | code-chat | editing-chat (chat template)."),
    num_prompts: int = typer.Option(4, "--num-prompts", help="Built-in workload: prompts."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="New tokens per prompt."),
    temperature: float = opts.TEMPERATURE,
    repeats: int = typer.Option(3, "--repeats", help="Paired end-to-end runs per candidate (medians)."),
    iters: int = opts.iters_option(3),
    out: Path = opts.profile_out_option("quickdraft-select.json"),
    plot: Optional[Path] = opts.PLOT,
    dtype: Optional[str] = opts.DTYPE,
    device: Optional[str] = opts.DEVICE,
    threads: Optional[int] = opts.THREADS,
) -> None:
    """Measure which speculation pays on your prompts here; write a profile for --profile."""
    from ..bench.select import SelectConfig, ranked_table, select

    opts.apply_threads(threads)
    config = SelectConfig(target=target, drafts=tuple(draft or ()), methods=tuple(method or ()),
                          ks=parse_ints(ks, "--ks"), prompts=prompts, workload=workload, num_prompts=num_prompts,
                          max_tokens=max_tokens, temperature=temperature, repeats=repeats, iters=iters, out=out,
                          plot=plot, dtype=dtype, device=device, command=command_line())
    with opts.err.status("measuring...") as status:
        result = select(config, progress=lambda label, share: status.update(
            f"measuring {label} ({100 * share:.0f}% of the candidates done)"))
    if not stdout.is_terminal:  # a pipe or a file: the whole table, not rich's 80 columns
        stdout.width = max(stdout.width, 120)
    stdout.print(ranked_table(result))
    for label, why in result.skipped.items():
        stdout.print(f"[dim]not measured: {label}: {why}[/]")
    c = result.choice
    pick = "plain decoding (no method measured faster here)" if c.method == "none" else \
        f"method {c.method}" + (f", draft {c.draft}" if c.draft else "") + f", k={c.k} ({c.speedup:.2f}x plain decoding)"
    stdout.print(f"choice: {pick}")
    stdout.print(opts.written(config.out, config.plot)
                 + f"; run it with: quickdraft generate --profile {config.out} ...")
