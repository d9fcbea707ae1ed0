"""What every command shares: the consoles, `fail`, option parsers, and one definition of
each shared flag with one help text, one default and one check (commands use these, never
their own copies). Defaults and checks are the library's own (config.py, sampling.py), so a
flag, `LLM(...)` / `SamplingParams(...)` and the server accept the same values and answer a
bad one with the same message.

Command modules import this module, never `quickdraft.cli` itself (which imports them).
"""

from __future__ import annotations

import functools
import json
import math
import shlex
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from ..config import (DEFAULT_CONSTRAINT_COMPILE_TIMEOUT, DEFAULT_KV_CACHE_MEMORY_CPU, DEFAULT_KV_CACHE_MEMORY_GPU,
                      AUTO_BATCHED_TOKENS, AUTO_BATCHED_TOKENS_GPU, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_NUM_SPECULATIVE_TOKENS,
                      DEFAULT_SELF_DRAFT_NUM_SPECULATIVE_TOKENS,
                      DEFAULT_POLICY, MAX_NUM_SPECULATIVE_TOKENS, check_constraint_compile_timeout,
                      DEFAULT_KV_CACHE_DTYPE, check_kv_cache_dtype, check_kv_cache_memory, check_max_num_batched_tokens,
                      check_max_num_seqs, check_num_speculative_tokens)
from ..errors import QuickdraftError
from ..sampling import MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_TEMPERATURE, SamplingParams, check_field

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str) -> None:
    """One red line on stderr and exit code 2 (a user error, never a traceback)."""
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
    raise typer.Exit(2)


def user_errors(command):
    """Wrap a command so a QuickdraftError from anywhere below it is `fail`'s one line."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except QuickdraftError as exc:
            fail(str(exc))
    return run


def command_line() -> str:
    """The command as the user typed it, for result files."""
    return shlex.join(["quickdraft", *sys.argv[1:]])


# ---- option parsers ---------------------------------------------------------------------

def parse_ids(text: str, flag: str = "--ids") -> list[int]:
    """Token ids separated by spaces or commas."""
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise QuickdraftError(f"{flag} expects token ids separated by spaces or commas") from None


def parse_spec_options(items: list[str] | None, tree_width: int | None = None) -> dict:
    """KEY=VALUE strings -> proposer options; values parsed as int, float, bool or str."""
    options: dict = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise QuickdraftError(f"--spec-option expects KEY=VALUE, got {item!r}")
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


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    """Sorted distinct integers from "1,2, 4" (commas or spaces); a clear error naming `flag`."""
    try:
        return tuple(sorted({int(t) for t in text.replace(",", " ").split()}))
    except ValueError:
        raise QuickdraftError(f"{flag} expects integers separated by commas, got {text!r}") from None


def parse_floats(text: str, flag: str) -> list[float]:
    """Sorted distinct numbers from "0, 0.8"."""
    try:
        return sorted({float(t) for t in text.replace(",", " ").split()})
    except ValueError:
        raise QuickdraftError(f"{flag} expects numbers separated by commas, got {text!r}") from None


def parse_values(text: str, name: str, integer: bool = False) -> list[float]:
    """'1,2, 4 inf' -> [1.0, 2.0, 4.0, inf] in the given order; every value > 0."""
    values = []
    for t in text.replace(",", " ").split():
        try:
            v = int(t) if integer else float(t)
        except ValueError:
            raise QuickdraftError(f"{name} expects {'integers' if integer else 'numbers'} separated by commas, "
                                  f"got {text!r}") from None
        if not v > 0 or (isinstance(v, float) and math.isnan(v)):
            raise QuickdraftError(f"{name} values must be > 0, got {t}")
        values.append(v)
    if not values:
        raise QuickdraftError(f"{name} is empty")
    return values


# ---- shared flags (one definition, one help text, one default, one check) -------------------

def checked(check, flag: str | None = None):
    """A flag's typer callback: the library's own check on the value as soon as it is parsed
    (before any model loads), its message as `fail`'s one line (prefixed with `flag` when the
    flag's name differs from the checked setting's)."""
    def callback(value):
        if value is not None:
            try:
                check(value)
            except QuickdraftError as exc:
                fail(f"{flag}: {exc}" if flag else str(exc))
        return value
    return callback


def check_threads(value: int) -> int:
    """--threads: torch's CPU threads, an integer >= 1."""
    if value < 1:
        raise QuickdraftError(f"--threads must be >= 1, got {value}")
    return value


