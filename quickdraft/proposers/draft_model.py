"""A small draft model that shares the target's vocabulary.

It keeps its own KV cache in the engine's row layout. `cached[b]` counts the positions
of row b its cache holds; before proposing, the draft catches up on the committed tokens
it has not seen (the whole prompt at first, then one token, or two when all k drafts were
accepted and the bonus token followed its own unseen last draft). It then samples k tokens
one at a time with the rows' sampling parameters, keeping q exactly as sampled from.
"""

from __future__ import annotations

import torch

from ..cache import KVCache
from ..model.transformer import Transformer, forward_chunks
from ..sampling import process_logits, sample
from .base import Draft, ProposeBatch, Proposer, VerifyResult, register


@register("draft")
class DraftModelProposer(Proposer):
    def __init__(self, model: Transformer):
        self.model = model
        self.cache: KVCache | None = None
        self.cached: list[int] = []

    def reserve(self, max_slots: int, capacity: int) -> None:
        c = self.cache
        if c is None or c.max_slots < max_slots or c.capacity < capacity:
            self.cache = None  # free the old one first
            self.cache = KVCache.for_model(self.model, max_slots, capacity)
        self.cached = [0] * max_slots

    def start(self, row: int, prompt: list[int]) -> None:
        self.cached[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst, self.cached[src])
        self.cached[dst] = self.cached[src]

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> Draft:
        B, k = len(batch.tokens), batch.k
        view = self.cache.rows(0, B)
        lengths = [len(t) for t in batch.tokens]
        pending = [t[c:] for t, c in zip(batch.tokens, self.cached[:B])]
        logits = forward_chunks(self.model, pending, self.cached[:B], view)  # (B, V)
        device = logits.device
        tokens, probs = [], []
        for i in range(k):
            q = process_logits(logits, batch.sampling)  # (B, V) float32
            x = sample(q, batch.generators, batch.sampling.all_greedy)  # (B,)
            tokens.append(x)
            probs.append(q)
            if i < k - 1:  # the last draft token is never fed: the target will judge it
                pos = torch.tensor(lengths, device=device)[:, None] + i
                logits = self.model(x[:, None], pos, view, kv_len=max(lengths) + i + 1)[:, 0]
        for b in range(B):
            self.cached[b] = lengths[b] + k - 1
        return Draft(tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1))

    def observe(self, result: VerifyResult) -> None:
        # Draft entries for accepted tokens stay valid; the rest will be overwritten.
        for b, (n, prev) in enumerate(zip(result.num_accepted, result.prev_lengths)):
            self.cached[b] = min(self.cached[b], prev + n)
