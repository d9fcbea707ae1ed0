"""The suffix-decoding proposer on small worked examples: no models needed."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from quickdraft.config import SpecConfig
from quickdraft.errors import QuickdraftError
from quickdraft.proposers import PROPOSERS, ProposeBatch
from quickdraft.proposers.ngram import tail_matches
from quickdraft.proposers.suffix import CountTrie, SuffixProposer, grow, local_children
from quickdraft.sampling import BatchSampling, SamplingParams, StepRandom


def batch(rows: list[list[int]], k: int) -> ProposeBatch:
    return ProposeBatch(tokens=[list(r) for r in rows], k=k,
                        sampling=BatchSampling.build([SamplingParams(temperature=0)] * len(rows), "cpu"),
                        random=StepRandom([0] * len(rows), [len(r) for r in rows], "cpu"))


def check_tree(tokens: list[int], parents: list[int], k: int) -> None:
    depth = []
    for i, parent in enumerate(parents):
        assert -1 <= parent < i  # a parent comes before its children
        depth.append(1 if parent == -1 else depth[parent] + 1)
        assert depth[i] <= k
    siblings: dict[int, set[int]] = {}
    for t, parent in zip(tokens, parents):
        assert t not in siblings.setdefault(parent, set())  # deterministic: siblings distinct
        siblings[parent].add(t)


def trees(p: SuffixProposer, rows: list[list[int]], k: int) -> list[tuple[list[int], list[int]]]:
    draft = p.propose(batch(rows, k))
    assert draft.probs is None and draft.parents is not None
    assert draft.tokens.shape[1] <= p.max_draft_tokens(k)
    out = []
    for b in range(len(rows)):
        tokens, parents = draft.tokens[b].tolist(), draft.parents[b].tolist()
        n = tokens.index(-1) if -1 in tokens else len(tokens)
        assert all(t == -1 for t in tokens[n:])
        check_tree(tokens[:n], parents[:n], k)
        out.append((tokens[:n], parents[:n]))
    return out


def tree(context: list[int], k: int, **options) -> tuple[list[int], list[int]]:
    return trees(SuffixProposer(**options), [context], k)[0]


def chain(context: list[int], k: int, **options) -> list[int]:
    p = SuffixProposer(tree=False, **options)
    draft = p.propose(batch([context], k))
    assert draft.probs is None and draft.parents is None
    assert draft.tokens.shape[1] <= min(k, p.max_draft_tokens(k))
    row = draft.tokens[0].tolist()
    return row[: row.index(-1)] if -1 in row else row


# ---------------------------------------------------------------------------- this request


# "1 2" occurred three times: followed by 3 (at 2 and 8) and by 4 (at 5).
FREQ = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2]


def test_frequency_orders_siblings():
    # A 2-token match buys 2 nodes: 3 (score 2/3) then 4 (1/3), likelier first.
    assert tree(FREQ, k=3) == ([3, 4], [-1, -1])
    # With more budget: below 3 come 9 (seen at 9) and 1 (at 3), equally often: the most
    # recent first; each scores 2/3 * 1/2, tied with 4 (pushed earlier, so it comes first).
    assert tree(FREQ, k=3, max_spec_offset=2) == ([3, 4, 9, 1], [-1, -1, 0, 0])
    assert chain(FREQ, k=3) == [3, 9]  # the likeliest child at each step


def test_min_token_prob_prunes_unlikely_continuations():
    # "5 6" was followed by 11 different tokens once each: each scores 1/11 < 0.1.
    context = [t for x in range(20, 31) for t in (5, 6, x)] + [5, 6]
    assert tree(context, k=3) == ([], [])
    tokens, parents = tree(context, k=3, min_token_prob=0.05)
    assert parents == [-1, -1] and tokens == [30, 29]  # most recent first among equals


def test_budget_grows_with_match_length():
    a = list(range(100, 120))  # 20 distinct tokens
    for m in (1, 2, 4, 7):
        context = a + [50] + a[:m]
        assert tree(context, k=16) == (a[m : 2 * m], list(range(-1, m - 1)))
        assert chain(context, k=16) == a[m : 2 * m]
    # factor and offset: ceil(0.5 * 4 + 1) = 3 nodes for a 4-token match; max_spec_tokens caps it
    context = a + [50] + a[:4]
    assert chain(context, k=16, max_spec_factor=0.5, max_spec_offset=1) == a[4:7]
    assert chain(context, k=16, max_spec_tokens=2) == a[4:6]
    assert chain(context, k=16, max_spec_offset=-4) == []


def test_k_and_trie_depth_bound_the_speculation():
    a = list(range(100, 120))
    context = a + [50] + a[:7]
    assert chain(context, k=3) == a[7:10]
    assert tree(context, k=3) == (a[7:10], [-1, 0, 1])
    # A 7-token match in a depth-9 trie leaves room for 2 more tokens.
    assert chain(context, k=16, max_tree_depth=9, max_match=8) == a[7:9]
    # max_match caps the match (the last 3 tokens), so the budget too.
    assert chain(context, k=16, max_match=3) == a[7:10]


def test_no_match_and_the_current_tail_is_not_a_match():
    assert tree([1, 2, 3, 4], k=3) == ([], [])
    assert tree([], k=3) == ([], [])
    assert tree([7], k=3) == ([], [])
    assert tree([7, 7], k=3) == ([7], [-1])  # "7" occurred before, followed by 7


def test_periodic_context():
    tokens, parents = tree([1, 2] * 10, k=4)
    assert tokens == [1, 2, 1, 2] and parents == [-1, 0, 1, 2]


def test_implicit_local_trie_matches_an_explicit_trie():
    """The per-request store reads the trie's answers off the token buffer: same match
    length and the same nodes and scores as a CountTrie of the context."""
    rng = random.Random(0)
    for _ in range(200):
        vocab, depth, max_match = rng.randrange(2, 5), rng.randrange(3, 9), rng.randrange(1, 6)
        max_match = min(max_match, depth - 1)
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        k, min_prob = rng.randrange(1, 6), rng.choice([0.0, 0.1, 0.3])
        ends, lengths = tail_matches(np.array(context), 1, max_match)
        trie = CountTrie(depth)
        trie.add(context)
        m, node = trie.longest_match(context, max_match)
        assert m == (int(lengths.max()) if len(ends) else 0)
        if m == 0:
            continue
        limit = min(k, depth - m)
        local = grow(ends[lengths == m], local_children(np.array(context), context), 10**6, limit, min_prob, True)
        explicit = grow(node, trie.children, 10**6, limit, min_prob, True)
        # Unbounded budget: every node scoring >= min_prob, whatever the sibling order.
        assert paths(local) == paths(explicit)
        assert local[2] == pytest.approx(explicit[2])


def paths(spec: tuple[list[int], list[int], float]) -> set[tuple[int, ...]]:
    tokens, parents, _ = spec
    path_of: list[tuple[int, ...]] = []
    for t, parent in zip(tokens, parents):
        path_of.append((path_of[parent] if parent >= 0 else ()) + (t,))
    return set(path_of)


def test_tree_scores_multiply_down_the_tree():
    tokens, parents, score = grow(np.array([1, 4, 7]), local_children(np.array(FREQ), FREQ), 4, 3, 0.1, True)
    assert (tokens, parents) == ([3, 4, 9, 1], [-1, -1, 0, 0])
    assert score == pytest.approx(2 / 3 + 1 / 3 + 1 / 3 + 1 / 3)


def test_rows_and_lifecycle():
    p = SuffixProposer(global_max_tokens=0)
    a, b = [1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6]
    p.start(0, a)
    p.start(1, b)
    assert trees(p, [a, b, [9]], k=4) == [([3, 1], [-1, 0]), ([7, 8], [-1, 0]), ([], [])]
    state = p.rows[1]
    p.finish(0, a, 3)
    p.move_row(1, 0)  # the engine compacts: row 1's request now lives in row 0
    assert p.rows == {0: state, 2: p.rows[2]}
    p.finish(2, [9], 1)
    assert set(p.rows) == {0}
    b = b + [7, 8, 9, 5, 6]  # it keeps growing: "5 6" came twice, followed by "7 8" both times
    assert trees(p, [b], k=4) == [([7, 8], [-1, 0])]
    p.start(0, [4, 4])  # a new request in the same row starts over
    assert trees(p, [[4, 4]], k=4) == [([4], [-1])]
    p.finish(0, [4, 4], 2)
    assert p.rows == {}


# ---------------------------------------------------------------------------- earlier requests


def test_global_trie_serves_a_request_that_repeats_an_earlier_output():
    p = SuffixProposer()
    prompt, output = [1000, 1001, 1002], list(range(10, 30))
    p.start(0, prompt)
    p.finish(0, prompt + output, len(prompt))
    assert p.held_tokens == 20 and p.global_nodes > 0
    # A new request (its context unlike anything it holds itself) starts writing the same output.
    context = [2000, 2001, 2002] + output[:5]
    p.start(0, context)
    assert trees(p, [context], k=8) == [(output[5:10], [-1, 0, 1, 2, 3])]
    assert p.speculate_local(p.rows[0].sync(context), context, 8) == ([], [], 0.0)
    # Prompts are not remembered, only outputs.
    p.start(0, [1000, 1001])
    assert trees(p, [[1000, 1001]], k=8) == [([], [])]
    # Without a global trie nothing is remembered.
    q = SuffixProposer(global_max_tokens=0)
    q.finish(0, prompt + output, len(prompt))
    assert q.held_tokens == 0 and q.global_nodes == 0
    assert trees(q, [context], k=8) == [([], [])]
    # Forgetting the finished requests (benchmarks, between runs of a workload) empties the global trie.
    p.forget_requests()
    assert p.held_tokens == 0 and p.global_nodes == 0
    p.start(0, context)
    assert trees(p, [context], k=8) == [([], [])]


def test_the_higher_scoring_store_wins():
    p = SuffixProposer()
    # Earlier outputs: after "1 2 3", 7 three times (and nothing after 7).
    for _ in range(3):
        p.finish(0, [1, 2, 3, 7], 0)
    # This request: after "1 2 3" came 8 once and 9 once, then 1 each time.
    context = [1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 3]
    p.start(0, context)

    def speculate(k):
        return p.speculate_local(p.rows[0].sync(context), context, k), p.speculate_global(context, k)

    local, other = speculate(2)
    assert local == ([9, 8, 1], [-1, -1, 0], pytest.approx(1.5)) and other == ([7], [-1], pytest.approx(1.0))
    assert trees(p, [context], k=2) == [([9, 8, 1], [-1, -1, 0])]
    local, other = speculate(1)
    assert local[2] == pytest.approx(1.0) and other[2] == pytest.approx(1.0)
    assert trees(p, [context], k=1) == [([9, 8], [-1, -1])]  # a tie goes to this request
    p.finish(0, [1, 2, 3, 7, 5], 0)  # now 7 then 5: global [7, 5] scores 2
    p.start(0, context)
    assert trees(p, [context], k=2) == [([7, 5], [-1, 0])]


def test_global_memory_bound_and_counts_after_eviction():
    depth, bound = 6, 300
    p = SuffixProposer(max_tree_depth=depth, max_match=3, global_max_tokens=bound)
    rng = random.Random(0)
    outputs = []
    for i in range(120):
        output = [rng.randrange(8) for _ in range(rng.randrange(1, 70))]
        p.finish(0, [99] * 3 + output, 3)
        outputs.append(output)
        assert p.held_tokens <= bound
        assert p.global_nodes <= p.held_tokens * depth
        if i % 10 == 9:  # the trie holds exactly the windows of the outputs it kept
            fresh = CountTrie(depth)
            held = sum((list(x) for x in p.held), [])
            assert [list(x) for x in p.held] == outputs[len(outputs) - len(p.held):]
            assert p.held_tokens == len(held)
            for output in p.held:
                fresh.add(output)
            assert p.trie.windows() == fresh.windows()
            assert p.global_nodes == fresh.num_nodes == len(fresh.windows())
    # An output longer than the bound keeps its end.
    long_output = [rng.randrange(1000) for _ in range(bound + 50)]
    p.finish(0, long_output, 0)
    assert [list(x) for x in p.held] == [long_output[-bound:]] and p.held_tokens == bound
    assert p.global_nodes <= bound * depth


def test_count_trie_counts_windows():
    trie = CountTrie(3)
    trie.add([1, 2, 1, 2])
    assert trie.windows() == {(1,): 2, (1, 2): 2, (1, 2, 1): 1, (2,): 2, (2, 1): 1, (2, 1, 2): 1}
    trie.add([1, 3])
    assert trie.windows()[(1,)] == 3 and trie.windows()[(1, 3)] == 1
    assert trie.children(trie.find([1]))[0] == [(2, 2, trie.find([1, 2])), (3, 1, trie.find([1, 3]))]
    trie.remove([1, 2, 1, 2])
    assert trie.windows() == {(1,): 1, (1, 3): 1, (3,): 1} and trie.num_nodes == 3
    assert trie.longest_match([5, 1], 2) == (1, trie.find([1]))
    assert trie.longest_match([5, 3], 2)[0] == 0  # "3" never had a continuation
    with pytest.raises(ValueError):
        trie.remove([4])


# ---------------------------------------------------------------------------- options


def test_registered_and_built_from_options():
    assert PROPOSERS["suffix"] is SuffixProposer
    SpecConfig(method="suffix", num_speculative_tokens=4, options={"tree": False}, policy="fixed")
    target = SimpleNamespace(device=torch.device("cpu"))
    p = SuffixProposer.build(target=target, max_spec_tokens=8, tree=False)
    assert (p.max_spec_tokens, p.tree) == (8, False)
    assert p.max_draft_tokens(5) == 5 and p.max_draft_tokens(12) == 8
    default = SuffixProposer.build(target=target)
    assert (default.max_tree_depth, default.max_match, default.max_spec_tokens, default.max_spec_factor,
            default.max_spec_offset, default.min_token_prob, default.global_max_tokens, default.tree) == \
        (24, 16, 16, 1.0, 0.0, 0.1, 200_000, True)
    assert default.max_draft_tokens(5) == 16
    assert SuffixProposer(max_spec_factor=0.5, max_spec_offset=1.5).max_draft_tokens(5) == math.ceil(9.5)


@pytest.mark.parametrize("options,message", [
    ({"max_tree_depth": 1}, "max_tree_depth must be an integer >= 2"),
    ({"max_match": 0}, "max_match must be an integer >= 1"),
    ({"max_match": 24}, "max_match (24) must be < max_tree_depth (24)"),
    ({"max_spec_tokens": 0}, "max_spec_tokens must be an integer >= 1"),
    ({"max_spec_factor": -1.0}, "max_spec_factor must be >= 0"),
    ({"max_spec_factor": float("nan")}, "max_spec_factor must be a finite number"),
    ({"max_spec_offset": "1"}, "max_spec_offset must be a finite number"),
    ({"min_token_prob": 1.5}, "min_token_prob must be in [0, 1]"),
    ({"global_max_tokens": -1}, "global_max_tokens must be an integer >= 0"),
    ({"tree": 1}, "tree must be true or false"),
    ({"depth": 3}, "unknown suffix option(s) depth; valid options: max_tree_depth"),
])
def test_invalid_options(options, message):
    with pytest.raises(QuickdraftError) as err:
        SuffixProposer.build(target=SimpleNamespace(device="cpu"), **options)
    assert message in str(err.value)


def test_no_draft_model():
    with pytest.raises(QuickdraftError, match="takes no draft model"):
        SuffixProposer.build(target=SimpleNamespace(device="cpu"), draft=object())
