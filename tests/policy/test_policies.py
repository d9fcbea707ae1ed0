"""Speculation-length policies: the k they choose, and losslessness through the engine."""

from __future__ import annotations

import json

import pytest

from quickdraft import LLM, QuickdraftError, SamplingParams
from quickdraft.policy import AcceptancePolicy, GoodputPolicy, SpecPolicy, expected_tokens, make_policy

PROMPTS = [[0, 5, 7, 9, 11], [0, 3], [0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0


def test_fixed_policy_respects_the_bound():
    p = SpecPolicy(5)
    states = [p.new_state() for _ in range(3)]
    assert p.choose(states, 5) == [5, 5, 5]
    assert p.choose(states, 2) == [2, 2, 2]


def test_acceptance_policy_grows_and_shrinks():
    p = AcceptancePolicy(8)
    s = p.new_state()
    assert s.k == 4
    p.observe(s, 4, 4)  # all accepted: +2
    assert s.k == 6
    p.observe(s, 6, 6)
    p.observe(s, 8, 8)
    assert s.k == 8  # capped
    p.observe(s, 8, 3)  # some rejected: -1
    assert s.k == 7
    for _ in range(10):
        p.observe(s, s.k, 0)
    assert s.k == 1  # floor
    p.observe(s, 0, 0)  # a step without drafts changes nothing
    assert s.k == 1 and p.choose([s], 5) == [1]


def synthetic_profile(step_ms: list[list[float]], propose_ms: list[list[float]], alpha: float,
                      batch_sizes=(1, 8, 32)) -> dict:
    qs = list(range(1, len(step_ms[0]) + 1))
    return {
        "version": 1, "device": "cpu", "cpu_or_gpu_name": "synthetic", "torch": "x", "target": "t",
        "dtype": "float32", "context": 256, "batch_sizes": list(batch_sizes), "query_lengths": qs,
        "target_step_s": [[t / 1e3 for t in row] for row in step_ms],
        "methods": {"draft": {"options": {}, "ks": list(range(1, len(propose_ms[0]) + 1)),
                              "propose_s": [[t / 1e3 for t in row] for row in propose_ms],
                              "acceptance_per_pos": [alpha ** (i + 1) for i in range(len(propose_ms[0]))],
                              "alpha": alpha}},
        "best_k": {"draft": {}}, "created": "2026-11-30", "command": "synthetic",
    }


# Batch 1: verify steps cost almost what a 1-token step costs; batch 32: linear in q.
STEP = [[10, 10.5, 11, 11.5, 12, 12.5, 13],  # B = 1, q = 1..7
        [12, 14, 16, 18, 20, 22, 24],  # B = 8
        [30, 60, 90, 120, 150, 180, 210]]  # B = 32
PROPOSE = [[0.5 * k for k in range(1, 7)], [1.0 * k for k in range(1, 7)], [3.0 * k for k in range(1, 7)]]


def test_goodput_policy_on_synthetic_profiles():
    good = GoodputPolicy(6, synthetic_profile(STEP, PROPOSE, 0.8), "draft")
    assert good.best_k(0.8, 1, 6) == 6  # cheap verify, high acceptance: speculate fully
    assert 0 < good.best_k(0.8, 8, 6) < 6  # costlier verify: shorter
    assert good.best_k(0.8, 32, 6) == 0  # verify cost linear in q: speculation never pays
    assert good.best_k(0.0, 1, 6) == 0  # nothing is ever accepted
    assert good.best_k(0.8, 1, 2) == 2  # bounded by the tokens the request may still emit
    s = good.new_state()
    for _ in range(30):  # a request that never accepts pulls its estimate down from the prior
        good.observe(s, 4, 0)
    assert good.alpha(s) < 0.1 and good.choose([s], 6) == [0]


def test_goodput_policy_calibrates_on_measured_steps_and_probes():
    good = GoodputPolicy(6, synthetic_profile(STEP, PROPOSE, 0.8), "draft")
    assert good.best_k(0.8, 1, 6) == 6
    # The engine finds speculative steps at batch 1 cost far more than the profile says
    # (e.g. sampling overhead): 60 ms at k = 6, the plain step as predicted.
    good.observe_step(1, 6, 0.060)
    good.observe_step(1, 0, 0.010)
    assert good.cost(1, 6) == pytest.approx(0.060)
    # unmeasured ks at batch 1 are scaled by the median ratio measured there (here 60/15.5 and 1)
    ratio = sorted([0.060 / good.predicted_cost(1, 6), 1.0])[1]
    assert good.cost(1, 3) == pytest.approx(good.predicted_cost(1, 3) * ratio)
    assert good.best_k(0.8, 1, 6) < 6
    # a batch size never seen borrows the ratio of the nearest one measured at the same k
    assert good.cost(8, 6) == pytest.approx(good.predicted_cost(8, 6) * 0.060 / good.predicted_cost(1, 6))
    # running means: a new measurement moves the estimate a fifth of the way
    good.observe_step(1, 0, 0.020)
    assert good.cost(1, 0) == pytest.approx(0.8 * 0.010 + 0.2 * 0.020)
    # probing: a batch that would never speculate drafts the best k > 0 every probe_every steps
    never = GoodputPolicy(6, synthetic_profile(STEP, PROPOSE, 0.8), "draft")
    states = [never.new_state() for _ in range(32)]
    picks = [never.choose(states, 6)[0] for _ in range(3 * never.probe_every)]
    assert picks.count(0) == len(picks) - 3 and all(k > 0 for k in picks[never.probe_every - 1::never.probe_every])


def test_make_policy_errors():
    with pytest.raises(QuickdraftError, match="policy must be one of"):
        make_policy("bogus", 4)
    with pytest.raises(QuickdraftError, match="profile"):
        make_policy("goodput", 4)
    with pytest.raises(QuickdraftError, match="no measurements for method"):
        make_policy("goodput", 4, synthetic_profile(STEP, PROPOSE, 0.5), "ngram")


@pytest.fixture(scope="module")
def plain_out(target_dir):
    return [o.token_ids for o in LLM(target_dir, method="none").generate(PROMPTS, GREEDY)]


def test_acceptance_policy_is_lossless(target_dir, draft_dir, plain_out):
    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=6, policy="acceptance")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out
    assert llm.stats.num_draft_tokens > 0


def test_confidence_stop_is_lossless_and_drafts_less(target_dir, draft_dir, plain_out):
    # drafts per step compared at k = 5 every step: the fixed policy
    full = LLM(target_dir, draft=draft_dir, num_speculative_tokens=5, policy="fixed")
    stop = LLM(target_dir, draft=draft_dir, num_speculative_tokens=5, spec_options={"confidence_threshold": 0.3},
               policy="fixed")
    assert [o.token_ids for o in stop.generate(PROMPTS, GREEDY)] == plain_out
    full.generate(PROMPTS, GREEDY)
    assert stop.stats.num_draft_tokens / stop.stats.num_steps < full.stats.num_draft_tokens / full.stats.num_steps
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=30, ignore_eos=True) for i in range(3)]
    assert [o.token_ids for o in stop.generate(PROMPTS, params)] == [o.token_ids for o in stop.generate(PROMPTS, params)]


@pytest.mark.parametrize("alpha,expect_drafts", [(0.95, True), (0.0, False)])
def test_goodput_policy_through_the_engine(target_dir, draft_dir, plain_out, tmp_path, alpha, expect_drafts):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(synthetic_profile(STEP, PROPOSE, alpha)))
    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=6, policy="goodput", profile=path)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out
    if expect_drafts:
        assert llm.stats.num_draft_tokens > 0
    else:  # only the periodic probes draft: one batch step in probe_every
        assert llm.stats.num_drafts <= len(PROMPTS) * (1 + llm.stats.num_steps // GoodputPolicy.probe_every)
