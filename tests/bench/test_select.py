"""`quickdraft select`: the choosing rule, prompt files, the command end to end on the tiny pair,
and the profile's choice as LLM(profile=...), `generate --profile` and `serve --profile` use it."""

from __future__ import annotations

import importlib.util
import json

import pytest

from quickdraft import LLM
from quickdraft.bench.select import Candidate, SelectConfig, candidates, choose, contenders, read_user_prompts
from quickdraft.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from quickdraft.errors import QuickdraftError
from quickdraft.policy.costs import Choice, Profile, load_profile, save_profile

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def row(label, k, speedup, tokens_per_step):
    return {"candidate": label, "method": label, "draft": None, "k": k, "speedup": speedup,
            "tokens_per_step": tokens_per_step}


def test_choose_never_picks_a_slower_method_or_a_noisy_non_speculating_one():
    assert choose([row("suffix", 3, 0.97, 1.4), row("ngram", 3, 0.8, 1.2)]) is None  # plain decoding wins
    # one token per step cannot beat plain decoding: its 1.3x is noise; the 1.2x that speculated wins
    assert choose([row("ngram", 3, 1.3, 1.0), row("draft", 4, 1.2, 2.5), row("draft", 2, 1.1, 1.8)])["k"] == 4
    assert choose([]) is None
    # a speedup above the tokens per step is impossible (each step costs a plain step at least): counted as
    # the tokens per step, 2.14x at 1.62 tokens/step loses to 1.88x at 3.23
    assert choose([row("ngram", 2, 2.14, 1.62), row("draft", 5, 1.88, 3.23)])["method"] == "draft"
    assert choose([row("ngram", 2, 1.3, 1.05)])["k"] == 2  # credible: 1.05x, still faster than plain


def test_near_ties_are_measured_again_and_the_choice_pools_both_measurements():
    rows = [row("ngram", 4, 1.21, 1.37), row("ngram", 2, 1.20, 1.29), row("ngram", 5, 1.19, 1.38),
            row("suffix", 3, 1.10, 1.40), row("ngram", 3, 1.3, 1.0)]
    assert [(r["method"], r["k"]) for r in contenders(rows)] == [("ngram", 4), ("ngram", 2), ("ngram", 5)]
    assert contenders([row("ngram", 4, 1.5, 2.0), row("ngram", 2, 1.2, 1.5)]) == []  # a clear winner
    assert contenders([row("ngram", 4, 0.9, 1.5)]) == [] and contenders([]) == []
    rows[0]["runoff"] = {"speedup": 1.17, "tokens_per_step": 1.37}
    rows[1]["runoff"] = {"speedup": 1.25, "tokens_per_step": 1.29}
    rows[2]["runoff"] = {"speedup": 1.18, "tokens_per_step": 1.38}
    assert choose(rows)["k"] == 2  # (1.20 + 1.25) / 2 beats (1.21 + 1.17) / 2
    rows[1]["runoff"] = {"speedup": 0.98, "tokens_per_step": 1.29}  # slower than plain the second time
    assert choose(rows)["k"] == 4  # (1.21 + 1.17) / 2 beats (1.19 + 1.18) / 2


