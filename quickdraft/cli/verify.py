"""`quickdraft verify`: check statistically, on the user's own models and settings, that
speculative decoding keeps the target's distribution (the check is quickdraft.bench.lossless)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from . import common as opts
from .common import out, parse_ids, parse_spec_options, user_errors


@user_errors
def verify_command(
    target: Optional[str] = opts.TARGET,
    draft: Optional[str] = opts.DRAFT,
    method: str = typer.Option("draft", "--method", help="draft | eagle3 | ngram | suffix | lookahead."),
    k: int = opts.NUM_SPECULATIVE_TOKENS,
    spec_option: Optional[list[str]] = opts.SPEC_OPTION,
    temperature: float = opts.TEMPERATURE,
    top_p: float = opts.TOP_P,
    top_k: int = opts.TOP_K,
    min_p: float = opts.MIN_P,
    presence_penalty: float = opts.PRESENCE_PENALTY,
    frequency_penalty: float = opts.FREQUENCY_PENALTY,
    repetition_penalty: float = opts.REPETITION_PENALTY,
    samples: int = typer.Option(4000, "--samples", help="Continuations per prompt, with and without speculation."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="Prompt (repeatable; default: code prompts)."),
    ids: bool = typer.Option(False, "--ids", help="Each --prompt is token ids separated by spaces or commas."),
    seed: int = typer.Option(0, "--seed", help="Request i uses seed SEED * 2**32 + i."),
    max_num_seqs: int = opts.max_num_seqs_option(256, "the check decodes thousands of samples"),
    top: int = typer.Option(20, "--top", help="Chi-square bins: the TOP likeliest tokens plus 'other'."),
    alpha: float = typer.Option(1e-3, "--alpha", help="Significance level (Bonferroni-corrected over the tests)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16 (default float32 here: "
                              "the greedy check compares tokens one for one)."),
    device: Optional[str] = opts.DEVICE,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with every number."),
    threads: Optional[int] = opts.THREADS,
) -> None:
    """Check statistically that speculative decoding keeps the target's distribution (exit 1 on FAIL)."""
    from rich.markup import escape

    from ..bench.lossless import report_lines, verify_lossless
    from ..llm import default_model_dirs
    from ..sampling import SamplingParams

    opts.apply_threads(threads)
    if target is None and draft is None:
        target, draft = default_model_dirs()

    options = parse_spec_options(spec_option)
    prompts = None
    if prompt:
        if ids:
            prompts = [parse_ids(p, "--ids (each --prompt)") for p in prompt]
        else:
            prompts = list(prompt)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            repetition_penalty=repetition_penalty)
    r = verify_lossless(target, draft=draft, method=method, k=k, spec_options=options, params=params,
                        prompts=prompts, samples=samples, seed=seed, batch=max_num_seqs, top=top, alpha=alpha, dtype=dtype,
                        device=device)
    if as_json:
        print(json.dumps(r))
    else:
        c = r["config"]
        out.print(f"[dim]quickdraft verify: method {escape(c['method'])}, k={c['k']}, T={c['temperature']:g}, "
                  f"top-p={c['top_p']:g}, top-k={c['top_k']}, min-p={c['min_p']:g}, {c['samples']} samples x "
                  f"{len(r['prompts'])} prompts, {c['dtype']} on {c['device']}, alpha={c['alpha']:g} "
                  f"(per test {r['distribution']['alpha_corrected']:.2g})[/]")
        colors = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow", "WARN": "yellow"}
        for status, text in report_lines(r):
            out.print(f"[{colors[status]}]{status}[/] {escape(text)}")
        s = r["stats"]
        out.print(f"[dim]acceptance rate {s['acceptance_rate']:.2f}, "
                  f"{s['num_draft_tokens']} draft tokens, {r['elapsed_s']:.1f} s[/]")
        out.print("[bold green]PASS[/]: speculative decoding is lossless on these checks" if r["passed"] else
                  "[bold red]FAIL[/]: see the FAIL lines above")
    if not r["passed"]:
        raise typer.Exit(1)
