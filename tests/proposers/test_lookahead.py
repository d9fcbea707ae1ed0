"""Lookahead proposer: tree shape, Jacobi iteration, the n-gram pool, row moves.

No model: a deterministic "target" is a function next(prefix) -> token. The harness plays
the engine: it asks for a tree, computes the target's argmax after the root and after
every node along the node's ancestor path, accepts the greedy path, commits it plus the
bonus token and feeds the result back through observe().
"""

from __future__ import annotations

import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.proposers import PROPOSERS
from quickdraft.proposers.base import ProposeBatch, VerifyResult
from quickdraft.proposers.lookahead import LookaheadProposer


class FakeTarget:
    device = "cpu"


def check_tree(tokens: list[int], parents: list[int], k: int) -> list[int]:
    """Assert the Draft tree rules; return the depth of each node (0 for unused ones)."""
    depth, seen = [0] * len(tokens), set()
    for i, (t, p) in enumerate(zip(tokens, parents)):
        assert -1 <= p < i
        if t < 0:
            continue
        assert p == -1 or tokens[p] >= 0
        assert (p, t) not in seen, "siblings must be distinct"
        seen.add((p, t))
        depth[i] = 1 if p == -1 else depth[p] + 1
        assert depth[i] <= k
    return depth


def step(prop: LookaheadProposer, texts: list[list[int]], k: int, f, drafts: list | None = None) -> list[int]:
    """One engine step on every row; commits in place; returns accepted counts (drafts: a log)."""
    draft = prop.propose(ProposeBatch(texts, k, None, []))
    assert draft.probs is None and draft.parents is not None
    if drafts is not None:
        drafts.append((draft.tokens.tolist(), draft.parents.tolist()))
    width = draft.tokens.shape[1]
    assert width <= max(1, prop.max_draft_tokens(k))
    accepted, prev, paths, targets = [], [], [], []
    for b, text in enumerate(texts):
        tokens, parents = draft.tokens[b].tolist(), draft.parents[b].tolist()
        check_tree(tokens, parents, k)

        def path(i):
            return [] if i == -1 else path(parents[i]) + [tokens[i]]

        tt = [f(text)] + [f(text + path(i)) if tokens[i] >= 0 else 0 for i in range(width)]
        node, nodes = -1, []
        while True:  # greedy: follow the first child equal to the target's argmax
            want = tt[0] if node == -1 else tt[1 + node]
            nxt = next((i for i in range(width) if parents[i] == node and tokens[i] == want), None)
            if nxt is None:
                break
            node = nxt
            nodes.append(node)
        prev.append(len(text))
        text.extend(tokens[i] for i in nodes)
        text.append(tt[0] if node == -1 else tt[1 + node])  # the bonus token
        accepted.append(len(nodes))
        paths.append(nodes)
        targets.append(tt)
    prop.observe(VerifyResult(accepted, prev, k, accepted_nodes=paths, target_tokens=targets))
    return accepted


def greedy(f, prompt: list[int], n: int) -> list[int]:
    text = list(prompt)
    while len(text) < len(prompt) + n:
        text.append(f(text))
    return text


def run(prop, f, prompts, k, n):
    """Generate n tokens (or a few more, cut) per prompt; return texts, steps, accepted."""
    texts = [list(p) for p in prompts]
    for b, p in enumerate(texts):
        prop.start(b, list(p))
        p.append(f(p))  # the prefill's token
    steps = accepted = 0
    while min(len(t) - len(p) for t, p in zip(texts, prompts)) < n:
        accepted += sum(step(prop, texts, k, f))
        steps += 1
    return [t[:len(p) + n] for t, p in zip(texts, prompts)], steps, accepted


def mix(text):  # depends on the last three tokens: long, non-trivial orbits over 50 tokens
    return (text[-1] * 31 + text[-2] * 17 + text[-3] * 7 + 3) % 50


def bigram(text):  # a function of the last token only: every orbit is a cycle
    return (text[-1] * 7 + 3) % 23


