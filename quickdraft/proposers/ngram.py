"""Prompt lookup decoding: propose what followed the last time the context's tail occurred.

Text that quotes or edits its own context (code, summaries, RAG answers) repeats long
spans of it. For each row we find the most recent earlier occurrence of the last n tokens
of prompt + output, trying n from `max_ngram` down to `min_ngram` (the longest n that
matches wins, then the most recent occurrence), and propose the tokens that followed it
(Saxena 2023, "prompt lookup decoding"; Yang et al. 2023, arXiv 2304.04487).

The continuation is read as a copy: proposed token j is the token at match + 1 + j of the
context extended by the proposal itself. When the match ends d tokens before the context
does (d = the distance between the two occurrences), the continuation runs into the
current tail and repeats with period d, so periodic text ("a b a b a b") and a match
right before the end still propose a full k tokens. That is exactly what later lookups
would propose if the copy held, so it costs nothing extra and the verifier decides.

With `num_candidates` > 1 the draft is a token tree: the continuations of up to that many
distinct matches (longer match first, then more recent) merged into a trie, siblings in
that order. A chain is the tree's first path, so trees only add options.

Each row's tokens live in a numpy buffer that grows with its commits (`RowTokens`), and
the search is vectorised: the positions holding the last token, then one compare per
earlier token of the n-gram over the surviving candidates.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import QuickdraftError
from .base import Draft, ProposeBatch, Proposer, check_int, check_options, merge_paths, register


class RowTokens:
    """One row's committed tokens in a numpy buffer grown by appends (amortised O(1))."""

    __slots__ = ("buf", "n")

    def __init__(self, tokens: Sequence[int]):
        self.n = len(tokens)
        self.buf = np.empty(max(64, 2 * self.n), dtype=np.int64)
        self.buf[: self.n] = tokens

    def sync(self, tokens: list[int]) -> np.ndarray:
        """Append the tokens committed since the last call; returns the (n,) view of all.
        Rows only grow between start()s; the cheap check below catches a missed start()
        only when the length or the last token we saw changed."""
        n, m = self.n, len(tokens)
        if m < n or (n and self.buf[n - 1] != tokens[n - 1]):  # not a continuation: start over
            self.__init__(tokens)
        elif m > n:
            if m > len(self.buf):
                grown = np.empty(2 * m, dtype=np.int64)
                grown[:n] = self.buf[:n]
                self.buf = grown
            self.buf[n:m] = tokens[n:m]
            self.n = m
        return self.buf[: self.n]


class TokenRows:
    """Lifecycle hooks for proposers that keep each row's tokens as `RowTokens`."""

    rows: dict[int, RowTokens]

    def start(self, row: int, prompt: list[int]) -> None:
        self.rows[row] = RowTokens(prompt)

    def move_row(self, src: int, dst: int) -> None:
        state = self.rows.pop(src, None)
        if state is None:
            self.rows.pop(dst, None)
        else:
            self.rows[dst] = state

    def finish(self, row: int, tokens: list[int], prompt_len: int) -> None:
        self.rows.pop(row, None)

    def row_tokens(self, row: int, tokens: list[int]) -> np.ndarray:
        """The row's tokens as an (n,) array, brought up to date with `tokens`."""
        state = self.rows.get(row)
        if state is None:  # a row never started (direct use): index it now
            state = self.rows[row] = RowTokens(tokens)
        return state.sync(tokens)


