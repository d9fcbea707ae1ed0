"""Lookahead decoding (Fu et al. 2024, arXiv 2402.02057) as a deterministic token tree.

Lookahead decoding needs no draft model. It runs Jacobi iteration on a window of guesses
for the positions right after the committed text, and harvests n-grams from the Jacobi
trajectory into a pool; pool entries that start with the last committed token are
proposed as candidates. Here both parts ride in the target's one tree forward per step:

- the **lookahead branch**: the window g_0 .. g_{W-1} (guesses for positions L .. L+W-1,
  L the committed length) as a chain under the root. Its outputs (the target's argmax
  after each node) are the next Jacobi iterate: the new guess for position L+j+1 is the
  output at window node j. The chain is verified like any other branch, so a converged
  window is accepted for free (plain Jacobi decoding).
- the **verification branches**: up to G pool continuations (N-1 tokens each) whose key
  is the last committed token, most recently collected first.

All of them are merged into one trie so siblings are distinct. Trie order: pool
candidates first (most recent first), then the window; the pool holds tokens the target
actually produced one after another, so it is the likelier branch (siblings are tried
in index order). Every path is cut at the step's depth bound k.

After the step, `observe` reads the target's argmax at every node (`wants_target_tokens`):
the window's outputs become the next window, shifted by the tokens the step committed,
and the missing tail is filled with tokens drawn from the committed text (the paper
initialises the window with random prompt tokens; ours come from a per-request seeded
RNG, so runs repeat exactly). The pool learns n-grams along the Jacobi diagonal: the
output at position p this step, after the input at p-1 this step, the input at p-2 one
step ago, ..., the input at p-N+1 N-2 steps ago. Each of those inputs is kept only when
it equals the previous step's output at its position, so every token of a collected
n-gram was produced by the target right after its predecessor in the n-gram. The pool
also learns the n-grams of the committed text as it grows (verified target output) and,
with `prompt_ngrams`, those of the prompt.

Defaults (W=5, N=5, G=4: at most 5 + 4*4 = 21 nodes at k >= 5) come from a greedy probe
of the bundled target on held-out stdlib openings at k=5: mean acceptance length 2.75 at
~10 nodes a step (N=4: 2.57; Jacobi alone, G=0: 1.04; either n-gram source alone: 2.3-2.6).

State is per row (window, the last N-2 iterations' inputs, the pool) and follows the
engine's rows through start / move_row / finish.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from ..errors import QuickdraftError
from .base import Draft, ProposeBatch, Proposer, TrieBuilder, VerifyResult, check_int, check_options, register

DEFAULTS = {
    "window": 5,  # W: Jacobi guesses per step (the lookahead chain; cut to the depth bound k)
    "ngram": 5,  # N: pool n-gram size: a key token + N-1 proposed tokens (the paper's 5)
    "guesses": 4,  # G: pool candidates per key (LRU) proposed each step
    "prompt_ngrams": False,  # also seed the pool with the prompt's n-grams (prompt lookup)
}
LIMITS = {"window": (1, 64), "ngram": (2, 16), "guesses": (0, 64)}
SEED = 0  # window fill RNG seed, per request


@dataclass
class _Iteration:
    """One step's lookahead chain: inputs at positions start, start+1, ... (root first)."""
    start: int  # position of the root (the last committed token)
    inputs: list[int]  # root, then the window nodes present in the tree
    linked: list[bool]  # input i equals the previous iteration's output at its position
    outputs: list[int] = field(default_factory=list)  # target argmax after input i (position start+1+i)


@dataclass
class _Row:
    rng: random.Random
    collected: int  # committed positions whose n-grams are already in the pool
    pool: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # key -> continuations, newest first
    history: deque[_Iteration] = field(default_factory=deque)  # the last N-2 observed iterations, oldest first
    last: _Iteration | None = None  # the last observed iteration: its outputs are the next window
    pending: _Iteration | None = None  # this step's chain, awaiting observe()
    window_nodes: list[int] = field(default_factory=list)  # tree node of each pending window entry


