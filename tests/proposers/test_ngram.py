"""The n-gram (prompt lookup) proposer on small worked examples: no models needed."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from quickdraft.config import SpecConfig
from quickdraft.errors import QuickdraftError
from quickdraft.proposers import PROPOSERS, ProposeBatch
from quickdraft.proposers.ngram import NgramProposer, tail_matches
from quickdraft.sampling import BatchSampling, SamplingParams, StepRandom


def batch(rows: list[list[int]], k: int) -> ProposeBatch:
    return ProposeBatch(tokens=[list(r) for r in rows], k=k,
                        sampling=BatchSampling.build([SamplingParams(temperature=0)] * len(rows), "cpu"),
                        random=StepRandom([0] * len(rows), [len(r) for r in rows], "cpu"))


def chains(p: NgramProposer, rows: list[list[int]], k: int) -> list[list[int]]:
    draft = p.propose(batch(rows, k))
    assert draft.probs is None and draft.parents is None
    assert draft.tokens.shape[0] == len(rows) and draft.tokens.shape[1] <= k
    out = []
    for row in draft.tokens.tolist():
        n = row.index(-1) if -1 in row else len(row)
        assert all(t == -1 for t in row[n:])  # -1 ends a chain
        out.append(row[:n])
    return out


def chain(rows: list[int], k: int, **options) -> list[int]:
    return chains(NgramProposer(**options), [rows], k)[0]


def reference(tokens: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Brute force: the longest n, then the most recent occurrence, continuation copied."""
    n = len(tokens)
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        for end in range(n - 2, size - 2, -1):
            if tokens[end - size + 1 : end + 1] == tokens[n - size :]:
                seq = list(tokens)
                for j in range(k):
                    seq.append(seq[end + 1 + j])
                return seq[n:]
    return []


# ---------------------------------------------------------------------------- chains


def test_match_found():
    assert chain([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], k=3) == [4, 5, 9]


def test_no_match_proposes_nothing():
    draft = NgramProposer().propose(batch([[1, 2, 3, 4]], k=3))
    assert draft.tokens.shape[0] == 1 and (draft.tokens == -1).all()
    # The last token recurs, but min_ngram = 2 needs the one before it to agree too.
    assert chain([5, 1, 7, 1], k=3) == []
    assert chain([5, 1, 7, 1], k=2, min_ngram=1) == [7, 1]
    assert chain([1], k=3, min_ngram=1) == []
    assert chain([], k=3) == []


def test_longest_ngram_wins_over_recency():
    ctx = [7, 8, 9, 20, 21, 0, 8, 9, 30, 31, 7, 8, 9]
    assert chain(ctx, k=2) == [20, 21]  # "7 8 9" (older) beats "8 9" (newer)
    assert chain(ctx, k=2, max_ngram=2) == [30, 31]  # both are 2-grams now: the newer wins


def test_most_recent_occurrence_wins():
    assert chain([1, 2, 5, 1, 2, 6, 1, 2], k=1) == [6]
    assert chain([1, 2, 5, 1, 2, 6, 1, 2], k=3) == [6, 1, 2]