def apply_threads(threads: int | None) -> None:
    """--threads N: torch uses N CPU threads in this process (unset: PyTorch's default)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _sampling_flag(name: str, help: str):
    """A sampling flag: SamplingParams' default and SamplingParams' own check of `name`."""
    return typer.Option(getattr(_SAMPLING_DEFAULTS, name), "--" + name.replace("_", "-"), help=help,
                        callback=checked(lambda v: check_field(name, v)))


_SAMPLING_DEFAULTS = SamplingParams()

TARGET = typer.Option(None, "--target", help="Target model: a Hugging Face folder, a .gguf file, a named model "
                      "(`quickdraft models`, e.g. smollm2) or a Hub id (default: the bundled code model).")
DRAFT = typer.Option(None, "--draft", help="Draft model, given like --target (default: the target's own draft "
                     "for the bundled and named models), or `self`: the target's own weights in int4 "
                     "(--draft-quantization int8 for int8) drafting for it.")
METHOD = typer.Option(None, "--method", help="none | draft | eagle3 | ngram | suffix | lookahead (eagle3: --draft "
                      "is an EAGLE-3 head folder; default: draft when a "
                      "draft is given, else none), auto (suffix and ngram, plus the draft or head when there is one, "
                      "the best per request and step) or a list such as suffix,draft (a member's option: "
                      "-o suffix.tree=false).")
METHODS = typer.Option(None, "--method", help="Proposer to measure (repeatable): draft | eagle3 | ngram | suffix | "
                       "lookahead (default: draft when a draft is available, else ngram).")


def num_speculative_tokens_option(default: int | None = DEFAULT_NUM_SPECULATIVE_TOKENS):
    """-k; None as the default: the command's LLM decides (the --profile's choice, else the default)."""
    note = "" if default is not None else (f" Default {DEFAULT_NUM_SPECULATIVE_TOKENS} ({DEFAULT_SELF_DRAFT_NUM_SPECULATIVE_TOKENS} "
                                           "with --draft self), or the --profile's choice.")
    return typer.Option(default, "-k", "--num-speculative-tokens",
                        help=f"k: draft tokens proposed per step, 1 to {MAX_NUM_SPECULATIVE_TOKENS} "
                        "(the most; a tree's depth)." + note, callback=checked(check_num_speculative_tokens))


NUM_SPECULATIVE_TOKENS = num_speculative_tokens_option()
PROFILED_NUM_SPECULATIVE_TOKENS = num_speculative_tokens_option(None)  # commands that take --profile


def max_num_seqs_option(default: int = DEFAULT_MAX_NUM_SEQS, why: str = ""):
    """--max-num-seqs; a command whose work wants another default says `why`."""
    return typer.Option(default, "--max-num-seqs", help="Requests in the running batch at most"
                        + (f" ({why})." if why else "."), callback=checked(check_max_num_seqs))


MAX_NUM_SEQS = max_num_seqs_option()
KV_CACHE_MEMORY = typer.Option(None, "--kv-cache-memory", help="KV memory budget of all requests' caches (the "
                               "target's and the draft's): bytes (4GiB, 512MB, 1000000000) or a fraction of the "
                               "memory available after loading (0.5). Caches grow as requests need them within it; "
                               f"default {DEFAULT_KV_CACHE_MEMORY_CPU:g} of the available RAM on a CPU, "
                               f"{DEFAULT_KV_CACHE_MEMORY_GPU:g} of the free memory on a GPU (never more than "
                               "--max-num-seqs requests of the model's context use).",
                               callback=checked(check_kv_cache_memory))
KV_CACHE_DTYPE = typer.Option(DEFAULT_KV_CACHE_DTYPE, "--kv-cache-dtype",
                              help="The target's KV cache element type: auto (its dtype; float16 for int8 / int4 "
                              "layers on a CPU, as llama.cpp's default), float32, float16 or "
                              "bfloat16. A 16-bit cache reads half the bytes per cached token every step (long "
                              "contexts decode faster on a CPU) and holds twice the tokens in the KV budget; the "
                              "model attends over keys and values rounded to 16 bits (as llama.cpp's f16 cache).",
                              callback=checked(check_kv_cache_dtype))
MAX_NUM_BATCHED_TOKENS = typer.Option(DEFAULT_MAX_NUM_BATCHED_TOKENS, "--max-num-batched-tokens",
                                      help="Tokens one step computes at most: the running requests' verify positions "
                                      "and a chunk of a prompt being prefilled (a longer prompt is prefilled in "
                                      "chunks, within the running requests' steps). auto (the default): on a CPU "
                                      f"{AUTO_BATCHED_TOKENS[0]} while requests are decoding (a prompt token at position p "
                                      "counting 1 + p / P, P from the model's shape: deep chunks cost more attention), "
                                      f"{AUTO_BATCHED_TOKENS[1]} "
                                      f"when none is, {AUTO_BATCHED_TOKENS_GPU} on a GPU; or a number for every step.",
                                      callback=checked(check_max_num_batched_tokens))
ENABLE_PREFIX_CACHING = typer.Option(None, "--enable-prefix-caching/--no-enable-prefix-caching",
                                     help="Keep the KV of computed tokens and reuse it for later prompts with the "
                                     "same prefix (multi-turn chat, shared system prompts); output is unchanged. "
                                     "Default: on, except with --tensor-parallel-size > 1 (not supported there yet).")
PREFIX_CACHE_CHECK = typer.Option(None, "--prefix-cache-check/--no-prefix-cache-check",
                                  help="Debug: on every prefix cache hit, prefill the cached prefix from scratch too "
                                  "and compare the KV bit for bit; a mismatch is logged, counted "
                                  "(prefix_cache_check_mismatches in /metrics) and repaired. Costs a prefill per hit. "
                                  "Default: the environment variable QUICKDRAFT_PREFIX_CACHE_CHECK (1, 0 or raise), "
                                  "else off.")
THREADS = typer.Option(None, "--threads", help="CPU threads torch uses (default: PyTorch's, one per core).",
                       callback=checked(check_threads))
TREE_WIDTH = typer.Option(None, "--tree-width", help="Draft model: candidates per depth (>1 = token tree).")
SPEC_OPTION = typer.Option(None, "--spec-option", "-o",
                           help="Proposer option KEY=VALUE (repeatable), e.g. -o max_ngram=4.")
POLICY = typer.Option(DEFAULT_POLICY, "--policy", help="Speculation length: auto (from this machine's measured "
                      "step costs: a smaller k or plain decoding where speculation does not pay) | fixed | "
                      "acceptance | goodput.")
PROFILE = typer.Option(None, "--profile", help="Profile from `quickdraft select` (its method, draft and k, unless "
                       "--method or --draft is given) or `quickdraft tune` (costs for --policy goodput or auto).")
DTYPE = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16 (default: float32 on CPU, the "
                     "checkpoint's on a GPU).")
DEVICE = typer.Option(None, "--device", help="cpu | cuda | mps (default: best available).")
COMPILE = typer.Option(None, "--compile/--no-compile",
                       help="torch.compile the steps (default: CUDA graphs on CUDA/ROCm; on CPU the --aot steps once built).")
AOT = typer.Option(False, "--aot", help="CPU: ahead-of-time compiled steps, built once per model shape (about a "
                                        "minute) and cached; later runs load them in under a second.")
QUANTIZATION = typer.Option(None, "--quantization", help="Target weights: int8 or int4 (weight-only; int4 groups of 32), or none (dequantised into --dtype). Default: a GGUF stored in 4 bits runs int4 on a CPU (its own blocks), anything else as loaded.")
DRAFT_QUANTIZATION = typer.Option(None, "--draft-quantization", help="Draft weights: int8 or int4 (weight-only), or none (as loaded; on a CPU a draft model is int8 otherwise, an EAGLE-3 head int8, int4 without VNNI; --draft self int4).")
DRAFT_DTYPE = typer.Option(None, "--draft-dtype", help="The draft's precision, when it should differ from --dtype "
                           "(changes speed only, not the output).")
SAVE_DTYPE = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16 (default: the file's float type, "
                          "bfloat16 for quantised weights).")
TENSOR_PARALLEL_SIZE = typer.Option(1, "--tensor-parallel-size", "--tp", help="Split the target over N ranks "
                                    "(tensor parallelism: N GPUs with nccl, or N CPU processes with gloo sharing the "
                                    "cores). Started here, or under `torchrun --nproc-per-node N`.")
TENSOR_PARALLEL_TIMEOUT = typer.Option(60.0, "--tensor-parallel-timeout", help="Seconds a tensor-parallel collective "
                                       "may wait for a rank; then the engine fails (a dead rank never hangs it).")


def tensor_parallel_args(size: int, timeout: float) -> dict:
    """LLM keyword arguments for --tensor-parallel-size / --tensor-parallel-timeout."""
    if size < 1:
        raise QuickdraftError(f"--tensor-parallel-size must be >= 1, got {size}")
    if not timeout > 0:
        raise QuickdraftError(f"--tensor-parallel-timeout must be > 0, got {timeout}")
    if size == 1:
        return {}
    return {"tensor_parallel_size": size, "tensor_parallel_options": {"timeout_s": timeout}}


def torchrun_follower() -> bool:
    """Under torchrun, a rank other than 0 (it follows rank 0's steps; rank 0 does the talking)."""
    from ..parallel.group import under_torchrun
    import os

    return under_torchrun() and os.environ.get("RANK", "0") != "0"


TEMPERATURE = _sampling_flag("temperature", f"Sampling temperature in [0, {MAX_TEMPERATURE:g}]; 0 = greedy.")
TOP_P = _sampling_flag("top_p", "(0, 1]: the nucleus' probability mass; 1 = off.")
TOP_K = _sampling_flag("top_k", "Keep the K likeliest tokens; 0 = off.")
MIN_P = _sampling_flag("min_p", "[0, 1]: drop tokens below min-p x the likeliest's probability; 0 = off.")
PRESENCE_PENALTY = _sampling_flag("presence_penalty", f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]: subtracted once "
                                  "from each generated token.")