@register("lookahead")
class LookaheadProposer(Proposer):
    wants_target_tokens = True

    def __init__(self, window: int = DEFAULTS["window"], ngram: int = DEFAULTS["ngram"],
                 guesses: int = DEFAULTS["guesses"], prompt_ngrams: bool = DEFAULTS["prompt_ngrams"],
                 device="cpu"):
        for name, value in (("window", window), ("ngram", ngram), ("guesses", guesses)):
            check_int(f"lookahead option {name}", value, *LIMITS[name])
        if not isinstance(prompt_ngrams, bool):
            raise QuickdraftError(f"lookahead option prompt_ngrams must be true or false, got {prompt_ngrams!r}")
        self.window, self.ngram, self.guesses, self.prompt_ngrams = window, ngram, guesses, prompt_ngrams
        self.device = device
        self.rows: list[_Row | None] = []

    @classmethod
    def build(cls, *, target, draft=None, **options) -> LookaheadProposer:
        if draft is not None:
            raise QuickdraftError("method 'lookahead' uses no draft model: drop the draft model")
        check_options("lookahead", options, tuple(DEFAULTS))
        return cls(**options, device=target.device)

    def max_draft_tokens(self, k: int) -> int:
        return min(self.window, k) + self.guesses * min(self.ngram - 1, k)

    def may_draft_trees(self, k: int) -> bool:
        return True  # (the window and the pool's candidates in one trie, at any k)

    # -- rows -------------------------------------------------------------------------

    def reserve(self, max_slots: int, capacity: int) -> None:
        if len(self.rows) < max_slots:
            self.rows.extend([None] * (max_slots - len(self.rows)))

    def start(self, row: int, prompt: list[int]) -> None:
        self.reserve(row + 1, 0)
        # Without prompt n-grams, the first pooled one is the first whose continuation is all output.
        collected = 0 if self.prompt_ngrams else len(prompt) + self.ngram - 2
        self.rows[row] = _Row(random.Random(SEED), collected, history=deque(maxlen=self.ngram - 2))

    def move_row(self, src: int, dst: int) -> None:
        self.reserve(max(src, dst) + 1, 0)
        self.rows[dst], self.rows[src] = self.rows[src], None

    def finish(self, row: int, tokens: list[int], prompt_len: int) -> None:
        if row < len(self.rows):
            self.rows[row] = None

    def _row(self, b: int, tokens: list[int]) -> _Row:
        if b >= len(self.rows) or self.rows[b] is None:  # no start() seen: the whole text is the prompt
            self.start(b, tokens)
        return self.rows[b]

    # -- the pool ---------------------------------------------------------------------

    def _add(self, row: _Row, gram: list[int]) -> None:
        """Insert an n-gram (key + N-1 tokens) as the key's newest continuation (LRU, G per key)."""
        if self.guesses == 0:
            return
        key, cont = gram[0], tuple(gram[1:])
        conts = row.pool.setdefault(key, [])
        if cont in conts:
            conts.remove(cont)
        conts.insert(0, cont)
        del conts[self.guesses:]

    # -- the step ---------------------------------------------------------------------

    def propose(self, batch: ProposeBatch) -> Draft:
        return Draft.tree([self._propose_row(b, t, batch.row_k(b)) for b, t in enumerate(batch.tokens)], self.device)

    def _propose_row(self, b: int, text: list[int], k: int) -> tuple[list[int], list[int]]:
        row, N, L = self._row(b, text), self.ngram, len(text)
        for p in range(max(row.collected, N - 1), L):  # the committed text's new n-grams
            self._add(row, text[p - N + 1:p + 1])
        row.collected = max(row.collected, L)

        if row.pending is not None:  # proposed again without feedback: the trajectory broke
            row.history.clear()
            row.last = row.pending = None
        last = row.last  # its outputs are the next Jacobi iterate

        def previous(pos: int) -> int | None:
            i = pos - (last.start + 1) if last is not None else -1
            return last.outputs[i] if 0 <= i < len(last.outputs) else None

        m = min(self.window, k)
        inputs, linked = [text[-1]], [previous(L - 1) == text[-1]]
        for pos in range(L, L + m):
            guess = previous(pos)
            linked.append(guess is not None)
            inputs.append(guess if guess is not None else text[row.rng.randrange(L)])

        # One trie: pool candidates (newest first), then the window; siblings stay distinct.
        trie = TrieBuilder()
        for cont in row.pool.get(text[-1], ()):
            trie.add(cont[:k])
        row.window_nodes = trie.add(inputs[1:k + 1])
        row.pending = _Iteration(L - 1, inputs, linked)
        return trie.tokens, trie.parents

    def observe(self, result: VerifyResult) -> None:
        if result.target_tokens is None:
            raise QuickdraftError("lookahead needs the target's argmax at every draft node (target_tokens)")
        for b, out in enumerate(result.target_tokens):
            row = self.rows[b] if b < len(self.rows) else None
            if row is None or row.pending is None:
                continue
            it, row.pending = row.pending, None
            it.outputs = [out[0]] + [out[1 + n] for n in row.window_nodes]
            if self.guesses > 0:
                self._collect_diagonal(row, it)
            row.history.append(it)  # maxlen N-2 drops the oldest
            row.last = it

    def _collect_diagonal(self, row: _Row, it: _Iteration) -> None:
        """Pool the n-grams ending at each output of `it` along the Jacobi trajectory."""
        its = list(row.history) + [it]  # consecutive iterations, oldest first
        for i, out in enumerate(it.outputs):  # output at position p = it.start + 1 + i
            gram, s, j = [out, it.inputs[i]], len(its) - 1, i  # input at p-1 in iteration s
            while len(gram) < self.ngram:
                if s == 0 or not its[s].linked[j]:  # not the previous step's output: the diagonal breaks
                    break
                pos = its[s].start + j - 1  # the predecessor's position, one iteration back
                s -= 1
                j = pos - its[s].start
                if not 0 <= j < len(its[s].inputs):
                    break
                gram.append(its[s].inputs[j])
            if len(gram) == self.ngram:
                self._add(row, gram[::-1])
