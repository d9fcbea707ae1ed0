"""`quickdraft generate --json-schema FILE / --json-object / --regex R / --choice C / --grammar FILE`:
the library's constrained output, speculative (draft, k = 3) and greedy; bad constraints are
one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "kind": {"enum": ["def", "class"]}},
          "required": ["n", "kind"], "additionalProperties": False}


def run(*args):
    return subprocess.run([sys.executable, "-m", "quickdraft.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("flags,constraint", [
    (["--json-schema", "{schema}"], {"json_schema": SCHEMA}),
    (["--regex", "(def|class) [a-z]{1,6}"], {"regex": "(def|class) [a-z]{1,6}"}),
    (["--grammar", "{gbnf}"], {"grammar": 'root ::= "x = " [0-9]+'}),
    (["--choice", "yes", "--choice", "no"], {"choice": ["yes", "no"]}),
], ids=["json-schema", "regex", "grammar", "choice"])
def test_generate_with_a_constraint_equals_the_library(target_dir, draft_dir, tmp_path, flags, constraint):
    from quickdraft import LLM, SamplingParams

    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "g.gbnf").write_text('root ::= "x = " [0-9]+')
    files = {"{schema}": tmp_path / "s.json", "{gbnf}": tmp_path / "g.gbnf"}
    flags = [str(files.get(f, f)) for f in flags]
    r = run("generate", "--target", target_dir, "--draft", draft_dir, "-k", 3, "--policy", "fixed", "--max-tokens", 40, "--temperature", 0,
            "--json", *flags, "def add(a, b):")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    want = LLM(target_dir, method="none", policy="fixed").generate(
        ["def add(a, b):"], SamplingParams(temperature=0, max_tokens=40, constraint=constraint))[0]
    assert got["token_ids"] == want.token_ids
    if "json_schema" in constraint:
        assert json.loads(got["text"])["kind"] in ("def", "class")


@pytest.mark.parametrize("flags,needle", [
    (["--regex", "(a"], "regex"),
    (["--json-schema", "{bad}"], "json_schema"),
    (["--json-schema", "/nonexistent.json"], "cannot read"),
    (["--regex", "a", "--json-object"], "one constraint"),
])
def test_bad_constraints_are_one_line_exit_2(target_dir, tmp_path, flags, needle):
    (tmp_path / "bad.json").write_text('{"type": "nope"}')
    r = run("generate", "--target", target_dir, *[str(tmp_path / "bad.json") if f == "{bad}" else f for f in flags], "hello")
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_compile_time_limit_flag_is_checked_before_loading(target_dir, command):
    r = run(command, "--target", target_dir, "--constraint-compile-timeout", "0", *(["x"] if command == "generate" else []))
    assert r.returncode != 0
    assert "constraint_compile_timeout must be a number of seconds > 0" in r.stderr and "Traceback" not in r.stderr
