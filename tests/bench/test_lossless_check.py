"""`quickdraft verify`: the statistical losslessness check passes on the real engine,
fails on deliberately wrong verifiers, reports its power, and checks greedy equality."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import typer
from typer.testing import CliRunner

import quickdraft.engine
from quickdraft import QuickdraftError, SamplingParams
from quickdraft.bench.lossless import DEFAULT_PROMPTS, chi2_sf, goodness_of_fit, verify_lossless
from quickdraft.cli.verify import verify_command
from quickdraft.sampling import draw
from quickdraft.verify import greedy_verify_host, rejection_sample

V = 12
PROMPT = [3, 7, 5]
SAMPLES = 2000


@pytest.fixture(scope="module")
def pair(ckpt_factory):
    # vocab 12 and a large init scale: peaked, non-uniform distributions (as in test_lossless)
    t = ckpt_factory("verify_t", vocab=V, seed=0, tokenizer=False, initializer_range=0.3)
    d = ckpt_factory("verify_d", vocab=V, seed=5, layers=1, tokenizer=False, initializer_range=0.3)
    return t, d


def check(pair, method="draft", samples=SAMPLES, **kw):
    target, draft = pair
    return verify_lossless(target, draft if method == "draft" else None, method=method, k=2,
                           params=SamplingParams(**kw), prompts=[PROMPT], samples=samples)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)], ids=["t1", "topk"])
def test_passes_on_the_engine_and_rejects_the_control(pair, kw):
    r = check(pair, **kw)
    dist = r["distribution"]
    assert r["passed"], r
    assert dist["num_tests"] >= 2 and {t["position"] for t in dist["tests"]} == {2, 3}
    assert all(t["p_speculative"] > dist["alpha_corrected"] for t in dist["tests"])
    assert dist["plain_passed"]
    assert r["control"]["rejected"] and r["control"]["min_pvalue"] < 1e-6
    assert 0.05 < r["stats"]["acceptance_rate"] < 0.95  # accept and reject paths both taken


def test_deterministic_proposer_control_is_the_target_at_another_temperature(pair):
    r = check(pair, method="ngram", samples=1000, temperature=1.0)
    assert r["passed"], r
    assert "temperature 2" in r["control"]["kind"] and r["control"]["rejected"]


def _accept_everything(draft_tokens, target_probs, draft_probs, uniform, final):
    return rejection_sample(draft_tokens, target_probs, draft_probs, torch.zeros_like(uniform), final)


def _recover_from_q(draft_tokens, target_probs, draft_probs, uniform, final):
    """Right accept test, but the token after a rejection is drawn from q, not max(0, p - q)."""
    out, num_accepted = rejection_sample(draft_tokens, target_probs, draft_probs, uniform, final)
    B, k = draft_tokens.shape
    if k == 0 or draft_probs is None:
        return out, num_accepted
    rows = torch.arange(B, device=out.device)
    q = draft_probs[rows, num_accepted.clamp(max=k - 1)]
    out = out.clone()
    out[rows, num_accepted] = torch.where(num_accepted < k, draw(q, final), out[rows, num_accepted])
    return out, num_accepted


@pytest.mark.parametrize("wrong", [_accept_everything, _recover_from_q], ids=["accept-all", "recover-from-q"])
@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)], ids=["t1", "topk"])
def test_fails_on_a_wrong_verifier(pair, monkeypatch, wrong, kw):
    monkeypatch.setattr(quickdraft.engine, "rejection_sample", wrong)
    r = check(pair, **kw)
    assert not r["passed"]
    assert r["distribution"]["speculative_passed"] is False
    assert min(t["p_speculative"] for t in r["distribution"]["tests"]) < 1e-6
    assert r["distribution"]["plain_passed"]  # plain decoding never drafts: still right


def test_penalties_pass(pair, monkeypatch):
    """`quickdraft verify --repetition-penalty ... --frequency-penalty ...`: the exact penalised
    distribution is the reference (the engine-level chi-square tests in tests/engine/test_lossless.py
    are the ones that catch a verifier ignoring the draft tokens' penalties: this check looks at
    one position at a time, where that bug shifts only a fraction of the rows)."""
    kw = dict(temperature=1.0, repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=-0.5)
    r = check(pair, **kw)
    assert r["passed"], r
    assert r["config"]["repetition_penalty"] == 1.6 and r["greedy"]["num_draft_tokens"] > 0
    # the reference is the penalised distribution: against the unpenalised one the same output fails
    import dataclasses

    import quickdraft.bench.lossless as lossless

    exact = lossless._next_token_probs
    plain = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    monkeypatch.setattr(lossless, "_next_token_probs",
                        lambda model, seq, params, n: exact(model, seq, dataclasses.replace(params, **plain), n))
    r = check(pair, **kw)
    assert not r["passed"] and r["distribution"]["speculative_passed"] is False


def test_greedy_equality(pair, monkeypatch):
    r = check(pair, temperature=0.0)
    assert r["passed"] and r["distribution"]["skipped"]
    assert r["greedy"]["equal"] == r["greedy"]["total"] == 1 and r["greedy"]["num_draft_tokens"] > 0

    def accept_all(draft_tokens, target_argmax):  # (the engine verifies greedy chains on host lists)
        return greedy_verify_host(draft_tokens, [d + t[-1:] for d, t in zip(draft_tokens, target_argmax)])

    monkeypatch.setattr(quickdraft.engine, "greedy_verify_host", accept_all)
    r = check(pair, temperature=0.0)
    assert not r["passed"] and r["greedy"]["equal"] == 0 and r["greedy"]["mismatches"][0]["first_difference"] > 0


def test_default_text_prompts_and_an_inconclusive_sample(target_dir, draft_dir):
    """The conftest target is near-uniform over 384 tokens: 100 samples leave no context
    with enough rows, which is a FAIL that says so rather than a vacuous PASS."""
    r = verify_lossless(target_dir, draft_dir, k=3, samples=100)
    assert [p["prompt"] for p in r["prompts"]] == list(DEFAULT_PROMPTS)
    assert r["distribution"]["inconclusive"] and "increase --samples" in r["distribution"]["skipped"]
    assert not r["passed"] and r["greedy"]["equal"] == r["greedy"]["total"] == 3


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("verify")(verify_command)
    app.command("unused")(lambda: None)  # two commands: typer then expects the command name
    return app


def test_cli_json_and_text(pair):
    target, draft = pair
    args = ["verify", "--target", str(target), "--draft", str(draft), "-k", "2", "--samples", "1000",
            "--ids", "--prompt", "3 7 5", "--top-k", "6"]
    r = CliRunner().invoke(_app(), args + ["--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["passed"] and data["config"]["top_k"] == 6 and data["control"]["rejected"]
    assert data["greedy"] == {**data["greedy"], "equal": 1, "total": 1}
    text = CliRunner().invoke(_app(), args)
    assert text.exit_code == 0, text.output
    assert "PASS" in text.stdout and "FAIL" not in text.stdout and "control rejected: yes" in text.stdout


def test_cli_exits_1_on_fail(pair, monkeypatch):
    target, draft = pair
    monkeypatch.setattr(quickdraft.engine, "rejection_sample", _recover_from_q)
    r = CliRunner().invoke(_app(), ["verify", "--target", str(target), "--draft", str(draft), "-k", "2",
                                    "--samples", "1000", "--ids", "--prompt", "3 7 5"])
    assert r.exit_code == 1 and "FAIL" in r.stdout


@pytest.mark.parametrize("kwargs, needle", [
    (dict(method="draft"), "needs a draft model"),
    (dict(method="ngram", samples=50), "samples must be an integer >= 100"),
    (dict(method="none"), "--method must be one of"),
    (dict(method="ngram", prompts=["text"]), "token ids"),
])
def test_user_errors(pair, kwargs, needle):
    with pytest.raises(QuickdraftError, match=needle):
        verify_lossless(pair[0], **kwargs)


def test_cli_user_error(pair):
    r = CliRunner().invoke(_app(), ["verify", "--target", str(pair[0]), "--samples", "10"])
    assert r.exit_code == 2 and "needs a draft model" in r.output  # one line, no traceback


def test_chi_square_tail_and_binning():
    scipy_stats = pytest.importorskip("scipy.stats")
    for x, df in [(0.5, 1), (3.0, 2), (10.0, 4), (25.0, 9), (200.0, 10), (1.0, 30), (60.0, 30)]:
        assert chi2_sf(x, df) == pytest.approx(scipy_stats.chi2.sf(x, df), rel=1e-9, abs=1e-300)
    probs = [0.5, 0.3, 0.2, 0.0]
    assert goodness_of_fit({0: 50, 1: 30, 2: 20}, probs)["pvalue"] == pytest.approx(1.0)
    bad = goodness_of_fit({0: 50, 1: 30, 2: 19, 3: 1}, probs)
    assert bad["pvalue"] == 0.0 and bad["impossible"] == 1


def test_chi_square_without_scipy(monkeypatch):
    """scipy is a test extra, not a dependency: the built-in tail gives the same p-value."""
    probs = [0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01] + [0.0] * 4
    counts = {0: 420, 1: 180, 2: 160, 3: 95, 4: 70, 5: 45, 6: 20, 7: 10}
    with_scipy = goodness_of_fit(counts, probs, top=5)
    monkeypatch.setitem(sys.modules, "scipy.stats", None)  # the import now raises ImportError
    without = goodness_of_fit(counts, probs, top=5)
    assert without["bins"] == with_scipy["bins"] == 6  # 5 tokens + "other"
    assert without["pvalue"] == pytest.approx(with_scipy["pvalue"], rel=1e-9)


@pytest.mark.slow
def test_passes_with_the_shipped_eagle3_head():
    """`quickdraft verify --method eagle3 --draft target-eagle3`: the bundled target with its head
    passes; a head has no distribution of its own, so the control is the target at another
    temperature."""
    from quickdraft.llm import default_model_dirs

    r = verify_lossless(default_model_dirs()[0], "target-eagle3", method="eagle3", k=3,
                        params=SamplingParams(temperature=1.0), samples=300)
    assert r["passed"], r
    assert "temperature 2" in r["control"]["kind"] and r["control"]["rejected"]
    assert r["stats"]["acceptance_rate"] > 0.3
