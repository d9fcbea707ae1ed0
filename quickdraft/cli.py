"""The `quickdraft` command line (typer + rich).

Every user error (missing folder, unreadable config, vocabulary mismatch, bad
parameter) is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from . import cli_options as opts
from .errors import QuickdraftError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="quickdraft: lossless speculative decoding for Llama-family models.")
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
    raise typer.Exit(2)


def _parse_ids(prompt: str) -> list[int]:
    try:
        return [int(t) for t in prompt.replace(",", " ").split()]
    except ValueError:
        fail("--ids expects PROMPT to be token ids separated by spaces or commas")


def parse_spec_options(items: list[str] | None, tree_width: int | None = None) -> dict:
    """KEY=VALUE strings -> proposer options; values parsed as int, float, bool or str."""
    options: dict = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            fail(f"--spec-option expects KEY=VALUE, got {item!r}")
        low = raw.strip().lower()
        if low in ("true", "false"):
            value = low == "true"
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        options[key.strip()] = value
    if tree_width is not None:
        options["tree_width"] = tree_width
    return options


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Prompt text (or token ids with --ids)."),
    target: Optional[Path] = typer.Option(None, "--target", help="Target model folder (default: bundled model)."),
    draft: Optional[Path] = typer.Option(None, "--draft", help="Draft model folder."),
    method: Optional[str] = typer.Option(
        None, "--method", help="none | draft | ngram | suffix | lookahead (default: draft if a draft is given)."),
    k: int = typer.Option(5, "-k", "--num-speculative-tokens", help="Draft tokens per step (tree depth)."),
    tree_width: Optional[int] = typer.Option(None, "--tree-width",
                                             help="Draft model: candidates per depth (>1 = token tree)."),
    spec_option: Optional[list[str]] = typer.Option(
        None, "--spec-option", "-o", help="Proposer option KEY=VALUE (repeatable), e.g. -o max_ngram=4."),
    policy: str = typer.Option("fixed", "--policy", help="Speculation length: fixed | acceptance | goodput."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Cost profile from `quickdraft tune` (goodput)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    min_p: float = typer.Option(0.0, "--min-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    ids: bool = typer.Option(False, "--ids", help="PROMPT is a list of token ids."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: text, token_ids, stats."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda | mps (default: best available)."),
    compare: bool = typer.Option(False, "--compare",
                                 help="Also decode without speculation and report the speedup."),
    compile: Optional[bool] = opts.COMPILE,
    quantization: Optional[str] = opts.QUANTIZATION,
    draft_quantization: Optional[str] = opts.DRAFT_QUANTIZATION,
    draft_dtype: Optional[str] = opts.DRAFT_DTYPE,
) -> None:
    """Generate a continuation of PROMPT, streaming text as it is accepted."""
    from .llm import LLM
    from .sampling import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                            max_tokens=max_tokens, stop=tuple(stop or ()), ignore_eos=ignore_eos)
    options = parse_spec_options(spec_option, tree_width)
    llm = LLM(target=target, draft=draft, method=method, num_speculative_tokens=k, dtype=dtype, device=device,
              spec_options=options, policy=policy, profile=profile, compile=compile, quantization=quantization,
              draft_quantization=draft_quantization, draft_dtype=draft_dtype)
    if chat and ids:
        fail("--chat and --ids cannot be combined")
    prompt_in = _parse_ids(prompt) if ids else prompt
    plain = None
    if compare:
        if llm.engine.proposer is None:
            fail("--compare needs speculative decoding: give a draft or a --method (or use the bundled pair)")
        plain = LLM(target=target, method="none", dtype=dtype, device=device)
        warm = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, seed=0)
        for m in (llm, plain):  # first calls pay one-time costs: keep them out of the comparison
            m.generate([m.encode(prompt_in, chat=chat)], warm)
        llm.stats = type(llm.stats)()
    final = None
    for o in llm.stream(prompt_in, params, chat=chat):
        if not as_json and o.new_text:
            out.print(o.new_text, end="", markup=False)
        final = o
    s = llm.stats
    comparison = None
    if plain is not None:
        base = plain.generate([final.prompt_token_ids], params)[0]
        p = plain.stats
        comparison = {"plain_tokens_per_second": p.tokens_per_second,
                      "speedup": s.tokens_per_second / p.tokens_per_second if p.tokens_per_second else None,
                      "identical": base.token_ids == final.token_ids if temperature == 0 else None}
    if as_json:
        print(json.dumps({"text": final.text, "token_ids": final.token_ids, "finish_reason": final.finish_reason,
                          "prompt_tokens": len(final.prompt_token_ids), "stats": s.to_dict(),
                          **({"compare": comparison} if comparison else {})}))
        return
    out.print()
    err.print(f"[dim]{s.num_output_tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
              f"acceptance rate {s.acceptance_rate:.2f}, mean acceptance length {s.mean_acceptance_length:.2f}, "
              f"finish: {final.finish_reason}[/]")
    if comparison:
        same = "" if comparison["identical"] is None else \
            f"; output identical to plain decoding: {'yes' if comparison['identical'] else 'NO'}"
        err.print(f"[bold]speedup over plain decoding: {comparison['speedup']:.2f}x[/] "
                  f"(plain {comparison['plain_tokens_per_second']:.1f} tok/s{same})")


from .train import distill_command, train_command  # noqa: E402

app.command("train")(train_command)
app.command("distill")(distill_command)

from .bench.bench_cmd import bench_command  # noqa: E402
from .bench.tune_cmd import tune_command  # noqa: E402
from .bench.verify_cmd import verify_command  # noqa: E402

app.command("verify")(verify_command)
app.command("tune")(tune_command)
app.command("bench")(bench_command)

from .server.bench_serve import bench_serve_command  # noqa: E402
from .server.serve import serve_command  # noqa: E402

app.command("serve")(serve_command)
app.command("bench-serve")(bench_serve_command)


@app.callback()
def _root() -> None:
    """quickdraft: lossless speculative decoding for Llama-family models."""


def main() -> None:
    try:
        app()  # typer reports usage errors itself (exit code 2)
    except QuickdraftError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", markup=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