def test_registered_and_options():
    assert PROPOSERS["lookahead"] is LookaheadProposer
    p = LookaheadProposer.build(target=FakeTarget())
    assert (p.window, p.ngram, p.guesses, p.prompt_ngrams) == (5, 5, 4, False)
    assert p.max_draft_tokens(5) == 5 + 4 * 4 and p.max_draft_tokens(3) == 3 + 4 * 3
    assert p.wants_target_tokens and not p.needs_draft_model
    p = LookaheadProposer.build(target=FakeTarget(), window=7, ngram=3, guesses=2)
    assert p.max_draft_tokens(10) == 7 + 2 * 2
    assert p.max_draft_tokens(1) == 1 + 2 * 1
    for bad in ({"window": 0}, {"ngram": 1}, {"guesses": -1}, {"window": 2.5}, {"ngram": True},
                {"prompt_ngrams": 1}, {"widow": 3}):
        with pytest.raises(QuickdraftError):
            LookaheadProposer.build(target=FakeTarget(), **bad)
    with pytest.raises(QuickdraftError, match="draft model"):
        LookaheadProposer.build(target=FakeTarget(), draft=object())


@pytest.mark.parametrize("opts,k", [({}, 5), ({}, 2), ({"window": 3, "ngram": 2, "guesses": 6}, 4),
                                    ({"window": 8, "ngram": 5, "guesses": 0}, 8), ({"ngram": 6}, 1)])
def test_greedy_identity_and_tree_rules(opts, k):
    prop = LookaheadProposer(**opts)
    prompts = [[1, 2, 3, 4, 5], [9, 9, 9], [7, 3, 11, 2, 40, 13, 0]]
    texts, steps, accepted = run(prop, mix, prompts, k, 60)
    assert texts == [greedy(mix, p, 60) for p in prompts]
    for row in prop.rows[:3]:
        assert all(len(c) <= prop.guesses for c in row.pool.values())
        assert all(len(c) == prop.ngram - 1 for conts in row.pool.values() for c in conts)


def test_pool_learns_a_repetitive_target():
    # window 1: Jacobi alone can accept at most one token a step, so longer runs come from the pool.
    prop = LookaheadProposer(window=1, ngram=4, guesses=4)
    prompt = [5, 6, 7]
    texts, steps, accepted = run(prop, bigram, [prompt], 5, 120)
    assert texts == [greedy(bigram, prompt, 120)]
    assert 120 / steps > 2.0  # mean acceptance length
    assert accepted > steps


def test_diagonal_ngrams_are_target_output():
    # With a bigram target, a pooled n-gram is genuine iff each token is next() of the one before.
    # The committed text's n-grams are left out here: only the Jacobi diagonal fills the pool.
    prop = LookaheadProposer(window=6, ngram=4, guesses=8)
    prompt = [0, 1, 2, 3]
    prop.start(0, prompt)
    prop.rows[0].collected = 10**9
    texts = [prompt + [bigram(prompt)]]
    for _ in range(12):
        step(prop, texts, 6, bigram)
    grams = [(key, *c) for key, conts in prop.rows[0].pool.items() for c in conts]
    assert len(grams) >= 10
    for g in grams:
        assert all(g[i + 1] == bigram([g[i]]) for i in range(len(g) - 1)), g


def test_sampled_commits():
    # At temperature > 0 the committed token need not be the target's argmax; the Jacobi
    # state must cope (trees stay valid, windows realign to the committed length).
    import random
    rng = random.Random(1)
    prop = LookaheadProposer(window=4, ngram=3, guesses=3)
    texts = [[1, 2, 3], [4, 5, 6, 7]]
    for b, t in enumerate(texts):
        prop.start(b, list(t))
        t.append(mix(t))
    for _ in range(30):
        step(prop, texts, 4, mix)
        for t in texts:
            if rng.random() < 0.5:
                t[-1] = rng.randrange(50)  # the sampled bonus / recovered token
    assert all(len(t) > 30 for t in texts)