def test_periodic_match_extends_to_full_k():
    # The match overlaps the tail: the continuation repeats with the period.
    assert chain([1, 2, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
    assert chain([7, 7, 7], k=4) == [7, 7, 7, 7]
    assert chain([3, 1, 2, 3, 1, 2, 3], k=7, min_ngram=3) == [1, 2, 3, 1, 2, 3, 1]


def test_match_right_before_the_end_copies_onward():
    # Decision: a continuation that runs into the tail keeps copying (period 3 here), so a
    # match always proposes k tokens; this is what later lookups would propose anyway.
    assert chain([1, 2, 3, 1, 2], k=2) == [3, 1]
    assert chain([1, 2, 3, 1, 2], k=5) == [3, 1, 2, 3, 1]


def test_k_bounds_the_chain():
    ctx = list(range(10, 30)) + [10, 11]
    for k in (1, 3, 8):
        assert chain(ctx, k=k) == list(range(12, 12 + k))


def test_rows_are_independent():
    p = NgramProposer()
    rows = [[1, 2, 3, 1, 2], [4, 5, 6], [9, 8, 9, 8]]
    assert chains(p, rows, k=3) == [[3, 1, 2], [], [9, 8, 9]]


@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 1), (1, 3), (2, 5), (3, 4)])
def test_matches_brute_force_reference_as_rows_grow(min_ngram, max_ngram):
    rng = random.Random(min_ngram * 10 + max_ngram)
    for trial in range(20):
        vocab = rng.randrange(2, 6)
        seq = [rng.randrange(vocab) for _ in range(60)]
        p = NgramProposer(min_ngram=min_ngram, max_ngram=max_ngram)
        p.start(0, seq[:5])
        for n in range(5, len(seq), rng.randrange(1, 4)):  # commits of 1-3 tokens, like steps
            k = rng.randrange(1, 6)
            assert chains(p, [seq[:n]], k) == [reference(seq[:n], k, min_ngram, max_ngram)]


def test_tail_matches_reports_every_earlier_occurrence():
    ends, lengths = tail_matches(torch.tensor([1, 2, 9, 2, 1, 2]).numpy(), 1, 4)
    assert ends.tolist() == [1, 3] and lengths.tolist() == [2, 1]  # p = n - 1 (the tail) is never one
    ends, lengths = tail_matches(torch.tensor([4, 4, 4, 4]).numpy(), 2, 8)
    assert ends.tolist() == [1, 2] and lengths.tolist() == [2, 3]


# ---------------------------------------------------------------------------- row lifecycle


def test_move_row_and_restart():
    p = NgramProposer()
    a, b = [1, 2, 3, 1, 2], [5, 6, 7, 5, 6]
    p.start(0, a)
    p.start(1, b)
    assert chains(p, [a, b], k=2) == [[3, 1], [7, 5]]
    state = p.rows[1]
    p.finish(0, a, 3)
    p.move_row(1, 0)  # the engine compacts: row 1's request now lives in row 0
    assert p.rows == {0: state}
    b = b + [7, 8, 5, 6]  # it keeps growing from where it was
    assert chains(p, [b], k=2) == [[7, 8]]
    p.start(0, [9, 9])  # a new request in the same row starts over
    assert chains(p, [[9, 9]], k=2) == [[]]
    assert chains(p, [[9, 9, 9]], k=2) == [[9, 9]]
    p.finish(0, [9, 9, 9], 2)
    assert p.rows == {}


def test_row_that_changed_under_it_is_reindexed():
    p = NgramProposer()
    p.start(0, [1, 2, 3, 1, 2])
    assert chains(p, [[1, 2, 3, 1, 2]], k=1) == [[3]]
    # Not a continuation of what the row held (a start() the proposer missed): start over.
    assert chains(p, [[4, 5, 6, 4, 5]], k=1) == [[6]]


# ---------------------------------------------------------------------------- trees


def tree(rows: list[int], k: int, **options) -> tuple[list[int], list[int]]:
    draft = NgramProposer(**options).propose(batch([rows], k))
    assert draft.probs is None and draft.parents is not None
    tokens, parents = draft.tokens[0].tolist(), draft.parents[0].tolist()
    n = tokens.index(-1) if -1 in tokens else len(tokens)
    check_tree(tokens[:n], parents[:n], k)
    return tokens[:n], parents[:n]


def check_tree(tokens: list[int], parents: list[int], k: int) -> None:
    depth = []
    for i, parent in enumerate(parents):
        assert -1 <= parent < i  # a parent comes before its children
        depth.append(1 if parent == -1 else depth[parent] + 1)
        assert depth[i] <= k
    siblings = {}
    for t, parent in zip(tokens, parents):
        assert t not in siblings.setdefault(parent, set())  # deterministic: siblings distinct
        siblings[parent].add(t)