FREQUENCY_PENALTY = _sampling_flag("frequency_penalty", f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]: subtracted per "
                                   "occurrence in the output.")
REPETITION_PENALTY = _sampling_flag("repetition_penalty", f"(0, {MAX_REPETITION_PENALTY:g}], 1 = off: prompt and "
                                    "output tokens' logits divided (or multiplied) by it.")
PROMPTS_FILE = typer.Option(None, "--prompts", help="JSONL of {\"prompt\": text or token ids} (default: a "
                            "built-in workload).")
WORKLOAD = typer.Option("code", "--workload", help="Built-in workload: code | editing (held-out files).")
OUT_DIR = typer.Option(Path("bench-results"), "--out-dir", help="Folder for the result files.")
PLOT = typer.Option(None, "--plot", help="Also write a PNG (needs matplotlib).")


def iters_option(default: int):
    """--iters of the commands that time steps (tune, select, bench): their own default each."""
    return typer.Option(default, "--iters", help="Timed repetitions of each step-cost measurement (medians).")


def profile_out_option(default: str):
    """--out of the commands that write a profile (tune, select)."""
    return typer.Option(Path(default), "--out", help="Profile JSON to write.")


def written(out: Path, plot: Path | None) -> str:
    """The line tune and select end with: where the profile (and the plot) went."""
    return f"profile written to {out}" + (f", plot to {plot}" if plot else "")