def test_read_user_prompts(tmp_path):
    plain = tmp_path / "p.txt"
    plain.write_text("first prompt\n\n{second: prompt}\n")  # plain text, braces or not
    assert read_user_prompts(plain) == ["first prompt", "{second: prompt}"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": [1, 2]}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    assert read_user_prompts(jsonl) == ["hi", [1, 2], [{"role": "user", "content": "hello"}]]
    jsonl.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(QuickdraftError, match=r"p.jsonl:1: \"messages\""):
        read_user_prompts(jsonl)
    with pytest.raises(QuickdraftError, match="cannot read"):
        read_user_prompts(tmp_path / "missing.txt")
    with pytest.raises(QuickdraftError, match="--ks"):
        SelectConfig(ks=(3, 2))
    with pytest.raises(QuickdraftError, match="--workload"):
        SelectConfig(workload="poetry")


def test_candidates(target_dir, draft_dir):
    every, skipped = candidates(SelectConfig(drafts=(str(draft_dir),)), target_dir, None)
    assert every == [Candidate("suffix"), Candidate("ngram"), Candidate("draft", "self"),
                     Candidate("draft", str(draft_dir))] and not skipped
    only, _ = candidates(SelectConfig(methods=("self",)), target_dir, str(draft_dir))
    assert only == [Candidate("draft", "self")]


def test_select_end_to_end_and_generate_runs_the_choice(target_dir, draft_dir, tmp_path):
    import typer
    from typer.testing import CliRunner

    from quickdraft.cli.generate import generate
    from quickdraft.cli.select import select_command

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n" + json.dumps({"prompt": [0, 5, 6, 7]}) + "\n")
    out, png = tmp_path / "sel" / "profile.json", tmp_path / "sel.png"
    app = typer.Typer()
    app.command("select")(select_command)
    app.command("generate")(generate)
    args = ["select", "--target", str(target_dir), "--draft", str(draft_dir), "--method", "ngram", "--method", "self",
            "--method", "draft", "--ks", "2,3", "--prompts", str(prompts), "--max-tokens", "8", "--repeats", "1",
            "--iters", "1", "--out", str(out)] + (["--plot", str(png)] if HAS_MPL else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "choice:" in result.output and "plain decoding" in result.output
    profile = load_profile(out)
    data = json.loads(out.read_text())
    rows = data["select"]["rows"]
    assert {(r["candidate"], r["k"]) for r in rows} == {(c, k) for c in ("ngram", "self", f"draft:{draft_dir.name}")
                                                        for k in (2, 3)}
    ranked = [min(r["speedup"], r["tokens_per_step"]) for r in rows]
    assert ranked == sorted(ranked, reverse=True)
    c = profile.choice
    if c.method == "none":  # nothing beat plain decoding on this (busy) machine
        assert all(r["speedup"] <= 1 or r["tokens_per_step"] <= 1 for r in rows)
    else:  # the fastest that speculated (near-ties measured again: their mean), and its costs for --policy goodput
        assert c.speedup > 1 and c.k in (2, 3) and profile.methods[c.method].ks == [2, 3]
        best = choose(rows)
        assert (c.method, c.draft, c.k) == (best["method"], best["draft"], best["k"])
        again = [r for r in rows if "runoff" in r]
        assert len(again) != 1 and all(r in contenders(rows) for r in again)
        first = min(best["speedup"], best["tokens_per_step"])
        pooled = first if "runoff" not in best else \
            (first + min(best["runoff"]["speedup"], best["runoff"]["tokens_per_step"])) / 2
        assert c.speedup == pytest.approx(pooled, abs=1e-3)
    assert not HAS_MPL or png.stat().st_size > 0
    result = CliRunner().invoke(app, ["generate", "def add", "--target", str(target_dir), "--profile", str(out),
                                      "--max-tokens", "4", "--temperature", "0", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)


def test_a_runoff_measures_the_contenders_again_side_by_side_per_draft(target_dir, draft_dir, tmp_path, monkeypatch):
    """Every row a contender (the rule forced): one more run_bench per draft, each contender's
    second measurement recorded, the choice made from both."""
    from quickdraft.bench import compare
    from quickdraft.bench import select as sel

    calls = []
    real = compare.run_bench

    def spy(target, draft, methods, *args, **kw):
        calls.append((draft, tuple(methods), tuple(args[2])))
        return real(target, draft, methods, *args, **kw)

    monkeypatch.setattr(compare, "run_bench", spy)
    monkeypatch.setattr(sel, "_eligible", lambda r: True)
    monkeypatch.setattr(sel, "RUNOFF", 1.0)
    config = SelectConfig(target=str(target_dir), drafts=(str(draft_dir),), methods=("ngram", "draft"), ks=(2, 3),
                          prompts=None, workload="code", num_prompts=1, max_tokens=6, repeats=1, iters=1,
                          out=tmp_path / "p.json")
    result = sel.select(config)
    assert calls[:2] == [(None, ("ngram",), (2, 3)), (str(draft_dir), ("draft",), (2, 3))]  # the first measurement
    again = [r for r in result.rows if "runoff" in r]
    assert again == result.rows[:sel.RUNOFF_MOST] and len(again) == 4
    groups = {r["draft"] for r in again}
    assert sorted(calls[2:], key=str) == sorted(((d, (next(r["method"] for r in again if r["draft"] == d),),
                                                  tuple(sorted(r["k"] for r in again if r["draft"] == d)))
                                                 for d in groups), key=str)
    assert all(r["runoff"]["speedup"] > 0 and r["runoff"]["tokens_per_step"] >= 1 for r in again)
    best = max(again, key=sel._score)
    assert (result.choice.method, result.choice.k) == (best["method"], best["k"])
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(sel.ranked_table(result))
    assert "again" in console.export_text()


def _profile_with(tmp_path, target_dir, choice: Choice) -> str:
    p = Profile("cpu", "test", "x", str(target_dir), "float32", 8, [1], [1, 2, 3, 4], [[1.0, 1.1, 1.2, 1.3]], {},
                choice=choice)
    path = tmp_path / "choice.json"
    save_profile(path, p)
    return str(path)


def test_llm_profile_choice(target_dir, draft_dir, tmp_path):
    path = _profile_with(tmp_path, target_dir, Choice("draft", 3, "self", {}, 1.5, "test"))
    llm = LLM(target_dir, profile=path)
    assert llm.engine.config.spec.method == "draft" and llm.engine.k == 3
    assert {m.fmt for m in llm.draft.modules() if hasattr(m, "fmt")} == {"int4"}  # the self-draft
    assert LLM(target_dir, profile=path, num_speculative_tokens=2).engine.k == 2  # a given k wins
    given = LLM(target_dir, draft=draft_dir, profile=path)  # a given draft wins over the whole choice
    assert given.engine.k == DEFAULT_NUM_SPECULATIVE_TOKENS and given.draft.config.num_hidden_layers == 1
    plain = LLM(target_dir, profile=_profile_with(tmp_path, target_dir, Choice("none", 0, workload="test")))
    assert plain.engine.proposer is None


def test_choice_json_is_checked(tmp_path, target_dir):
    path = _profile_with(tmp_path, target_dir, Choice("draft", 3, "self"))
    data = json.loads(open(path).read())
    data["choice"]["k"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(QuickdraftError, match="choice: k must be 0 exactly when method is 'none'"):
        load_profile(tmp_path / "bad.json")


def test_every_prompt_is_measured_at_batch_1(target_dir, monkeypatch):
    """select (and bench) time the whole workload: at batch 1 each prompt in turn, not the first alone."""
    from quickdraft.bench.compare import run_bench

    seen = []
    original = LLM.generate

    def spy(self, prompts, params=None, *a, **kw):
        if self.engine.proposer is None and not isinstance(params, type(None)) and \
                (params[0] if isinstance(params, list) else params).max_tokens == 3:
            seen.extend(tuple(p) for p in prompts)
        return original(self, prompts, params, *a, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    prompts = [[0, 5, 6, 7], [0, 9, 9], [0, 4, 4, 4, 4]]
    res = run_bench(str(target_dir), None, ["ngram"], {}, [1, 2], [2], [0.0], prompts, 3, 1, 1)
    assert len(res["runs"]) == 2
    # batch 1: the three prompts; batch 2: [p0, p1] then [p2, p0]
    assert seen == [tuple(p) for p in prompts] + [tuple(p) for p in (prompts + prompts[:1])]


def test_each_timed_run_forgets_the_last_runs_outputs(target_dir, monkeypatch):
    """Suffix decoding remembers finished requests' outputs: a repeat of the same prompts would
    draft the last repeat's answers and measure a speedup no new prompt gets (select chose suffix
    decoding on the bundled pair for it). Every timed run starts from a proposer that forgot them."""
    from quickdraft.bench.compare import run_bench
    from quickdraft.proposers.suffix import SuffixProposer

    held_at_start = []
    original = LLM.generate

    def spy(self, prompts, params=None, *a, **kw):
        p = self.engine.proposer
        if isinstance(p, SuffixProposer) and (params[0] if isinstance(params, list) else params).max_tokens == 6:
            held_at_start.append(p.held_tokens)
        return original(self, prompts, params, *a, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    run_bench(str(target_dir), None, ["suffix"], {}, [1], [2], [0.0], [[0, 5, 6, 7]], 6, 3, 1)
    assert held_at_start == [0, 0, 0]  # one timed run per repeat, each from an empty memory
