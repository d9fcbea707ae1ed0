"""The default policy (`auto`): k from this machine's measured step costs, plain decoding where
speculation cannot pay; its calibration schedule, the cached costs, and losslessness."""

from __future__ import annotations

import json
import logging

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.config import SpecConfig
from quickdraft.policy import auto
from quickdraft.policy.auto import AutoPolicy, bucket, costs_path, load_costs, load_pool, save_costs
from quickdraft.policy import make_policy

PROMPTS = [[0, 5, 7, 9, 11], [0, 3], [0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
KEY = {"target": "synthetic", "machine": "test"}


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty quickdraft cache and no calibration in memory."""
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(auto, "_CALIBRATED", {})
    monkeypatch.setattr(auto, "_PRIOR", {})
    monkeypatch.setattr(auto, "_POOL", {})
    return tmp_path


def policy_with(costs_ms: dict[int, float], k_max: int = 5, prior_length: float | None = None) -> AutoPolicy:
    p = AutoPolicy(k_max, KEY, persist=False)
    p.costs[1] = {k: ms / 1e3 for k, ms in costs_ms.items()}
    if prior_length is not None:
        p._priors[p._digest] = prior_length
    return p


def accept(p: AutoPolicy, state, k: int, accepted: int, steps: int = 10) -> None:
    for _ in range(steps):
        state.last_k = k
        p.observe(state, k, accepted)


def test_the_default_is_auto():
    assert SpecConfig().policy == "auto"
    assert isinstance(make_policy("auto", 4), AutoPolicy)


def test_speculation_that_cannot_pay_falls_back_to_plain_and_probes():
    # a verify step of 6 rows costs 4x plain (the AVX2 EAGLE-3 case): even every draft accepted loses
    p = policy_with({0: 10, 1: 22, 5: 70})
    s = p.new_state()
    accept(p, s, 5, 5)
    ks = [p.choose([s], 5)[0] for _ in range(4 * p.probe_every)]
    probes = [i for i, k in enumerate(ks) if k]
    # plain decoding, but for one probe at the best k > 0 after 4 steps, then 8, 16 and every probe_every
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    assert gaps == [4, 8, 16] + [p.probe_every] * (len(gaps) - 3) and len(gaps) >= 6
    assert all(ks[i] == 1 for i in probes)  # k = 1 costs least per emitted token here
    # speculation chosen on its rates again starts the gaps over
    accept(p, s, 1, 1, steps=40)
    p.costs[1] = {0: 0.010, 1: 0.012, 5: 0.070}
    assert p.choose([s], 5)[0] > 0
    p.costs[1] = {0: 0.010, 1: 0.022, 5: 0.070}
    again = [p.choose([s], 5)[0] for _ in range(5)]
    assert again == [0, 0, 0, 1, 0]


def test_speculation_that_pays_is_chosen_and_k_follows_acceptance():
    p = policy_with({0: 10, 1: 13, 5: 17})
    good, poor = p.new_state(), p.new_state()
    accept(p, good, 5, 5)
    assert p.choose([good], 5) == [5]
    accept(p, poor, 5, 0, steps=40)  # nothing accepted: not even short drafts pay
    assert p.choose([poor], 5) == [0]
    mid = p.new_state()
    accept(p, mid, 5, 1)  # about one token per step: a short k
    k = p.choose([mid], 5)[0]
    assert 1 <= k < 5
    assert p.choose([good], 3) == [3]  # within the engine's bound
    assert p.choose([good, poor], 5)[0] == p.choose([good, poor], 5)[1]  # one k for the batch


def test_a_cheaper_k_when_long_drafts_cost_too_much():
    # each extra draft costs 40% of a plain step: at acceptance 0.7 a short draft wins
    p = policy_with({0: 10, 1: 12, 5: 28})
    s = p.new_state()
    accept(p, s, 5, 2)
    rates = p.rates([s], 5)
    k = p.choose([s], 5)[0]
    assert 0 < k < 5 and rates[k] == max(rates.values()) and rates[k] > rates[0] * p.margin


def test_calibration_follows_a_schedule_then_freezes_and_persists(fresh_cache, caplog):
    p = AutoPolicy(5, KEY)
    s = p.new_state()
    seconds = {0: 0.010, 1: 0.030, 5: 0.080}  # speculation cannot pay
    ks = []
    with caplog.at_level(logging.INFO, logger="quickdraft"):
        for _ in range(p.warmup + 3 * p.samples):
            k = p.choose([s], 5)[0]
            ks.append(k)
            p.observe(s, k, k)
            p.observe_step(1, k, seconds[k] * (1 + 0.01 * len(ks)))
    # the schedule, not the clock, picks k while calibrating: warm-up, then 0, 1, 5 interleaved
    assert ks == [0] * p.warmup + [0, 1, 5] * p.samples
    assert set(p.costs[1]) == {0, 1, 5} and p.costs[1][5] / p.costs[1][0] == pytest.approx(8, rel=0.1)
    assert "measured decode steps" in caplog.text
    with caplog.at_level(logging.INFO, logger="quickdraft"):
        assert p.choose([s], 5) == [0]
    assert "speculation off for this model on this machine (batch 1)" in caplog.text
    # written to the cache; a later process (an empty memory) starts from it without calibrating
    assert costs_path(KEY).parent == fresh_cache / "costs"
    costs, prior = load_costs(KEY)
    assert costs == p.costs and prior is None  # the prior pools on past the calibration's 12 speculating steps
    assert load_pool(KEY) == {"steps": 2 * p.samples, "accepted": 6 * p.samples, "k": 6 * p.samples}
    auto._CALIBRATED.clear()
    auto._PRIOR.clear()
    auto._POOL.clear()
    q = AutoPolicy(5, KEY)
    assert q.prior_length == pytest.approx(6.0)  # every draft accepted, at k = 1 and 5 alike
    assert q.costs == costs and q.choose([q.new_state()], 5) == [0]
    assert bucket(2) not in q.costs and q.choose([q.new_state()] * 2, 5) == [0, 0]  # batch 2 calibrates on its own
    # another key (another forward, machine, threads...) does not share the costs
    assert AutoPolicy(5, dict(KEY, threads=2)).costs == {}


def test_a_poor_opening_does_not_turn_speculation_off_before_the_prior_is_measured(fresh_cache):
    # The bundled pair's EAGLE-3 head on an AMD EPYC Zen 3: plain 6.80 ms, k = 1 10.23 ms, k = 5
    # 11.36 ms. Its calibration steps at k = 5 (a 16-token warm-up's opening) accepted 0, 0, 1, 0, 0, 1
    # (k = 1: 1, 0, 1, 1, 1, 1), against 2.5 a step over whole requests. A prior frozen from those
    # alone (1.33) predicted 117 tok/s at k = 5 against 147 plain: speculation off, at 1.9x.
    costs = {0: 0.00680, 1: 0.01023, 5: 0.01136}
    p = AutoPolicy(5, KEY)
    s = p.new_state()
    opening = {1: iter([1, 0, 1, 1, 1, 1]), 5: iter([0, 0, 1, 0, 0, 1])}
    for _ in range(p.warmup + 3 * p.samples):  # the calibration, through the engine's calls
        k = p.choose([s], 5)[0]
        p.observe(s, k, next(opening[k]) if k else 0)
        p.observe_step(1, k, costs[k])
    assert p.costs[1] == costs
    assert p.prior_length == pytest.approx(3.5)  # still pooling: the neutral floor
    new = p.new_state()
    assert p.choose([new], 5) == [5]  # a new request speculates and measures itself
    # the pool fills over whole requests (2.5 accepted a step at k = 5), then freezes and is cached
    for _ in range(p.prior_samples):
        s = p.new_state()
        s.last_k = 5
        p.observe(s, 5, 2 if _ % 2 else 3)
    assert p._digest in p._priors and p._digest not in p._pools
    frozen = p.prior_length
    assert 3.0 < frozen < 3.7
    assert load_costs(KEY) == ({1: costs}, pytest.approx(frozen)) and load_pool(KEY) is None
    assert p.choose([p.new_state()], 5) == [5]

    # control: a method whose drafts are rarely accepted freezes a low prior and falls back to plain
    auto._PRIOR.clear()
    auto._POOL.clear()
    q = AutoPolicy(5, dict(KEY, method="poor"))
    q.costs[1] = dict(costs)
    for i in range(q.prior_samples):
        s = q.new_state()
        s.last_k = 5
        q.observe(s, 5, 1 if i % 4 == 0 else 0)
    assert q.prior_length < 1.5 and q.choose([q.new_state()], 5) == [0]


def test_a_broken_cache_file_is_measured_again(fresh_cache, caplog):
    path = costs_path(KEY)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="quickdraft"):
        assert load_costs(KEY) == ({}, None)
    assert "measuring them again" in caplog.text
    save_costs(KEY, {1: {0: 0.01, 1: -1.0, 5: 0.02}}, None)  # a negative time is refused on reading
    assert load_costs(KEY) == ({}, None)
    save_costs(dict(KEY, other=1), {1: {0: 0.01, 1: 0.01, 5: 0.02}}, None)
    assert json.loads(costs_path(dict(KEY, other=1)).read_text())["key"] == dict(KEY, other=1)


@pytest.fixture(scope="module")
def plain_out(target_dir):
    return [o.token_ids for o in LLM(target_dir, method="none").generate(PROMPTS, GREEDY)]


def test_the_default_calibrates_and_is_lossless(target_dir, draft_dir, plain_out, fresh_cache):
    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=5)
    assert isinstance(llm.engine.policy, AutoPolicy)
    # 64 tokens: more than the calibration's 2 + 3 x 6 steps can emit, so it ends inside the requests
    longer = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target_dir, method="none").generate(PROMPTS, longer)]
    assert [o.token_ids for o in llm.generate(PROMPTS, longer)] == plain  # the calibration ran
    assert 4 in llm.engine.policy.costs  # batch 3's bucket
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out  # its decisions ran
    assert json.loads(costs_path(llm.engine.cost_key()).read_text())["buckets"]["4"].keys() == {"0", "1", "5"}


@pytest.mark.parametrize("pays", [False, True])
def test_cached_costs_decide_through_the_engine(target_dir, draft_dir, plain_out, fresh_cache, pays):
    key = LLM(target_dir, draft=draft_dir, num_speculative_tokens=5).engine.cost_key()
    costs = {0: 0.010, 1: 0.0101, 5: 0.0105} if pays else {0: 0.010, 1: 0.040, 5: 0.090}
    save_costs(key, {bucket(b): costs for b in (1, 2, 3)}, 3.0)
    auto._CALIBRATED.clear()
    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=5)
    assert llm.engine.policy.costs[1] == costs  # no calibration: the cached costs
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out
    if pays:
        assert llm.stats.num_draft_tokens > 0
    else:  # only the periodic probes draft
        assert llm.stats.num_drafts <= len(PROMPTS) * (1 + llm.stats.num_steps // AutoPolicy.probe_every)
        assert llm.stats.num_draft_tokens < llm.stats.num_steps


def test_seeded_sampling_is_reproducible_with_cached_costs(target_dir, draft_dir, fresh_cache):
    key = LLM(target_dir, draft=draft_dir, num_speculative_tokens=5).engine.cost_key()
    save_costs(key, {1: {0: 0.010, 1: 0.012, 5: 0.020}, 4: {0: 0.012, 1: 0.015, 5: 0.025}}, 2.5)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=30, ignore_eos=True) for i in range(3)]
    runs = []
    for _ in range(2):  # two engines, as two processes would: each reads the cache
        auto._CALIBRATED.clear()
        auto._PRIOR.clear()
        runs.append([o.token_ids for o in LLM(target_dir, draft=draft_dir).generate(PROMPTS, params)])
    assert runs[0] == runs[1]


def test_the_test_session_never_touches_the_users_cache():
    """tests/conftest.py points QUICKDRAFT_CACHE at a folder of the session's own: calibrated costs,
    AOT packages and GGUF folders are the session's (a user's cached costs would change the k the
    tests' auto policies choose; the tests' calibrations would land in the user's cache)."""
    import os
    from pathlib import Path

    from quickdraft import aot
    from quickdraft.model.gguf import cache_dir as gguf_cache_dir
    from quickdraft.paths import cache_dir

    session = Path(os.environ["QUICKDRAFT_CACHE"])
    assert session.name.startswith("quickdraft-test-cache-") and cache_dir() == gguf_cache_dir() == session
    assert session != Path.home() / ".cache" / "quickdraft"
    assert costs_path(KEY).parent == session / "costs" and not (session / "costs").is_symlink()
    assert not (session / "aot").is_symlink() and not (session / "gguf").is_symlink()
    assert not aot.aot_dir().resolve().is_relative_to((Path.home() / ".cache" / "quickdraft").resolve())
