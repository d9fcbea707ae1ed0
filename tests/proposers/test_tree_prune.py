"""Pruning a draft tree to its best nodes keeps a tree: a kept node's parent is always kept,
at any cumulative log-probability (ties broken exactly, not by a penalty float32 rounds away)."""

from __future__ import annotations

import torch

from quickdraft.proposers.draft_tree import prune
from quickdraft.proposers.eagle3 import _rerank


def random_trees(B: int, N: int, seed: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, scores) of B random trees of N nodes (a parent's index below its child's);
    roots score `base` minus a little, each child its parent's score plus log q <= 0, often
    exactly 0 or a value too small to change the float32 sum (ties between parent and child)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((B, N), -1, dtype=torch.long)
    scores = torch.empty(B, N, dtype=torch.float32)
    for b in range(B):
        for i in range(N):
            p = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
            parents[b, i] = p
            kind = int(torch.randint(0, 3, (1,), generator=g))
            step = [0.0, -1e-7, -float(torch.rand(1, generator=g)) * 0.5][kind]
            start = base - float(torch.rand(1, generator=g)) * 0.01 if p < 0 else float(scores[b, p])
            scores[b, i] = torch.tensor(start, dtype=torch.float32) + torch.tensor(step, dtype=torch.float32)
    return parents, scores


def eagle3_trees(B: int, k: int, w: int, seed: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's layout: w nodes per depth, depth by depth, each under a node of the depth above."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((B, k * w), -1, dtype=torch.long)
    scores = torch.full((B, k * w), base, dtype=torch.float32)
    for d in range(1, k):
        for j in range(w):
            i = d * w + j
            parents[:, i] = (d - 1) * w + torch.randint(0, w, (B,), generator=g)
            step = torch.where(torch.rand(B, generator=g) < 0.6, 0.0, -torch.rand(B, generator=g) * 1e-6)
            scores[:, i] = scores.gather(1, parents[:, i:i + 1])[:, 0] + step
    return parents, scores


def assert_tree(parents: torch.Tensor, new_parents: torch.Tensor, chosen_roots: torch.Tensor) -> None:
    # a node attached to the root after pruning must have been a root before
    assert ((new_parents >= 0) | chosen_roots).all(), "a kept node lost its parent (attached to the root)"
    idx = torch.arange(new_parents.shape[1])
    assert (new_parents < idx).all()


def test_prune_keeps_parents_at_low_log_probs():
    for base in (-16.0, -40.0, -1000.0):
        tokens_n = 24
        parents, scores = random_trees(100, tokens_n, seed=int(-base), base=base)
        tokens = torch.arange(tokens_n).repeat(100, 1)
        for keep in (3, 7, 12, 20):
            kept_tokens, new_parents = prune(tokens, parents, scores, keep)
            was_root = parents.gather(1, kept_tokens) < 0  # tokens are node indices here
            assert_tree(parents, new_parents, was_root)
            # the best `keep` scores are kept (ties aside): no dropped node outscores a kept one
            kept_scores = scores.gather(1, kept_tokens)
            dropped = torch.ones_like(scores, dtype=torch.bool).scatter_(1, kept_tokens, False)
            worst_kept = kept_scores.min(-1).values
            best_dropped = scores.masked_fill(~dropped, -float("inf")).max(-1).values
            assert (best_dropped <= worst_kept).all()


def test_eagle3_rerank_keeps_parents_at_low_log_probs():
    B, k, w = 500, 6, 4
    parents, scores = eagle3_trees(B, k, w, seed=5, base=-17.0)
    tokens = torch.arange(k * w).repeat(B, 1)
    for budget in (5, 9, 13):
        draft = _rerank(tokens, parents, scores, budget)
        was_root = parents.gather(1, draft.tokens) < 0
        assert_tree(parents, draft.parents, was_root)
