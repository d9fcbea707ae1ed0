"""The command line: streaming output, --json, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "quickdraft.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_generate_json(target_dir, draft_dir):
    r = run("generate", "--target", target_dir, "--draft", draft_dir, "-k", 3, "--max-tokens", 12, "--ignore-eos",
            "--json", "def add(a, b):")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert len(data["token_ids"]) == 12
    assert set(data["stats"]) >= {"acceptance_rate", "mean_acceptance_length", "tokens_per_second", "num_drafts"}


def test_generate_with_penalties_equals_the_library(target_dir, draft_dir):
    from quickdraft import LLM, SamplingParams

    r = run("generate", "--target", target_dir, "--draft", draft_dir, "-k", 3, "--max-tokens", 16, "--ignore-eos",
            "--temperature", 0, "--repetition-penalty", 1.4, "--frequency-penalty", 0.5, "--presence-penalty", 0.25, "--json",
            "def add(a, b):")
    assert r.returncode == 0, r.stderr
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=0.5, presence_penalty=0.25)
    assert json.loads(r.stdout)["token_ids"] == LLM(target_dir, method="none").generate(["def add(a, b):"], params)[0].token_ids
    bad = run("generate", "--target", target_dir, "--presence-penalty", 3, "x")
    assert bad.returncode == 2 and "presence_penalty" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_generate_streams_text_and_summary(target_dir, draft_dir):
    r = run("generate", "--target", target_dir, "--draft", draft_dir, "--max-tokens", 8, "--ignore-eos",
            "--temperature", 0.7, "--seed", 3, "def add(a, b):")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and "acceptance rate" in r.stderr and "mean acceptance length" in r.stderr
    r2 = run("generate", "--target", target_dir, "--draft", draft_dir, "--max-tokens", 8, "--ignore-eos",
             "--temperature", 0.7, "--seed", 3, "def add(a, b):")
    assert r.stdout == r2.stdout  # seeded


@pytest.mark.slow
def test_chat_and_ids(target_dir):
    assert run("generate", "--target", target_dir, "--chat", "--max-tokens", 3, "hi").returncode == 0
    r = run("generate", "--target", target_dir, "--ids", "--max-tokens", 3, "--json", "--ignore-eos", "0 5 6")
    assert r.returncode == 0 and json.loads(r.stdout)["prompt_tokens"] == 3


@pytest.mark.slow
def test_generate_with_other_proposers(target_dir, draft_dir):
    plain = json.loads(run("generate", "--target", target_dir, "--method", "none", "--max-tokens", 16, "--ignore-eos",
                           "--temperature", 0, "--json", "def add(a, b):").stdout)["token_ids"]
    for extra in (["--method", "ngram", "-o", "max_ngram=3", "-o", "num_candidates=2"],
                  ["--method", "suffix", "-o", "tree=false"],
                  ["--method", "lookahead", "-k", 4],
                  ["--draft", draft_dir, "--tree-width", 2],
                  ["--draft", draft_dir, "--method", "suffix,draft", "-o", "suffix.tree=false", "-o", "draft_cost=0"],
                  ["--draft", draft_dir, "--method", "auto"]):
        r = run("generate", "--target", target_dir, *extra, "--max-tokens", 16, "--ignore-eos", "--temperature", 0,
                "--json", "def add(a, b):")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == plain


@pytest.mark.parametrize("args, needle", [
    (["--method", "ngram", "-o", "bogus=1"], "bogus"),
    (["--method", "ngram", "-o", "max_ngram"], "KEY=VALUE"),
    (["--method", "suffix", "-o", "min_token_prob=7"], "min_token_prob"),
    (["--target", "/nonexistent/model"], "not found"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-tokens", "100000"], "context length"),
    (["--method", "bogus"], "method"),
    (["--method", "suffix,suffix"], "twice"),
    (["--method", "suffix,lookahead"], "cannot be combined"),
    (["--method", "suffix,ngram", "-o", "tree=false"], "member.option"),
])
def test_errors_are_one_line_exit_2(target_dir, args, needle):
    if "--target" not in args:
        args = ["--target", str(target_dir), *args]
    r = run("generate", *args, "hello")
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_vocabulary_mismatch_and_bad_config(target_dir, ckpt_factory, tmp_path):
    other = ckpt_factory("vocab400cli", vocab=400)
    r = run("generate", "--target", target_dir, "--draft", other, "hi")
    assert r.returncode == 2 and "vocabulary mismatch" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "config.json").write_text("{broken")
    r = run("generate", "--target", tmp_path, "hi")
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr


def test_compare_runs_plain_decoding_in_the_same_weight_format(target_dir, draft_dir, monkeypatch):
    """--compare reports the speedup and whether greedy output is plain decoding's; its plain
    decoding is the target as the speculative run loads it (--quantization, compile): a speedup
    over another format would not be a speedup, and greedy output is identical only to plain
    decoding of the same weights. Without speculation --compare is a usage error."""
    from typer.testing import CliRunner

    import quickdraft.llm
    from quickdraft.cli import app
    from quickdraft.model.formats import Int8BlockedLinear, Int8TorchLinear

    built = []

    class Spy(quickdraft.llm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append((kwargs, self))

    monkeypatch.setattr(quickdraft.llm, "LLM", Spy)
    r = CliRunner().invoke(app, ["generate", "--target", str(target_dir), "--draft", str(draft_dir), "-k", "3",
                                 "--max-tokens", "8", "--ignore-eos", "--temperature", "0", "--policy", "fixed",
                                 "--quantization", "int8", "--no-compile", "--compare", "--json", "def add(a, b):"])
    assert r.exit_code == 0, r.output
    assert [kw.get("method") for kw, _ in built] == [None, "none"]
    for kw, llm in built:
        assert kw["quantization"] == "int8" and kw["compile"] is False
        assert any(isinstance(m, (Int8BlockedLinear, Int8TorchLinear)) for m in llm.target.modules())
    out = json.loads(r.stdout.strip().splitlines()[-1])
    cmp_ = out["compare"]
    assert cmp_["identical"] is True and cmp_["speedup"] > 0
    # each side's figure is its own timed run's: not the warm-up's tokens and time too (which made
    # plain decoding look 15-20% slower on SmolLM2's edit example: its prompt's prefill counted twice)
    assert out["stats"]["num_output_tokens"] == cmp_["plain_tokens"] == 8
    assert cmp_["speedup"] == pytest.approx(out["stats"]["tokens_per_second"] * cmp_["plain_elapsed_s"] / 8)
    r = CliRunner().invoke(app, ["generate", "--target", str(target_dir), "--compare", "hi"])
    assert r.exit_code == 2 and "--compare needs" in r.output


def test_compare_times_both_eagerly_while_their_compiled_steps_build(target_dir, draft_dir, monkeypatch):
    """On a fresh cache --compare does not wait minutes for the background AOT build: both LLMs
    stay on eager steps (the build goes on for later runs) and the JSON says which steps ran."""
    from typer.testing import CliRunner

    import quickdraft.llm
    from quickdraft.cli import app

    builds = []

    class Building:  # a background build that never ends; counts who asks
        calls = 0

        def done(self):
            self.calls += 1
            return False

    def build_in_background(self, recipe):
        self.aot_build = Building()
        builds.append(self.aot_build)
        self.engine.switch_when_built(self.aot_build)

    monkeypatch.setattr(quickdraft.llm.LLM, "_build_in_background", build_in_background)
    monkeypatch.setattr(quickdraft.llm.aot, "background_builds_enabled", lambda: True)
    r = CliRunner().invoke(app, ["generate", "--target", str(target_dir), "--draft", str(draft_dir), "-k", "3",
                                 "--max-tokens", "8", "--ignore-eos", "--temperature", "0", "--compare", "--json",
                                 "def add(a, b):"])
    assert r.exit_code == 0, r.output
    assert len(builds) == 2
    # asked once each by --compare; the engines, kept on their steps, never ask again between steps
    assert [b.calls for b in builds] == [1, 1]
    cmp_ = json.loads(r.stdout.strip().splitlines()[-1])["compare"]
    assert cmp_["steps"] == "eager" and cmp_["identical"] is True and cmp_["speedup"] > 0


def test_model_source_commands_and_errors(tmp_path):
    r = run("models")
    assert r.returncode == 0 and "smollm2" in r.stdout, r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x01" * 40)
    for args, needle in ((["pull", "bogus"], "unknown model name"),
                         (["convert", bad, "--out", tmp_path / "out"], "truncated or corrupt"),
                         (["generate", "--target", "no-such-model", "hi"], "model not found"),
                         (["generate", "--target", tmp_path / "missing.gguf", "hi"], "no such file")):
        r = run(*args)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
def test_train_eagle3_end_to_end(target_dir, tmp_path):
    """The command generates the target's answers, trains with progress bars, saves a head the
    engine loads, and --resume reuses the generated text."""
    from quickdraft.model.eagle3 import is_eagle3_head

    out = tmp_path / "head"
    args = ("train-eagle3", "--target", target_dir, "--out", out, "--prompts", 6, "--new-tokens", 12, "--epochs", 1,
            "--draft-vocab", 100, "--seq-len", 32, "--corpus-windows", 2, "--threads", 1)
    r = run(*args)
    assert r.returncode == 0, r.stderr
    assert "generate" in r.stderr and "train" in r.stderr and "tok/s" in r.stderr
    log = json.loads((out / "train_log.json").read_text())
    assert log["sequences"] == 8 and log["draft_vocab_size"] == 100 and log["epochs"][0]["loss"] > 0
    assert set(log["acceptance_after"]) >= {"acceptance_rate", "mean_acceptance_length", "accepted_by_position"}
    assert is_eagle3_head(out)
    again = run(*args, "--resume")
    assert again.returncode == 0, again.stderr
    assert "reused_sequences" in again.stderr
    gen = run("generate", "--target", target_dir, "--method", "eagle3", "--draft", out, "--max-tokens", 8,
              "--ignore-eos", "--json", "def add(a, b):")
    assert gen.returncode == 0, gen.stderr
