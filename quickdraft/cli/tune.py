"""`quickdraft tune`: measure this hardware's costs and pick k per batch size
(the measuring is quickdraft.bench.tune)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..config import check_num_speculative_tokens
from . import common as opts
from .common import command_line, parse_ints, parse_spec_options, user_errors
from .common import out as stdout


@user_errors
def tune_command(
    target: Optional[str] = opts.TARGET,
    draft: Optional[str] = opts.DRAFT,
    method: Optional[list[str]] = opts.METHODS,
    max_k: int = typer.Option(8, "--max-k", help="Longest speculation measured: k = 1 to MAX_K.",
                              callback=opts.checked(check_num_speculative_tokens, "--max-k")),
    spec_option: Optional[list[str]] = opts.SPEC_OPTION,
    batch_sizes: str = typer.Option("1,2,4,8,16,32", "--batch-sizes", help="Comma-separated batch sizes."),
    context: int = typer.Option(256, "--context", help="Tokens cached per row while timing."),
    prompts: Optional[Path] = opts.PROMPTS_FILE,
    num_prompts: int = typer.Option(8, "--num-prompts", help="Built-in workload: number of prompts."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="New tokens per prompt in the acceptance run."),
    temperature: float = opts.TEMPERATURE,
    iters: int = opts.iters_option(10),
    out: Path = opts.profile_out_option("quickdraft-profile.json"),
    plot: Optional[Path] = opts.PLOT,
    dtype: Optional[str] = opts.DTYPE,
    device: Optional[str] = opts.DEVICE,
    threads: Optional[int] = opts.THREADS,
) -> None:
    """Measure this hardware's costs and pick the speculation length k per batch size."""
    from ..bench.tune import TuneConfig, summary_table, tune

    opts.apply_threads(threads)
    config = TuneConfig(target=target, draft=draft, methods=tuple(method or ()), k_max=max_k,
                        spec_options=parse_spec_options(spec_option),
                        batch_sizes=parse_ints(batch_sizes, "--batch-sizes"),
                        context=context, prompts=prompts, num_prompts=num_prompts, max_tokens=max_tokens,
                        temperature=temperature, iters=iters, out=out, plot=plot, dtype=dtype, device=device,
                        command=command_line())
    profile = tune(config)
    stdout.print(summary_table(profile))
    for name, m in profile.methods.items():
        stdout.print(f"{name}: acceptance per position " + " ".join(f"{a:.2f}" for a in m.acceptance_per_pos)
                     + f" (i.i.d. alpha {m.alpha:.3f}, drafted in {100 * m.draft_rate:.0f}% of steps)")
    stdout.print(opts.written(config.out, config.plot))