def tail_matches(buf: np.ndarray, min_len: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Earlier occurrences of the tail of `buf` (n,): the end positions p <= n - 2 (so at
    least one token follows) and the length L in [min_len, max_len] of the longest tail
    buf[n-L:] with buf[p-L+1 : p+1] equal to it. Both (M,) int64, p ascending."""
    n = len(buf)
    steps = min(max_len, n - 1)  # a match ending at p <= n - 2 is at most n - 1 long
    if steps < min_len:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    agree = buf[: n - 1] == buf[n - 1]  # (n-1,) candidates: where the last token occurs
    lengths = agree.astype(np.int64)  # (n-1,) match length ending at each position
    # Step j asks whether the token j before each candidate agrees too. While candidates
    # are many (repetitive text), whole-array compares beat gathers.
    j, count = 1, np.count_nonzero(agree)
    while j < steps and 8 * count > n:
        agree[j:] &= buf[: n - 1 - j] == buf[n - 1 - j]
        agree[:j] = False
        lengths += agree
        j, count = j + 1, np.count_nonzero(agree)
    alive = np.flatnonzero(agree)
    while j < steps and len(alive):
        before = alive - j
        alive = alive[(buf[before] == buf[n - 1 - j]) & (before >= 0)]  # before < 0 wraps: masked out
        lengths[alive] += 1
        j += 1
    pos = np.flatnonzero(lengths >= min_len)
    return pos, lengths[pos]


def continuations(buf: np.ndarray, ends: np.ndarray, k: int) -> np.ndarray:
    """(M, k) tokens that follow each end position, extended periodically past the end
    of `buf` (token j = buf[p + 1 + j mod d], d = n - 1 - p: the context copied onward)."""
    n = len(buf)
    index = ends[:, None] + 1 + np.arange(k)  # (M, k)
    short = np.flatnonzero(ends > n - 1 - k)  # period d < k: at most k - 1 rows (d is distinct)
    if len(short):
        period = (n - 1 - ends[short])[:, None]
        index[short] = ends[short][:, None] + 1 + np.arange(k) % period
    return buf[index]


@functools.cache
def row_hash_weights(k: int) -> np.ndarray:
    """(k,) fixed odd int64 weights: rows @ weights hashes rows of k tokens (wrapping)."""
    return np.random.default_rng(k).integers(1, 2**62, size=k, dtype=np.int64) | 1


@register("ngram")
class NgramProposer(TokenRows, Proposer):
    OPTIONS = ("min_ngram", "max_ngram", "num_candidates")

    def __init__(self, *, min_ngram: int = 2, max_ngram: int = 5, num_candidates: int = 1,
                 device: torch.device | str = "cpu"):
        check_int("min_ngram", min_ngram, 1)
        check_int("max_ngram", max_ngram, 1)
        check_int("num_candidates", num_candidates, 1)
        if max_ngram < min_ngram:
            raise QuickdraftError(f"max_ngram ({max_ngram}) must be >= min_ngram ({min_ngram})")
        self.min_ngram = min_ngram  # shortest tail that counts as a match
        self.max_ngram = max_ngram  # longest tail compared (longer matches rank the same)
        self.num_candidates = num_candidates  # 1 = chain; more = a tree of that many matches
        self.device = torch.device(device)
        self.rows: dict[int, RowTokens] = {}

    @classmethod
    def build(cls, *, target, draft=None, **options) -> NgramProposer:
        if draft is not None:
            raise QuickdraftError("method 'ngram' looks up the context and takes no draft model")
        check_options("ngram", options, cls.OPTIONS)
        return cls(**options, device=target.device)

    def max_draft_tokens(self, k: int) -> int:
        return self.num_candidates * k

    def propose_row(self, buf: np.ndarray, k: int) -> list[list[int]]:
        """Up to num_candidates distinct continuations (k tokens each), best first."""
        ends, lengths = tail_matches(buf, self.min_ngram, self.max_ngram)
        if len(ends) == 0:
            return []
        if self.num_candidates == 1:
            best = np.argmax(lengths * len(buf) + ends)  # longest, then most recent
            return continuations(buf, ends[best : best + 1], k).tolist()
        order = np.lexsort((-ends, -lengths))  # longest first, then most recent
        conts = continuations(buf, ends[order], k)  # (M, k)
        # Drop repeated continuations: rows with different hashes differ (a collision could
        # only hide a candidate), and one 1-D unique is far cheaper than unique(axis=0).
        _, first = np.unique(conts @ row_hash_weights(k), return_index=True)
        return conts[np.sort(first)[: self.num_candidates]].tolist()

    def propose(self, batch: ProposeBatch) -> Draft:
        rows = [self.row_tokens(b, toks) for b, toks in enumerate(batch.tokens)]  # (every row's kept in step)
        paths = [self.propose_row(row, batch.row_k(b)) if batch.row_k(b) > 0 else [] for b, row in enumerate(rows)]
        if self.num_candidates == 1:
            return Draft.chain([p[0] if p else [] for p in paths], self.device)
        return Draft.tree([merge_paths(p) for p in paths], self.device)