def test_prompt_ngrams_seed_the_pool():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    f = lambda t: 0  # noqa: E731
    with_prompt, without = LookaheadProposer(ngram=4, prompt_ngrams=True), LookaheadProposer(ngram=4)
    for prop in (with_prompt, without):
        text = prompt + [f(prompt)]
        prop.start(0, prompt)
        prop.propose(ProposeBatch([text], 5, None, []))
    assert with_prompt.rows[0].pool[1] == [(5, 9, 2), (4, 1, 5)]  # newest first
    assert 1 not in without.rows[0].pool


def test_pool_is_lru_bounded():
    prop = LookaheadProposer(guesses=3, ngram=3)
    prop.start(0, [0])
    row = prop.rows[0]
    for g in ([1, 2, 3], [1, 4, 5], [1, 6, 7], [1, 2, 3], [1, 8, 9], [2, 0, 0]):
        prop._add(row, g)
    assert row.pool[1] == [(8, 9), (2, 3), (6, 7)]
    assert row.pool[2] == [(0, 0)]
    # Candidates for the last committed token come first in the tree, newest first; the window last.
    draft = prop.propose(ProposeBatch([[0, 1]], 5, None, []))
    tokens, parents = draft.tokens[0].tolist(), draft.parents[0].tolist()
    roots = [t for t, p in zip(tokens, parents) if p == -1 and t >= 0]
    assert roots[:3] == [8, 2, 6]
    assert len(tokens) <= prop.max_draft_tokens(5)


def test_jacobi_window_is_the_last_iterate():
    # The window for the next step is the target's output at each window node, shifted.
    prop = LookaheadProposer(window=4, ngram=2, guesses=0)
    text = [10, 11, 12]
    prop.start(0, text[:2])
    draft = prop.propose(ProposeBatch([text], 4, None, []))
    assert draft.parents[0].tolist() == [-1, 0, 1, 2]  # guesses=0: the window alone, a chain
    # Nothing accepted: commit 20 (the root's output); outputs 21..24 at the window nodes.
    prop.observe(VerifyResult([0], [3], 4, [[]], [[20, 21, 22, 23, 24]]))
    draft = prop.propose(ProposeBatch([text + [20]], 4, None, []))
    assert draft.tokens[0].tolist()[:3] == [21, 22, 23]  # positions 4, 5, 6; the tail is filled
    # Two accepted (21, 22), bonus 33: the next window starts at position 7 with the output there.
    prop.observe(VerifyResult([2], [4], 4, [[0, 1]], [[21, 22, 33, 34, 35]]))
    draft = prop.propose(ProposeBatch([text + [20, 21, 22, 33]], 4, None, []))
    assert draft.tokens[0].tolist()[:2] == [34, 35]


def test_depth_bound_cuts_every_branch():
    prop = LookaheadProposer(window=5, ngram=5, guesses=2)
    prop.start(0, [0])
    prop._add(prop.rows[0], [1, 2, 3, 4, 5])
    for k in (1, 2, 3):
        draft = prop.propose(ProposeBatch([[0, 1]], k, None, []))
        depth = check_tree(draft.tokens[0].tolist(), draft.parents[0].tolist(), k)
        assert max(depth) == k


def test_rows_follow_move_row():
    prompts = [[1, 2, 3, 4, 5], [7, 3, 11, 2, 40, 13, 0]]
    moved, alone = LookaheadProposer(), LookaheadProposer()
    texts = [list(p) for p in prompts]
    for b, t in enumerate(texts):
        moved.start(b, list(t))
        t.append(mix(t))
    solo = [list(texts[1])]
    alone.start(0, list(prompts[1]))
    for _ in range(4):
        step(moved, texts, 4, mix)
        step(alone, solo, 4, mix)
    assert texts[1] == solo[0]
    moved.finish(0, texts[0], len(prompts[0]))
    moved.move_row(1, 0)
    assert moved.rows[1] is None
    texts = [texts[1]]
    log_moved, log_alone = [], []
    for _ in range(6):  # the moved row proposes exactly what it would have proposed unmoved
        step(moved, texts, 4, mix, log_moved)
        step(alone, solo, 4, mix, log_alone)
    assert log_moved == log_alone
    assert texts[0] == solo[0] == greedy(mix, prompts[1], len(texts[0]) - len(prompts[1]))
