"""One name, one default and one check per concept across the library, the CLI and the
server: every command's flag for a concept is the one definition in cli/common.py, its
default is the library's, and a bad value gets the library's own message."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import typer.main

from quickdraft import LLM, EngineConfig, QuickdraftError, SamplingParams, SpecConfig
from quickdraft.cli import app
from quickdraft.cli import common
from quickdraft.config import DEFAULT_MAX_NUM_SEQS, DEFAULT_NUM_SPECULATIVE_TOKENS
from quickdraft.sampling import DEFAULT_TEMPERATURE, FIELD_CHECKS

COMMANDS = typer.main.get_command(app).commands


def run(*args):
    return subprocess.run([sys.executable, "-m", "quickdraft.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def flags(opt: str):
    """(command, click parameter) for every command that has `opt`."""
    return [(name, p) for name, c in COMMANDS.items() for p in c.params if opt in getattr(p, "opts", ())]


def test_k_means_one_thing_with_one_default_and_help():
    uses = flags("-k")
    assert {name for name, _ in uses} >= {"generate", "serve", "verify", "distill"}
    for name, p in uses:
        assert p.opts == ["-k", "--num-speculative-tokens"], name
        # commands with --profile leave k unset by default: a `quickdraft select` profile's choice, else the default
        profiled = any("--profile" in getattr(q, "opts", ()) for q in COMMANDS[name].params)
        shared = common.PROFILED_NUM_SPECULATIVE_TOKENS if profiled else common.NUM_SPECULATIVE_TOKENS
        assert p.default == (None if profiled else DEFAULT_NUM_SPECULATIVE_TOKENS), name
        assert p.help == shared.help, name
    assert str(DEFAULT_NUM_SPECULATIVE_TOKENS) in common.PROFILED_NUM_SPECULATIVE_TOKENS.help
    # the library's defaults are the same constant (LLM's None: the profile's choice, else this one)
    assert inspect.signature(LLM).parameters["num_speculative_tokens"].default is None
    assert SpecConfig().num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    # tune's longest k is another concept with another name
    assert [n for n, _ in flags("--max-k")] == ["tune"] and "tune" not in {n for n, _ in uses}


def test_max_num_seqs_threads_and_sampling_defaults_are_the_library_ones():
    assert inspect.signature(LLM).parameters["max_num_seqs"].default == DEFAULT_MAX_NUM_SEQS
    assert EngineConfig().max_num_seqs == DEFAULT_MAX_NUM_SEQS
    seqs = dict(flags("--max-num-seqs"))
    assert seqs["serve"].default == DEFAULT_MAX_NUM_SEQS and seqs["serve"].help == common.MAX_NUM_SEQS.help
    for name, p in seqs.items():  # one definition; a command with its own default says why in its help
        assert p.help.startswith(common.MAX_NUM_SEQS.help.rstrip(".")), name
        assert p.default == DEFAULT_MAX_NUM_SEQS or p.help != common.MAX_NUM_SEQS.help, name
    threads = flags("--threads")
    assert {n for n, _ in threads} >= {"generate", "serve", "verify", "tune", "bench", "distill", "train",
                                       "train-eagle3"}
    assert all(p.default is None and p.help == common.THREADS.help for _, p in threads)
    assert SamplingParams().temperature == DEFAULT_TEMPERATURE
    defaults = SamplingParams()
    for field in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"):
        uses = flags("--" + field.replace("_", "-"))
        assert uses, field
        for name, p in uses:
            assert p.default == getattr(defaults, field), (name, field)


def test_help_lists_each_command_once_and_no_alias():
    r = run("--help")
    assert r.returncode == 0
    listed = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("│ ") and len(line.split()) > 2]
    assert "train-eagle3" in listed and "train-eagle" not in listed
    assert len(listed) == len(set(listed))
    old = run("train-eagle", "--out", "x")
    assert old.returncode == 2 and "train-eagle3" in old.stderr and "Traceback" not in old.stderr


def _library_message(**kwargs) -> str:
    with pytest.raises(QuickdraftError) as info:
        LLM(**kwargs)  # checked before any model is fetched or loaded
    return str(info.value)


@pytest.mark.parametrize("command", ["serve", "generate", "verify", "distill"])
def test_bad_k_is_rejected_at_the_cli_with_the_library_message(command):
    message = _library_message(num_speculative_tokens=0)
    extra = {"generate": ["hi"], "distill": ["--out", "/nonexistent/never-written"]}.get(command, [])
    r = run(command, "-k", 0, *extra)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: {message}"


def test_bad_values_share_one_message_across_flags_library_and_server():
    from quickdraft.server.protocol import APIError, CompletionRequest, parse_body

    bad = {"temperature": 101.0, "top_p": 0.0, "top_k": -2, "min_p": 1.5, "presence_penalty": -2.5,
           "frequency_penalty": 3.0, "repetition_penalty": 0.0}
    for field, value in bad.items():
        problem = FIELD_CHECKS[field](value)
        assert problem, field
        with pytest.raises(QuickdraftError) as lib:
            SamplingParams(**{field: value})
        assert str(lib.value) == f"invalid {field}: {problem}, got {value!r}"
        with pytest.raises(APIError) as api:
            parse_body(CompletionRequest, {"model": "m", "prompt": "x", field: value})
        assert api.value.status == 400 and api.value.param == field
        assert api.value.message.startswith(f"invalid {field}: {problem} ")
    # and the CLI's flag answers with the library's line
    r = run("generate", "--temperature", 101, "hi")
    assert r.returncode == 2 and r.stderr.strip() == f"error: invalid temperature: {FIELD_CHECKS['temperature'](101.0)}, got 101.0"


def test_max_num_seqs_check_is_the_library_one():
    message = _library_message(max_num_seqs=0)
    r = run("serve", "--max-num-seqs", 0)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {message}"


@pytest.mark.parametrize("k", [0, 65, True, 2.0, None])
def test_spec_config_and_llm_share_the_k_check(k):
    from quickdraft.config import check_num_speculative_tokens

    with pytest.raises(QuickdraftError) as one:
        check_num_speculative_tokens(k)
    for method in ("draft", "none"):  # one rule, whatever the method
        with pytest.raises(QuickdraftError) as spec:
            SpecConfig(method=method, num_speculative_tokens=k)
        assert str(spec.value) == str(one.value)
    if k is not None:  # LLM's None is its default: a profile's choice, else DEFAULT_NUM_SPECULATIVE_TOKENS
        assert _library_message(num_speculative_tokens=k) == str(one.value)


def test_kv_cache_memory_is_one_flag_with_the_library_default_and_check():
    uses = dict(flags("--kv-cache-memory"))
    assert set(uses) >= {"serve", "generate"}
    for name, p in uses.items():
        assert p.default is None and p.help == common.KV_CACHE_MEMORY.help, name
    assert inspect.signature(LLM).parameters["kv_cache_memory"].default is None
    assert EngineConfig().kv_cache_memory is None
    message = _library_message(kv_cache_memory="lots")
    for command in ("serve", "generate"):
        r = run(command, "--kv-cache-memory", "lots", *(["hi"] if command == "generate" else []))
        assert r.returncode == 2 and r.stderr.strip() == f"error: {message}", r.stderr


def test_kv_cache_dtype_is_one_flag_with_the_library_default_and_check():
    from quickdraft.config import DEFAULT_KV_CACHE_DTYPE

    uses = dict(flags("--kv-cache-dtype"))
    assert set(uses) >= {"serve", "generate"}
    for name, p in uses.items():
        assert p.default == DEFAULT_KV_CACHE_DTYPE and p.help == common.KV_CACHE_DTYPE.help, name
    assert inspect.signature(LLM).parameters["kv_cache_dtype"].default == DEFAULT_KV_CACHE_DTYPE == "auto"
    assert EngineConfig().kv_cache_dtype == DEFAULT_KV_CACHE_DTYPE
    message = _library_message(kv_cache_dtype="int3")
    for command in ("serve", "generate"):
        r = run(command, "--kv-cache-dtype", "int3", *(["hi"] if command == "generate" else []))
        assert r.returncode == 2 and r.stderr.strip() == f"error: {message}", r.stderr


def test_constraint_compile_timeout_is_one_flag_with_the_library_default_and_check():
    from quickdraft.config import DEFAULT_CONSTRAINT_COMPILE_TIMEOUT

    assert inspect.signature(LLM).parameters["constraint_compile_timeout"].default == DEFAULT_CONSTRAINT_COMPILE_TIMEOUT
    assert EngineConfig().constraint_compile_timeout == DEFAULT_CONSTRAINT_COMPILE_TIMEOUT
    uses = dict(flags("--constraint-compile-timeout"))
    assert set(uses) == {"generate", "serve"}
    for name, p in uses.items():
        assert p.default == DEFAULT_CONSTRAINT_COMPILE_TIMEOUT and p.help == common.CONSTRAINT_COMPILE_TIMEOUT.help, name
    with pytest.raises(QuickdraftError, match="constraint_compile_timeout must be a number of seconds > 0"):
        EngineConfig(constraint_compile_timeout=0)