def test_tree_merges_distinct_matches_best_first():
    ctx = [1, 2, 3, 4, 1, 2, 3, 5, 9, 3, 6, 7, 1, 2, 3]
    # "1 2 3" ends at 6 (then 5 9) and at 2 (then 4 1); "3" alone ends at 9 (then 6 7).
    options = {"min_ngram": 1, "k": 2}
    assert tree(ctx, num_candidates=3, **options) == ([5, 9, 4, 1, 6, 7], [-1, 0, -1, 2, -1, 4])
    assert tree(ctx, num_candidates=2, **options) == ([5, 9, 4, 1], [-1, 0, -1, 2])
    assert tree(ctx, num_candidates=3, min_ngram=2, k=2) == ([5, 9, 4, 1], [-1, 0, -1, 2])
    # The first path is the chain draft.
    assert chain(ctx, **options) == [5, 9]


def test_tree_shares_prefixes_and_skips_repeats():
    ctx = [1, 2, 40, 41, 1, 2, 40, 42, 1, 2]
    assert tree(ctx, k=2, num_candidates=4) == ([40, 42, 41], [-1, 0, 0])
    # Periodic text: every match continues the same way, so one path.
    assert tree([1, 2, 1, 2, 1, 2], k=2, num_candidates=3) == ([1, 2], [-1, 0])
    assert tree([1, 2, 3], k=2, num_candidates=3) == ([], [])


def test_random_trees_are_well_formed():
    rng = random.Random(0)
    p = NgramProposer(min_ngram=1, max_ngram=3, num_candidates=4)
    for _ in range(100):
        rows = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
        for b, row in enumerate(rows):
            p.start(b, row)
        k = rng.randrange(1, 6)
        draft = p.propose(batch(rows, k))
        assert draft.tokens.shape[1] <= p.max_draft_tokens(k)
        for b in range(3):
            tokens, parents = draft.tokens[b].tolist(), draft.parents[b].tolist()
            n = tokens.index(-1) if -1 in tokens else len(tokens)
            assert all(t == -1 for t in tokens[n:])
            check_tree(tokens[:n], parents[:n], k)
            # Its first path (first children all the way down) is the chain draft.
            path, node = [], -1
            while node + 1 < n and parents[node + 1] == node:
                node += 1
                path.append(tokens[node])
            assert path == reference(rows[b], k, 1, 3)


# ---------------------------------------------------------------------------- options


def test_registered_and_built_from_options():
    assert PROPOSERS["ngram"] is NgramProposer
    SpecConfig(method="ngram", num_speculative_tokens=4, options={"max_ngram": 3}, policy="fixed")
    target = SimpleNamespace(device=torch.device("cpu"))
    p = NgramProposer.build(target=target, min_ngram=1, max_ngram=3, num_candidates=2)
    assert (p.min_ngram, p.max_ngram, p.num_candidates, p.device) == (1, 3, 2, torch.device("cpu"))
    assert p.max_draft_tokens(5) == 10
    default = NgramProposer.build(target=target)
    assert (default.min_ngram, default.max_ngram, default.num_candidates) == (2, 5, 1)
    assert default.max_draft_tokens(5) == 5


@pytest.mark.parametrize("options,message", [
    ({"min_ngram": 0}, "min_ngram must be an integer >= 1"),
    ({"min_ngram": 1.5}, "min_ngram must be an integer"),
    ({"max_ngram": True}, "max_ngram must be an integer"),
    ({"min_ngram": 4, "max_ngram": 3}, "max_ngram (3) must be >= min_ngram (4)"),
    ({"num_candidates": 0}, "num_candidates must be an integer >= 1"),
    ({"num_candidates": "2"}, "num_candidates must be an integer"),
    ({"n": 3}, "unknown ngram option(s) n; valid options: min_ngram, max_ngram, num_candidates"),
    ({"device": "cpu"}, "unknown ngram option(s) device"),
])
def test_invalid_options(options, message):
    with pytest.raises(QuickdraftError) as err:
        NgramProposer.build(target=SimpleNamespace(device="cpu"), **options)
    assert message in str(err.value)


def test_no_draft_model():
    with pytest.raises(QuickdraftError, match="takes no draft model"):
        NgramProposer.build(target=SimpleNamespace(device="cpu"), draft=object())
