"""`quickdraft generate`: stream one continuation, with acceptance and (--compare) the
speedup over plain decoding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from . import common as opts
from .common import err, fail, out, parse_ids, parse_spec_options, user_errors


@user_errors
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text (or token ids with --ids); or --example."),
    example: Optional[str] = typer.Option(None, "--example", help="A built-in prompt instead of PROMPT: edit (rename "
                                          "an identifier in a short file: editing, chat template) | chat (an open "
                                          "question, chat template) | code (a function's first line, raw text)."),
    target: Optional[str] = opts.TARGET,
    draft: Optional[str] = opts.DRAFT,
    method: Optional[str] = opts.METHOD,
    k: Optional[int] = opts.PROFILED_NUM_SPECULATIVE_TOKENS,
    tree_width: Optional[int] = opts.TREE_WIDTH,
    spec_option: Optional[list[str]] = opts.SPEC_OPTION,
    policy: str = opts.POLICY,
    profile: Optional[Path] = opts.PROFILE,
    temperature: float = opts.TEMPERATURE,
    top_p: float = opts.TOP_P,
    top_k: int = opts.TOP_K,
    min_p: float = opts.MIN_P,
    presence_penalty: float = opts.PRESENCE_PENALTY,
    frequency_penalty: float = opts.FREQUENCY_PENALTY,
    repetition_penalty: float = opts.REPETITION_PENALTY,
    seed: Optional[int] = typer.Option(None, "--seed"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="New tokens at most (default 128; "
                                             "an --example's own: 256 for edit and chat)."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    ids: bool = typer.Option(False, "--ids", help="PROMPT is a list of token ids."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: text, token_ids, stats."),
    dtype: Optional[str] = opts.DTYPE,
    device: Optional[str] = opts.DEVICE,
    compare: bool = typer.Option(False, "--compare",
                                 help="Also decode without speculation (the same target: weight format, compile, "
                                 "KV budget) and report the speedup."),
    compile: Optional[bool] = opts.COMPILE,
    aot: bool = opts.AOT,
    quantization: Optional[str] = opts.QUANTIZATION,
    draft_quantization: Optional[str] = opts.DRAFT_QUANTIZATION,
    draft_dtype: Optional[str] = opts.DRAFT_DTYPE,
    tensor_parallel_size: int = opts.TENSOR_PARALLEL_SIZE,
    tensor_parallel_timeout: float = opts.TENSOR_PARALLEL_TIMEOUT,
    threads: Optional[int] = opts.THREADS,
    kv_cache_memory: Optional[str] = opts.KV_CACHE_MEMORY,
    kv_cache_dtype: str = opts.KV_CACHE_DTYPE,
    json_schema: Optional[Path] = opts.JSON_SCHEMA,
    json_object: bool = opts.JSON_OBJECT,
    regex: Optional[str] = opts.REGEX,
    choice: Optional[list[str]] = opts.CHOICE,
    grammar: Optional[Path] = opts.GRAMMAR,
    constraint_compile_timeout: float = opts.CONSTRAINT_COMPILE_TIMEOUT,
) -> None:
    """Generate a continuation of PROMPT, streaming text as it is accepted."""
    from ..llm import LLM
    from ..sampling import SamplingParams

    opts.apply_threads(threads)
    if (prompt is None) == (example is None):
        fail("give a PROMPT or an --example, not both" if prompt is not None else "give a PROMPT (or --example NAME)")
    if example is not None:
        from ..bench.examples import example as get_example

        ex = get_example(example)
        if ids:
            fail("--example and --ids cannot be combined")
        prompt, chat = ex.prompt, ex.chat
        max_tokens = ex.max_tokens if max_tokens is None else max_tokens
        err.print(f"[dim]example {ex.name!r}: {ex.workload}[/]")
    max_tokens = 128 if max_tokens is None else max_tokens
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                            max_tokens=max_tokens, stop=tuple(stop or ()), ignore_eos=ignore_eos,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            repetition_penalty=repetition_penalty,
                            constraint=opts.constraint_flags(json_schema, json_object, regex, choice, grammar))
    options = parse_spec_options(spec_option, tree_width)
    tp = opts.tensor_parallel_args(tensor_parallel_size, tensor_parallel_timeout)
    # what the target runs as (--compare's plain decoding runs the same: same weights, same steps)
    target_args = dict(target=target, dtype=dtype, device=device, compile="aot" if aot else compile,
                       quantization=quantization, kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                       constraint_compile_timeout=constraint_compile_timeout, **tp)
    llm = LLM(draft=draft, method=method, num_speculative_tokens=k, spec_options=options, policy=policy,
              profile=profile, draft_quantization=draft_quantization, draft_dtype=draft_dtype, **target_args)
    if chat and ids:
        fail("--chat and --ids cannot be combined")
    prompt_in = parse_ids(prompt, "--ids (PROMPT)") if ids else prompt
    plain = None
    if compare:
        if llm.engine.proposer is None:
            fail("--compare needs speculative decoding: give a draft or a --method (or use the bundled pair)")
        plain = LLM(method="none", **target_args)
        # both timed on the same kind of steps: where both are still eager (a fresh cache), both
        # stay eager while the build goes on for later runs; where one already has its compiled
        # steps, the other waits for its own
        building = [m.aot_build is not None and not m.aot_build.done() for m in (llm, plain)]
        if all(building):
            steps = "eager"
            err.print("[dim]timing both on eager steps: the compiled steps (faster) are being built in the "
                      "background for the next runs[/]")
            llm.keep_current_steps()
            plain.keep_current_steps()
        else:
            if any(building):
                err.print("[dim]waiting for the compiled steps (built once per model shape) before comparing[/]")
            llm.wait_for_aot()
            plain.wait_for_aot()
            steps = "eager" if llm.engine.runs_eagerly() else "compiled"
        warm = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, seed=0)
        for m in (llm, plain):  # first calls pay one-time costs: keep them out of the comparison (both
            m.generate([m.encode(prompt_in, chat=chat)], warm)  # LLMs' figures: their timed runs alone)
            m.stats = type(m.stats)()
        llm.engine.proposer.forget_requests()  # (the warm-up's output of this prompt is no draft source)
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
        comparison = {"plain_tokens_per_second": p.tokens_per_second, "plain_tokens": p.num_output_tokens,
                      "plain_elapsed_s": p.elapsed_s, "steps": steps,
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
                  f"(plain {comparison['plain_tokens_per_second']:.1f} tok/s, {steps} steps{same})")
