"""The cost model (quickdraft.policy.costs): goodput and best k on synthetic profiles,
interpolation, and the profile file format."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from quickdraft.policy.costs import (Profile, expected_tokens, expected_tokens_measured, load_profile, save_profile,
                                     solve_alpha)
from quickdraft.errors import QuickdraftError

def synthetic(batch_sizes, step, propose, acceptance, k_max=8, **method) -> Profile:
    """A profile from cost functions step(B, q) and propose(B, k) and acceptance per position."""
    qs = list(range(1, k_max + 2))
    ks = list(range(1, k_max + 1))
    data = {"version": 1, "device": "cpu", "cpu_or_gpu_name": "synthetic", "torch": "x", "target": "t",
            "dtype": "float32", "context": 256, "batch_sizes": list(batch_sizes), "query_lengths": qs,
            "target_step_s": [[step(b, q) for q in qs] for b in batch_sizes],
            "methods": {"draft": {"options": {}, "ks": ks,
                                  "propose_s": [[propose(b, k) for k in ks] for b in batch_sizes],
                                  "acceptance_per_pos": list(acceptance), "alpha": 0.5, **method}},
            "best_k": {}, "created": "2025-01-01T00:00:00+00:00", "command": "test"}
    return Profile.from_dict(data)


BS = [1, 2, 4, 8, 16, 32, 64]


def test_cheap_verify_and_high_acceptance_give_the_longest_k():
    p = synthetic(BS, lambda b, q: 0.010, lambda b, k: 1e-4 * k, [0.95 ** (i + 1) for i in range(8)])
    assert all(p.best_k("draft", b) == 8 for b in BS)


def test_no_acceptance_gives_no_speculation():
    p = synthetic(BS, lambda b, q: 0.010, lambda b, k: 1e-4 * k, [0.0] * 8)
    assert all(p.best_k("draft", b) == 0 for b in BS)


def test_k_shrinks_with_batch_size_when_verification_gets_expensive():
    # weight-bound at small B (flat in q), compute-bound at large B (linear in B * q)
    p = synthetic(BS, lambda b, q: 0.010 + 0.001 * b * q, lambda b, k: 0.0005 * k, [0.8 ** (i + 1) for i in range(8)])
    ks = [p.best_k("draft", b) for b in BS]
    assert ks[0] >= 4
    assert ks == sorted(ks, reverse=True), ks
    assert ks[-1] == 0
    assert p.best_k_table()["draft"] == {str(b): k for b, k in zip(BS, ks)}


def test_goodput_worked_example():
    # T(1,1) = 10 ms, T(1,3) = 12 ms, propose 2 tokens = 4 ms, acceptance [0.8, 0.6]:
    # E(2) = 1 + 0.8 + 0.6 = 2.4 tokens per step, 2.4 / (4 + 12) ms = 150 tok/s; plain 1 / 10 ms = 100 tok/s
    p = synthetic([1], lambda b, q: {1: 0.010, 2: 0.011, 3: 0.012}[q], lambda b, k: 0.002 * k, [0.8, 0.6], k_max=2)
    assert p.goodput("draft", 1, 0) == pytest.approx(100.0)
    assert p.goodput("draft", 1, 2) == pytest.approx(150.0)
    assert p.goodput("draft", 1, 1) == pytest.approx(1.8 / 0.013)
    assert p.best_k("draft", 1) == 2
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == 4.0 and expected_tokens(0.7, 0) == 1.0
    assert solve_alpha(1.75, 2) == pytest.approx(0.5, abs=1e-9)
    assert solve_alpha(1.0, 4) == 0.0 and solve_alpha(9.0, 4) == 1.0
    assert expected_tokens_measured([0.8, 0.6], 2) == pytest.approx(2.4)
    assert expected_tokens_measured([0.8, 0.4], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)  # geometric tail


def test_rarely_drafting_proposer_and_tree_verification():
    # drafting in half the steps halves the gain; at B=1 half the steps are plain 1-token forwards
    p = synthetic([1], lambda b, q: {1: 0.010, 2: 0.011, 3: 0.012}[q], lambda b, k: 0.002 * k, [0.8, 0.6],
                  k_max=2, draft_rate=0.5)
    assert p.goodput("draft", 1, 2) == pytest.approx((1 + 0.5 * 1.4) / (0.004 + 0.5 * 0.012 + 0.5 * 0.010))
    # a tree verifies 1 + N nodes: here k=1 -> 3 query tokens
    p = synthetic([1], lambda b, q: 0.001 * (9 + q), lambda b, k: 0.0, [0.5, 0.25], k_max=2, verify_q=[3, 3])
    assert p.goodput("draft", 1, 1) == pytest.approx(1.5 / 0.012)


def test_interpolation_is_linear_in_batch_size_and_clamped():
    p = synthetic([1, 4, 16], lambda b, q: 0.001 * b * q, lambda b, k: 0.0001 * b * k, [0.5] * 4, k_max=4)
    assert p.step_time(1, 1) == pytest.approx(0.001)
    assert p.step_time(2, 1) == pytest.approx(0.002)  # between 1 and 4: linear
    assert p.step_time(10, 3) == pytest.approx(0.030)
    assert p.step_time(0.5, 2) == pytest.approx(0.002)  # clamped below
    assert p.step_time(64, 5) == pytest.approx(0.080)  # clamped above
    assert p.step_time(4, 2.5) == pytest.approx(0.010)  # between measured query lengths
    assert p.propose_time("draft", 8, 2) == pytest.approx(0.0016)
    assert p.propose_time("draft", 100, 4) == pytest.approx(0.0064)
    assert p.propose_time("draft", 3, 0) == 0.0
    assert p.step_time(2, 1) == p.step_time(2, 1)  # memoised path
    with pytest.raises(QuickdraftError, match="no method 'ngram'"):
        p.propose_time("ngram", 1, 1)


def test_profile_round_trip(tmp_path):
    p = synthetic(BS, lambda b, q: 0.010 + 0.001 * b * q, lambda b, k: 0.0005 * k, [0.8 ** (i + 1) for i in range(8)],
                  draft_rate=0.9, verify_q=list(range(2, 10)))
    p.best_k_by_batch = p.best_k_table()
    path = tmp_path / "profile.json"
    save_profile(path, p)
    q = load_profile(path)
    assert q.to_dict() == p.to_dict()
    assert q.best_k_table() == p.best_k_by_batch
    assert json.loads(path.read_text())["version"] == 1


def test_profile_records_threads_and_warns_when_they_differ(tmp_path, caplog):
    p = synthetic([1, 2], lambda b, q: 0.01 * b, lambda b, k: 0.001, [0.5, 0.25], k_max=2)
    path = tmp_path / "profile.json"
    for threads, warns in ((torch.get_num_threads(), False), (torch.get_num_threads() + 3, True), (0, False)):
        p.threads = threads
        save_profile(path, p)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="quickdraft"):
            assert load_profile(path).threads == threads
        assert any("CPU threads" in r.getMessage() for r in caplog.records) == warns


def _valid() -> dict:
    return synthetic([1, 2], lambda b, q: 0.01 * b, lambda b, k: 0.001, [0.5, 0.25], k_max=2).to_dict()


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(version=2), "version must be 1"),
    (lambda d: d.pop("device"), "device must be a string"),
    (lambda d: d.update(batch_sizes=[2, 1]), "batch_sizes must be strictly increasing"),
    (lambda d: d.update(query_lengths=[2, 3, 4]), "query_lengths must start at 1"),
    (lambda d: d.update(target_step_s=[[0.01, 0.01, 0.01]]), "target_step_s must be 2 lists"),
    (lambda d: d["target_step_s"][0].__setitem__(0, -1.0), "positive numbers"),
    (lambda d: d["target_step_s"][0].__setitem__(0, "fast"), "target_step_s"),
    (lambda d: d["methods"]["draft"].update(acceptance_per_pos=[0.5, 1.5]), "acceptance_per_pos"),
    (lambda d: d["methods"]["draft"].update(acceptance_per_pos=[0.5]), "at least 2"),
    (lambda d: d["methods"]["draft"].update(ks=[1, 2, 3], propose_s=[[0.0] * 3] * 2,
                                            acceptance_per_pos=[0.5] * 3), "query_lengths stop at 3"),
    (lambda d: d["methods"]["draft"].update(alpha=None), "alpha must be a number"),
    (lambda d: d["methods"]["draft"].update(verify_q=[2]), "one entry per k"),
    (lambda d: d.update(methods=[]), "methods must be an object"),
    (lambda d: d.update(best_k={"draft": {"1": -1}}), "best_k"),
    (lambda d: d.update(context=-5), "context must be an integer"),
    (lambda d: d.update(threads="two"), "threads must be an integer"),
])
def test_malformed_profiles_are_clear_errors(tmp_path, edit, needle):
    data = _valid()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(QuickdraftError, match=needle) as info:
        load_profile(path)
    assert str(path) in str(info.value)
    with pytest.raises(QuickdraftError):
        save_profile(tmp_path / "never.json", data)
    assert not (tmp_path / "never.json").exists()


def test_unreadable_profiles(tmp_path):
    with pytest.raises(QuickdraftError, match="cannot read profile"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(QuickdraftError, match="not valid JSON"):
        load_profile(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(QuickdraftError, match="JSON object"):
        load_profile(tmp_path / "list.json")


# ---- measuring on the tiny pair ----------------------------------------------------------
