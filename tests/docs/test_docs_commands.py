"""The commands and links in README.md and docs/*.md are true of this tree.

Statically, for every shell command in a fenced code block: a `quickdraft SUB` names a command
of the CLI and every `--flag` / `-f` used with it is one of that command's options; a
`python benchmarks/X.py` (or `benchmarks/X.sh`) names a script that exists. Every relative link
points at a file in the repository, and none leads outside it. Then the quick commands run for
real: `quickdraft models`, and each `quickdraft generate` on the bundled pair cut to 4 tokens.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from quickdraft.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\s*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _commands(doc: Path) -> list[tuple[str, list[str]]]:
    """(source line, argv) of every command in the doc's shell blocks; `a && b` gives two."""
    found = []
    for block in SHELL_BLOCK.findall(doc.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            argv = shlex.split(line, comments=True)
            while argv:
                cut = argv.index("&&") if "&&" in argv else len(argv)
                found.append((line.strip(), argv[:cut]))
                argv = argv[cut + 1 :]
    return found


def _all_commands() -> list[tuple[str, str, list[str]]]:
    return [(doc.relative_to(ROOT).as_posix(), line, argv) for doc in DOCS for line, argv in _commands(doc)]


def _quickdraft_argv(argv: list[str]) -> list[str] | None:
    """The arguments after `quickdraft` (or `-m quickdraft.cli`), None for other commands."""
    if argv and argv[0] == "quickdraft":
        return argv[1:]
    if "-m" in argv and argv[argv.index("-m") + 1 : argv.index("-m") + 2] == ["quickdraft.cli"]:
        return argv[argv.index("-m") + 2 :]
    return None


def _cli():
    return typer.main.get_command(app)


def _options(command) -> set[str]:
    # typer vendors its own click, so options are recognised by their type name, not a class
    names = {"--help"}
    for param in command.params:
        if getattr(param, "param_type_name", None) == "option":
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


QUICKDRAFT = [(doc, line, qd) for doc, line, argv in _all_commands() if (qd := _quickdraft_argv(argv)) is not None]


def test_the_docs_have_commands_to_check():
    # A change to the block syntax or the parser must not make the checks below vacuous.
    assert len(QUICKDRAFT) >= 30
    assert any(doc == "README.md" and line.startswith("pip install") for doc, line, _ in _all_commands())


@pytest.mark.parametrize("doc,line,args", QUICKDRAFT, ids=[f"{d}:{' '.join(a[:1])}" for d, _, a in QUICKDRAFT])
def test_quickdraft_commands_and_flags_exist(doc, line, args):
    cli = _cli()
    assert args, f"{doc}: `{line}` names no command"
    sub = args[0]
    assert sub in cli.commands, f"{doc}: `{line}`: `quickdraft {sub}` is not a command ({sorted(cli.commands)})"
    known = _options(cli.commands[sub])
    for arg in args[1:]:
        if not arg.startswith("-") or re.fullmatch(r"-\d+(\.\d+)?", arg):
            continue  # a value (negative numbers included)
        flag = arg.split("=", 1)[0]
        assert flag in known, f"{doc}: `{line}`: `quickdraft {sub}` has no option {flag}"


def test_benchmark_scripts_named_in_the_docs_exist():
    named = set()
    for doc, line, argv in _all_commands():
        for arg in argv:
            if re.fullmatch(r"benchmarks/[\w.-]+\.(py|sh)", arg):
                named.add((doc, line, arg))
    assert named, "no benchmark script is named in the docs' commands"
    missing = [f"{doc}: `{line}` runs {arg}" for doc, line, arg in sorted(named) if not (ROOT / arg).is_file()]
    assert not missing, "\n".join(missing)


def test_every_benchmark_script_is_listed_in_docs_benchmarks():
    """docs/benchmarks.md's table says what each script measures: a new script gets a row."""
    listed = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) if f"benchmarks/{p.name}" not in listed]
    assert not missing, f"docs/benchmarks.md does not list {', '.join(missing)}"


@pytest.mark.parametrize("doc", DOCS + [ROOT / "benchmarks" / "results" / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_in_the_repository(doc):
    bad = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith(("#", "mailto:")):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT):
            bad.append(f"{target} leads outside the repository")
        elif not path.exists():
            bad.append(f"{target} does not exist")
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)


def test_no_doc_refers_to_a_file_outside_the_repository():
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text and "/work/" not in text, doc.relative_to(ROOT).as_posix()


def test_results_index_covers_every_result_file():
    results = ROOT / "benchmarks" / "results"
    index = (results / "README.md").read_text()
    files = [p for p in results.rglob("*") if p.is_file() and p.name != "README.md"]
    missing = [p.relative_to(results).as_posix() for p in files if f"({p.relative_to(results).as_posix()})" not in index]
    assert not missing, f"benchmarks/results/README.md does not index: {missing}"


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


# --- the quick commands, run for real -------------------------------------------------------

# Bundled-pair generate commands (the bundled target, its draft or its EAGLE-3 head), without
# what takes minutes to start (tensor-parallel ranks, compiling) or needs a chat model.
SLOW_FLAGS = {"--target", "--tensor-parallel-size", "--tp", "--aot", "--compile", "--quantization", "--chat"}
BUNDLED_DRAFTS = {"target-eagle3"}


def _runs_quickly(args: list[str]) -> bool:
    if args[:1] != ["generate"] or SLOW_FLAGS & {a.split("=", 1)[0] for a in args}:
        return False
    return "--draft" not in args or args[args.index("--draft") + 1] in BUNDLED_DRAFTS


GENERATE = [(doc, line, args) for doc, line, args in QUICKDRAFT if _runs_quickly(args)]


def _with_max_tokens(args: list[str], n: int) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--max-tokens":
            skip = True
            continue
        if not a.startswith("--max-tokens="):
            out.append(a)
    return [out[0], "--max-tokens", str(n), *out[1:]]


def test_quickdraft_models_runs():
    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    assert "smollm2" in result.output


def test_there_are_bundled_generate_commands_to_run():
    assert any(doc == "README.md" for doc, _, _ in GENERATE)


@pytest.mark.parametrize("doc,line,args", GENERATE, ids=[f"{d}:{' '.join(a[1:4])}" for d, _, a in GENERATE])
def test_bundled_pair_generate_commands_run(doc, line, args):
    result = CliRunner().invoke(app, _with_max_tokens(args, 4))
    assert result.exit_code == 0, f"{doc}: `{line}` failed:\n{result.output}"
    assert "tok/s" in result.output or "tokens" in result.output, result.output


def _readme_first_command() -> list[str]:
    """The quickdraft command of README's first `pip install ... && quickdraft ...` line."""
    return next(qd for doc, line, argv in _all_commands() if doc == "README.md" and line.startswith("pip install")
                and (qd := _quickdraft_argv(argv)) is not None)


@pytest.mark.smollm2
def test_readme_first_command_runs_a_real_model_and_checks_identity():
    """README's first command (cut to 24 tokens) on SmolLM2: coherent text, then the speedup and
    the identity check it promises (speed itself is not asserted: no timing thresholds here)."""
    from conftest import need_smollm2

    need_smollm2()
    args = _readme_first_command()
    assert args[:1] == ["generate"] and "smollm2" in args and "--compare" in args and "--example" in args
    result = CliRunner().invoke(app, _with_max_tokens(args, 24))
    assert result.exit_code == 0, result.output
    assert "speedup over plain decoding:" in result.output
    assert "output identical to plain decoding: yes" in result.output
    assert "```python" in result.output  # the edit's answer starts with the file it copies
