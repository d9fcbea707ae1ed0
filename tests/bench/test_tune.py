"""`quickdraft tune` and `quickdraft bench`: measurements on the tiny pair (quickdraft.bench.measure),
the tune command end to end and its input errors, and the bench command (with and without peers)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from quickdraft.bench.measure import measure_acceptance, measure_propose, measure_target_steps
from quickdraft.errors import QuickdraftError
from quickdraft.policy.costs import expected_tokens, load_profile

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def test_measurements_on_the_tiny_pair(target_dir, draft_dir):
    from quickdraft import LLM, SamplingParams
    from quickdraft.proposers import PROPOSERS

    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=3)
    steps = measure_target_steps(llm.target, [1, 3], [1, 2, 4], context=8, iters=2, warmup=1)
    assert len(steps) == 2 and all(len(r) == 3 and all(t > 0 for t in r) for r in steps)
    ticks = []
    prop = measure_propose(llm, [1, 2], [1, 3], context=8, iters=2, warmup=1, progress=ticks.append)
    assert len(prop) == 2 and all(len(r) == 2 and all(t > 0 for t in r) for r in prop)
    assert sum(ticks) == pytest.approx(4)
    assert llm.engine.proposer.cache is None  # the LLM's own proposer was not used
    ngram = PROPOSERS["ngram"].build(target=llm.target)
    prop = measure_propose(ngram, [2], [2], context=16, iters=3, tokens=[5, 6, 7, 8] * 10)
    assert len(prop) == 1 and prop[0][0] > 0
    acc = measure_acceptance(llm, ["def add(a, b):", [0, 5, 6, 7]], 3,
                             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(acc.per_pos) == 3 and all(0 <= a <= 1 for a in acc.per_pos)
    assert acc.per_pos == sorted(acc.per_pos, reverse=True)
    assert expected_tokens(acc.alpha, 3) == pytest.approx(1 + sum(acc.per_pos), abs=1e-6)
    assert 0 < acc.draft_rate <= 1
    with pytest.raises(QuickdraftError, match="num_speculative_tokens=5"):
        measure_acceptance(llm, ["def add(a, b):"], 5, SamplingParams(max_tokens=4))


def test_tune_end_to_end(target_dir, draft_dir, tmp_path):
    import typer
    from typer.testing import CliRunner

    from quickdraft.cli.tune import tune_command

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n\n" + json.dumps({"prompt": [0, 5, 6, 7]}) + "\n")
    out = tmp_path / "sub" / "profile.json"
    png = tmp_path / "profile.png"
    app = typer.Typer()
    app.command("tune")(tune_command)
    app.command("other")(lambda: None)  # two commands: typer keeps the "tune" name
    args = ["tune", "--target", str(target_dir), "--draft", str(draft_dir), "--method", "draft", "--method", "ngram",
            "--max-k", "3", "--batch-sizes", "1,2", "--context", "16", "--prompts", str(prompts), "--max-tokens", "16",
            "--iters", "2", "--out", str(out)] + (["--plot", str(png)] if HAS_MPL else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "best k" in result.output and "speedup" in result.output
    p = load_profile(out)
    assert p.batch_sizes == [1, 2] and p.query_lengths == [1, 2, 3, 4] and p.context == 16
    assert set(p.methods) == {"draft", "ngram"}
    assert p.methods["draft"].ks == [1, 2, 3] and p.methods["draft"].verify_q == [2, 3, 4]
    assert p.best_k_by_batch == p.best_k_table() and set(p.best_k_by_batch["ngram"]) == {"1", "2"}
    assert p.dtype == "float32" and p.device == "cpu" and p.target == str(target_dir)
    prov = json.loads(out.read_text())["provenance"]  # commit, command and machine ride along
    assert prov["machine"]["cpu"] and prov["machine"]["threads"] >= 1 and prov["date"] and prov["command"]
    if HAS_MPL:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tune_input_errors(target_dir, tmp_path):
    from quickdraft.bench.tune import TuneConfig, tune
    from quickdraft.bench.workloads import read_prompts
    from quickdraft.cli.common import parse_ints

    def parse_batch_sizes(text):
        return parse_ints(text, "--batch-sizes")

    assert parse_batch_sizes("8, 1,2,2") == (1, 2, 8)
    with pytest.raises(QuickdraftError, match="--batch-sizes"):
        parse_batch_sizes("1,two")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(QuickdraftError, match="bad.jsonl:2"):
        read_prompts(bad)
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": [0, 5, 6]}\n')
    assert read_prompts(good) == [[0, 5, 6]]
    with pytest.raises(QuickdraftError, match="listed twice"):
        TuneConfig(methods=("ngram", "ngram"))
    with pytest.raises(QuickdraftError, match="plain decoding"):
        TuneConfig(methods=("none",))
    with pytest.raises(QuickdraftError, match="method must be one of"):
        tune(TuneConfig(target=target_dir, methods=("nope",), out=tmp_path / "p.json"))
    with pytest.raises(QuickdraftError, match="context length"):
        tune(TuneConfig(target=target_dir, methods=("ngram",), context=4096, prompts=good, out=tmp_path / "p.json"))
    if not HAS_MPL:
        with pytest.raises(QuickdraftError, match="needs matplotlib"):
            tune(TuneConfig(target=target_dir, methods=("ngram",), plot=tmp_path / "p.png"))


def test_bench_command_end_to_end(target_dir, draft_dir, tmp_path):
    import json as _json

    import typer
    from typer.testing import CliRunner

    from quickdraft.cli.bench import bench_command

    app = typer.Typer()
    app.command("bench")(bench_command)
    app.command("other")(lambda: None)  # keep typer in multi-command mode
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [0, 5, 7, 9]}\n{"prompt": [0, 3, 4]}\n')
    r = CliRunner().invoke(app, ["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--method", "draft",
                                 "--method", "ngram", "--batch-sizes", "1,2", "--ks", "2", "--prompts", str(prompts),
                                 "--new-tokens", "8", "--repeats", "1", "--iters", "1", "--out-dir", str(tmp_path),
                                 "--name", "b"])
    assert r.exit_code == 0, r.output
    data = _json.loads((tmp_path / "b.json").read_text())
    assert {(x["method"], x["batch_size"], x["k"]) for x in data["runs"]} == \
        {("draft", 1, 2), ("draft", 2, 2), ("ngram", 1, 2), ("ngram", 2, 2)}
    for x in data["runs"]:
        assert x["tokens_per_s"] > 0 and x["speedup"] > 0 and x["predicted_speedup"] > 0
    assert data["provenance"]["machine"]["cpu"] and data["provenance"]["command"]
    assert "| draft |" in (tmp_path / "b.md").read_text() and "Provenance: commit" in (tmp_path / "b.md").read_text()
    if HAS_MPL:  # the figure: one panel per method plus acceptance by position
        assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bench_app():
    import typer

    from quickdraft.cli.bench import bench_command

    app = typer.Typer()
    app.command("bench")(bench_command)
    app.command("other")(lambda: None)  # keep typer in multi-command mode
    return app


def test_bench_with_peers_end_to_end(target_dir, draft_dir, tmp_path):
    from typer.testing import CliRunner

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [0, 5, 7, 9]}\n{"prompt": [0, 3, 4, 3, 4]}\n')
    r = CliRunner().invoke(_bench_app(), [
        "bench", "--target", str(target_dir), "--draft", str(draft_dir), "--method", "draft", "--method", "ngram",
        "--batch-sizes", "1", "--ks", "2", "--prompts", str(prompts), "--new-tokens", "12", "--repeats", "2",
        "--iters", "1", "--out-dir", str(tmp_path), "--name", "b", "--peers"])
    assert r.exit_code == 0, (r.output, r.exception)
    peers = json.loads((tmp_path / "b.json").read_text())["peers"]
    names = {"ours-plain", "ours-draft-k2", "ours-ngram-k2", "hf-plain", "hf-assisted", "hf-prompt-lookup-k2"}
    assert set(peers["methods"]) == names
    for name, m in peers["methods"].items():
        assert m["tokens_per_s"] > 0 and len(m["repeats"]) == 2
        # float32, same weights: every method, ours or transformers', writes plain greedy's tokens
        assert m["identical_to_ours_plain"] is True, (name, m["repeats"])
        assert all(x["tokens"] == 2 * 12 and x["first_difference_at"] == [None, None] for x in m["repeats"])
    assert set(peers["ratios"]) == {"ours-plain / hf-plain", "ours-draft-k2 / hf-assisted",
                                    "ours-ngram-k2 / hf-prompt-lookup-k2"}
    for v in peers["ratios"].values():
        assert len(v["per_repeat"]) == 2 and v["median_of_ratios"] > 0
    assert peers["workload"]["batch"] == 1 and peers["dtype"] == "float32"
    assert peers["methods"]["ours-draft-k2"]["tokens_per_step"] >= 1
    md = (tmp_path / "b.md").read_text()
    assert "## Peers" in md and "| ours-draft-k2 / hf-assisted |" in md and "NO (" not in md


def test_bench_peers_without_transformers_is_one_line_and_skipped(target_dir, draft_dir, tmp_path, monkeypatch):
    import sys

    from typer.testing import CliRunner

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [0, 5, 7, 9]}\n')
    r = CliRunner().invoke(_bench_app(), [
        "bench", "--target", str(target_dir), "--method", "ngram", "--ks", "2", "--prompts", str(prompts),
        "--new-tokens", "4", "--repeats", "1", "--iters", "1", "--out-dir", str(tmp_path), "--name", "b", "--peers"])
    assert r.exit_code == 0, (r.output, r.exception)
    lines = [x for x in r.output.splitlines() if "--peers" in x]
    assert lines == ["--peers skipped: transformers is not installed (pip install transformers)"]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["peers"] == {"skipped": "transformers is not installed (pip install transformers)"}
    assert {x["method"] for x in data["runs"]} == {"ngram"}
    assert "Skipped: transformers is not installed" in (tmp_path / "b.md").read_text()