# ---- structured output (docs/structured-output.md) ----------------------------------------

JSON_SCHEMA = typer.Option(None, "--json-schema", help="Constrain the output to this JSON schema (a .json file).")
JSON_OBJECT = typer.Option(False, "--json-object", help="Constrain the output to a JSON object.")
REGEX = typer.Option(None, "--regex", help="Constrain the output to match this regular expression.")
CHOICE = typer.Option(None, "--choice", help="Constrain the output to one of these strings (repeatable).")
GRAMMAR = typer.Option(None, "--grammar", help="Constrain the output to this grammar file (Lark, or llama.cpp's GBNF).")
CONSTRAINT_COMPILE_TIMEOUT = typer.Option(DEFAULT_CONSTRAINT_COMPILE_TIMEOUT, "--constraint-compile-timeout",
                                          help="Seconds a request's JSON schema, regex or grammar may take to "
                                          "compile (beside the running requests); past it the request is refused.",
                                          callback=checked(check_constraint_compile_timeout))


def constraint_flags(json_schema: Path | None, json_object: bool, regex: str | None, choice: list[str] | None,
                     grammar: Path | None) -> dict | None:
    """The constraint (constraints.Constraint.of's mapping) the flags ask for, or None; at most one."""
    given = [(flag, kind, value) for flag, kind, value in (
        ("--json-schema", "json_schema", json_schema), ("--json-object", "json_object", json_object or None),
        ("--regex", "regex", regex), ("--choice", "choice", choice or None), ("--grammar", "grammar", grammar))
        if value is not None]
    if len(given) > 1:
        fail(f"one constraint at a time: {given[0][0]} and {given[1][0]} were both given")
    if not given:
        return None
    flag, kind, value = given[0]
    if isinstance(value, Path):
        try:
            value = value.read_text()
        except OSError as exc:
            fail(f"cannot read {flag} {value}: {exc.strerror}")
        if kind == "json_schema":
            try:
                value = json.loads(value)
            except ValueError as exc:
                fail(f"{flag} {given[0][2]} is not JSON: {exc}")
    return {kind: value}
