"""EAGLE-3: a one-layer head that drafts from the target's own hidden states (quickdraft.model.eagle3).

The engine hands the head the target's hidden states at three layers from the forwards it
runs anyway (prefill and every verify step, `add_hidden`): per row, the states of every
committed token but the last. Before drafting, the head catches up on the pairs (target
state at p, token at p + 1) it has not seen, in one forward over the batch (ragged rows
right-padded), which writes its own KV cache; the last pair's output gives the first
draft token. Each further draft token feeds the head's own output state back with the
token just drafted, one position on.

Only pairs built from target states stay in the head's cache: the positions drafting
writes are rewritten by the next catch-up with the target's states for the tokens that
were accepted (what EAGLE does).

q: the head's logits over its draft vocabulary, mapped into the target vocabulary (-inf
elsewhere), then the rows' temperature / top-k / top-p / min-p (process_logits): each draft
token is drawn from exactly the q handed to the verifier.

Chains only so far (EAGLE-2's dynamic trees are not built yet).
"""

from __future__ import annotations

import torch

from ..cache import KVCache, to_device
from ..errors import QuickdraftError
from ..model.eagle3 import Eagle3Head
from ..sampling import process_logits, race
from .base import Draft, ProposeBatch, Proposer, check_options, register


@register("eagle3")
class Eagle3Proposer(Proposer):
    OPTIONS = ()
    needs_draft_model = True
    draft_is_head = True  # LLM loads `draft` with quickdraft.model.eagle3.load_eagle3

    def __init__(self, head: Eagle3Head, vocab_size: int):
        self.head = head
        self.vocab_size = vocab_size
        self.hidden_layers = head.aux_layers  # the engine returns these target layers' states
        self.cache: KVCache | None = None
        self.cached: list[int] = []  # per row: positions of the head's cache built from target states
        self.pending: list[list[torch.Tensor]] = []  # per row: target states not yet fed to the head

    @classmethod
    def build(cls, *, target, draft=None, **options) -> Eagle3Proposer:
        if draft is None:
            raise QuickdraftError("method 'eagle3' needs an EAGLE-3 head folder (draft=...)")
        check_options("eagle3", options, cls.OPTIONS)
        return cls(draft, target.config.vocab_size, **options)

    # --- the engine's batch layout ------------------------------------------------------

    def reserve(self, max_slots: int, capacity: int) -> None:
        c = self.cache
        if c is None or c.max_slots < max_slots or c.capacity < capacity:
            self.cache = None
            cfg = self.head.config
            self.cache = KVCache(1, max_slots, cfg.num_key_value_heads, capacity, cfg.head_dim, self.head.dtype,
                                 self.head.device)
        self.cached = [0] * max_slots
        self.pending = [[] for _ in range(max_slots)]

    def start(self, row: int, prompt: list[int]) -> None:
        self.cached[row] = 0
        self.pending[row] = []

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst, self.cached[src])
        self.cached[dst] = self.cached[src]
        self.pending[dst], self.pending[src] = self.pending[src], []

    def finish(self, row: int, tokens: list[int], prompt_len: int) -> None:
        self.pending[row] = []

    def add_hidden(self, start: int, hidden: torch.Tensor, index: list[list[int]]) -> None:
        """Target states for the rows from `start` on: hidden (B, T, 3 x h), and per row the
        columns that are its next committed positions, in order."""
        for b, cols in enumerate(index):
            if cols:
                sel = hidden[b, :len(cols)] if cols == list(range(len(cols))) else hidden[b, to_device(cols, hidden.device)]
                self.pending[start + b].append(sel)

    # --- drafting ---------------------------------------------------------------------------

    def _catch_up(self, rows: list[list[int]]):
        """Feed each row the pairs it has not seen; the head's logits (B, draft V) and output
        state (B, h) after the last one."""
        B = len(rows)
        head, device = self.head, self.head.device
        feats = []
        for b, t in enumerate(rows):
            f = torch.cat(self.pending[b]) if len(self.pending[b]) != 1 else self.pending[b][0]
            if self.cached[b] + f.shape[0] != len(t) - 1:
                raise QuickdraftError(f"eagle3: row {b} has target states for {self.cached[b] + f.shape[0]} "
                                      f"positions, expected {len(t) - 1} (an engine bug)")
            feats.append(f)
        T = max(f.shape[0] for f in feats)
        ids = torch.zeros(B, T, dtype=torch.long)
        pos = torch.full((B, T), -1, dtype=torch.long)
        hidden = feats[0].new_zeros(B, T, feats[0].shape[-1])
        for b, (t, f, c) in enumerate(zip(rows, feats, self.cached)):
            n = f.shape[0]
            ids[b, :n] = torch.tensor(t[c + 1: c + 1 + n], dtype=torch.long)
            pos[b, :n] = torch.arange(c, c + n)
            hidden[b, :n] = f
        last = to_device([max(f.shape[0] - 1, 0) for f in feats], device)
        logits, out = head(to_device(ids, device), hidden, to_device(pos, device), self.cache.rows(0, B),
                           kv_len=max(len(t) for t in rows) - 1)
        rows_i = torch.arange(B, device=device)
        for b, t in enumerate(rows):
            self.cached[b] = len(t) - 1
            self.pending[b] = []
        return logits[rows_i, last], out[rows_i, last]

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> Draft:
        B, k = len(batch.tokens), batch.k
        logits, state = self._catch_up(batch.tokens)
        lengths = to_device([len(t) for t in batch.tokens], self.head.device)[:, None]
        kv_len = max(len(t) for t in batch.tokens) - 1
        sampling = batch.sampling
        noise = None
        if not sampling.all_greedy:  # every draw of the chain up front, keyed by row, position and depth
            noise = batch.random.draft_noise(k, self.vocab_size)
        tokens, probs = [], []
        for i in range(k):
            q = process_logits(self.head.to_target(logits, self.vocab_size), sampling)  # (B, V) float32
            x = q.argmax(-1) if noise is None else race(q, noise[:, i])
            tokens.append(x)
            probs.append(q)
            if i < k - 1:  # the last draft token is never fed: the target will judge it
                logits, state = self.head(x[:, None], state[:, None], lengths - 1 + i, self.cache.rows(0, B),
                                          kv_len=kv_len + 1 + i, project=False)
                logits, state = logits[:, 0], state[:, 0]
        return Draft(tokens=torch.stack(tokens, 1), probs=None if noise is None else torch.stack(probs, 1))
