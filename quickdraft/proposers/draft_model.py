"""A small draft model that shares the target's vocabulary: a chain, or a token tree.

It keeps its own KV cache in the engine's row layout. `cached[b]` counts the positions
of row b its cache holds; before proposing, the draft catches up on the committed tokens
it has not seen (the whole prompt at first, then the step's accepted tokens and the
token after them).

Chain (tree_width 1): k tokens sampled one at a time with the rows' sampling parameters,
keeping q exactly as sampled from.

Sampled tree (tree_width w > 1, tree_sampled): at each depth w tokens drawn independently
from q (SpecInfer's sampled siblings); the first continues the chain, so drafting costs what
a chain costs, and the verifier's q-aware residual keeps it lossless. An all-greedy batch
drafts a chain instead (its siblings would all be the argmax).

Tree (tree_width w > 1, in the manner of EAGLE-2's expansion): the w likeliest tokens
under the draft at the root, then at each further depth the w likeliest continuations
of the current w leaves by cumulative draft log-probability (one draft forward per depth
over the w leaves, with tree attention). The candidates are a deterministic function of
the draft's distribution, so they are verified as deterministic (q = None), which is
lossless at any temperature. Tree nodes sit past the committed tokens in the draft's
cache (slot L + i, as in quickdraft.tree) and are simply overwritten next step.
"""

from __future__ import annotations

import dataclasses

import torch

from ..cache import KVCache, to_device
from ..errors import QuickdraftError
from ..model.transformer import Transformer, forward_chunks
from ..sampling import BatchSampling, SamplingParams, exponential_noise, process_logits, race, sample
from ..tree import tree_mask
from .base import Draft, ProposeBatch, Proposer, VerifyResult, check_int, check_options, register


@register("draft")
class DraftModelProposer(Proposer):
    OPTIONS = ("tree_width", "tree_nodes", "tree_sampled", "confidence_threshold")
    needs_draft_model = True

    def __init__(self, model: Transformer, tree_width: int = 1, tree_nodes: int | None = None,
                 tree_sampled: bool = False, confidence_threshold: float = 0.0):
        self.model = model
        self.tree_width = check_int("tree_width", tree_width, 1, 16)
        # the most nodes sent to the target (the best by cumulative draft log-probability);
        # None = all tree_width * k
        self.tree_nodes = None if tree_nodes is None else check_int("tree_nodes", tree_nodes, 1)
        if not isinstance(tree_sampled, bool):
            raise QuickdraftError(f"tree_sampled must be true or false, got {tree_sampled!r}")
        if tree_sampled and tree_nodes is not None:
            raise QuickdraftError("tree_nodes prunes top-w trees; it cannot be combined with tree_sampled")
        self.tree_sampled = tree_sampled
        if isinstance(confidence_threshold, bool) or not isinstance(confidence_threshold, (int, float)) \
                or not 0.0 <= confidence_threshold < 1.0:
            raise QuickdraftError(f"confidence_threshold must be a number in [0, 1), got {confidence_threshold!r}")
        # chain mode: a row stops drafting once the draft's top probability (at temperature 1)
        # falls under this; the step stops early when every row has stopped
        self.confidence_threshold = float(confidence_threshold)
        self._sampled_tree = False  # the last draft was a sampled tree (see observe)
        self.cache: KVCache | None = None
        self.cached: list[int] = []
        self._step = model  # the draft's forward for one-token steps (compiled by compile())
        self._chain = None  # the whole k-token chain as one compiled graph (compile())
        self._chain_ready: set[tuple] = set()  # the chain variants run as one graph (see warm_up)

    def compile(self, make_step) -> None:
        self._step = make_step(self.model, "draft")
        if self.confidence_threshold == 0 and (self.tree_width == 1 or self.tree_sampled):
            self._chain = make_step(self.model, "draft chain", fn=draft_chain, pad=_pad_chain)

    def warm_up(self, k: int) -> None:
        from ..compile import warm_up, warms_up

        # one-token draft steps; catch-up after all k were accepted feeds 2; tree levels feed w
        top_w_tree = self.tree_width > 1 and not self.tree_sampled
        warm_up(self._step, self.model, (1, 2, self.tree_width), gather=True,
                tree_lengths=(self.tree_width,) if top_w_tree else ())
        if self._chain is None or self._chain.failed is not None:
            return
        # The k-token chain for greedy and for plain-temperature batches, batch sizes 1 and 2
        # (a dynamic graph specialises on 1). Other k (near a request's end, adaptive k) and
        # other sampling mixes (top-k/top-p/min-p) run the same chain one compiled forward at
        # a time rather than stall a request to compile. Static (CUDA-graph) chains are only
        # registered here: they are captured per batch bucket on first use, like the steps.
        if not warms_up(self._chain):
            for B in (1, 2):
                for temperature in (0.0, 1.0):
                    sampling = BatchSampling.build([SamplingParams(temperature=temperature)] * B, self.model.device)
                    self._chain_ready.add(_chain_key(B, k, self.tree_width if temperature > 0 else 1, sampling))
            return
        cache, cached = self.cache, self.cached
        try:
            with torch.inference_mode():  # the engine's caches are inference tensors: guards check it
                self.cache, self.cached = KVCache.for_model(self.model, 2, 64), [0, 0]  # a scratch cache
                self._warm_chains(k)
        finally:
            self.cache, self.cached = cache, cached

    def _warm_chains(self, k: int) -> None:
        for B in (1, 2):
            for temperature in (0.0, 1.0):
                sampling = BatchSampling.build([SamplingParams(temperature=temperature)] * B, self.model.device)
                w = self.tree_width if temperature > 0 else 1
                for length in (8, 9):  # two context lengths: the graph settles on symbolic sizes
                    self.cached[:B] = [length - 2] * B
                    self._draft_chain([[0] * length] * B, k, sampling, w,
                                      [torch.Generator(self.model.device) for _ in range(B)], warming=True)

    @classmethod
    def build(cls, *, target, draft=None, **options) -> DraftModelProposer:
        if draft is None:
            raise QuickdraftError("method 'draft' needs a draft model folder")
        check_options("draft", options, cls.OPTIONS)
        return cls(draft, **options)

    def may_draft_trees(self, k: int) -> bool:
        return self.tree_width > 1

    def max_draft_tokens(self, k: int) -> int:
        return k * self.tree_width if self.tree_nodes is None else min(k * self.tree_width, self.tree_nodes)

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

    def _catch_up(self, batch: ProposeBatch) -> torch.Tensor:
        """Feed each row the committed tokens its cache lacks; logits after the last (B, V)."""
        B = len(batch.tokens)
        pending = [t[c:] for t, c in zip(batch.tokens, self.cached[:B])]
        short = max(len(p) for p in pending) <= 2  # the usual 1-2 tokens; a prompt's catch-up is a prefill
        logits = forward_chunks(self.model, pending, self.cached[:B], self.cache.rows(0, B),
                                step=self._step if short else None)
        for b, t in enumerate(batch.tokens):
            self.cached[b] = len(t)
        return logits

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> Draft:
        # Greedy rows would draw w identical siblings: an all-greedy batch drafts a plain chain.
        w = 1 if self.tree_width == 1 or (self.tree_sampled and batch.sampling.all_greedy) else self.tree_width
        self._sampled_tree = self.tree_sampled and w > 1
        B, k = len(batch.tokens), batch.k
        if w > 1 and not self.tree_sampled:
            return self._propose_tree(batch, self._catch_up(batch))
        lengths = [len(t) for t in batch.tokens]
        if self.confidence_threshold > 0 and w == 1:
            logits = self._catch_up(batch)
            tokens, probs, fed = self._confident_chain(batch, logits, lengths, self.cache.rows(0, B))
        else:
            tokens, probs = self._draft_chain(batch.tokens, k, batch.sampling, w, batch.generators)
            fed = k - 1
        for b in range(B):
            self.cached[b] = lengths[b] + fed
        draft = Draft(tokens=tokens, probs=probs)
        if w > 1:  # sampled siblings: node i*w + j hangs under node (i-1)*w, the chain's token
            depth = torch.arange(k * w, device=tokens.device) // w
            draft.parents = torch.where(depth > 0, (depth - 1) * w, -1).expand(B, k * w).contiguous()
        return draft

    def _draft_chain(self, rows: list[list[int]], k, sampling, w, generators, warming: bool = False):
        """Catch up and draft (draft_chain): as one compiled graph where one is ready for
        this batch shape and sampling mix, else one (compiled) forward at a time; the same
        tokens either way. Each row's last <= 2 uncached tokens go into the chain (right-padded
        to 2, the one query length it is compiled for); a longer backlog (a new request's
        prompt) is prefilled first."""
        B, device = len(rows), self.model.device
        view = self.cache.rows(0, B)
        cached = self.cached[:B]
        if any(len(t) - c > 2 for t, c in zip(rows, cached)):
            heads = [t[c: max(c, len(t) - 2)] for t, c in zip(rows, cached)]
            forward_chunks(self.model, heads, cached, view)
            cached = [c + len(h) for c, h in zip(cached, heads)]
        ids = torch.zeros(B, 2, dtype=torch.long)
        pos = torch.full((B, 2), -1, dtype=torch.long)
        last = torch.zeros(B, 1, dtype=torch.long)
        for b, (t, c) in enumerate(zip(rows, cached)):
            n = len(t) - c
            if n > 0:
                ids[b, :n] = torch.tensor(t[c:], dtype=torch.long)
                pos[b, :n] = torch.arange(c, len(t))
                last[b, 0] = n - 1
        noise = None
        if not sampling.all_greedy:  # every draw of the chain up front, row b from generators[b]
            V = self.model.config.vocab_size
            noise = exponential_noise(generators, k * w * V, device).view(B, k, w, V)
        args = (to_device(ids, device), to_device(pos, device), view)
        kwargs = dict(last=to_device(last, device), kv_len=max(len(t) for t in rows), k=k, sampling=sampling,
                      noise=noise, width=w)
        chain = self._chain
        if chain is not None and chain.failed is not None:
            chain = None
        elif chain is not None:
            key = _chain_key(B, k, w, sampling)
            if warming:
                self._chain_ready.add(key)
            elif key not in self._chain_ready:
                chain = None
        if chain is None:
            return draft_chain(self._step, *args, **kwargs)
        return chain(*args, **kwargs)

    def _confident_chain(self, batch: ProposeBatch, logits, lengths, view):
        """The chain with the confidence stop: a row stops drafting once the draft's top
        probability falls under the threshold, the step once every row has (a host sync per
        token, which is why this is not the compiled chain)."""
        B, k = len(batch.tokens), batch.k
        going = torch.ones(B, dtype=torch.bool, device=logits.device)
        start = to_device(lengths, logits.device)[:, None]
        tokens, probs, fed = [], [], 0
        for i in range(k):
            going &= logits.float().softmax(-1).amax(-1) >= self.confidence_threshold
            if i > 0 and not bool(going.any()):  # the host sync
                break
            q = process_logits(logits, batch.sampling)  # (B, V) float32
            tokens.append(torch.where(going, sample(q, batch.generators, batch.sampling.all_greedy), -1))
            probs.append(q)
            if i < k - 1:  # the last draft token is never fed: the target will judge it
                logits = self._step(tokens[-1][:, None].clamp(min=0), start + i, view,
                                    kv_len=max(lengths) + i + 1)[:, 0]
                fed += 1
        return torch.stack(tokens, 1), torch.stack(probs, 1), fed

    def _propose_tree(self, batch: ProposeBatch, logits: torch.Tensor) -> Draft:
        B, k, w = len(batch.tokens), batch.k, self.tree_width
        device = logits.device
        L = to_device([len(t) for t in batch.tokens], device)
        N = w * k
        kv_len = max(len(t) for t in batch.tokens) + N  # from the host lists: no device sync
        # the engine sized caches for the nodes the target sees (tree_nodes); drafting holds all N
        self.cache.grow(kv_len)
        view = self.cache.rows(0, B)
        anc = torch.zeros(B, N, N, dtype=torch.bool, device=device)
        tokens = torch.full((B, N), -1, dtype=torch.long, device=device)
        parents = torch.full((B, N), -1, dtype=torch.long, device=device)
        rows = torch.arange(B, device=device)[:, None]
        logp = logits.float().log_softmax(-1)  # (B, V): ranking only; verification uses q = None
        score, tok = logp.topk(w, -1)  # (B, w) likeliest first
        scores = torch.empty(B, N, device=device)  # cumulative log-probability of each node
        scores[:, :w] = score
        leaves = torch.arange(w, device=device).expand(B, w)
        tokens[:, :w] = tok
        anc[:, torch.arange(w), torch.arange(w)] = True
        for d in range(1, k):
            # Feed the current leaves (depth d) and rank their children.
            pos = (L - 1 + d)[:, None].expand(B, w).contiguous()  # the layout the compiled step was warmed with
            slots = L[:, None] + leaves
            mask = tree_mask(L, leaves, anc, kv_len)
            out = self._step(tokens[rows, leaves], pos, view, kv_len=kv_len, slots=slots, attn_mask=mask)
            V = out.shape[-1]
            cand = (score[:, :, None] + out.float().log_softmax(-1)).view(B, w * V)
            score, flat = cand.topk(w, -1)  # (B, w), sorted: siblings end up likeliest first
            parent = leaves.gather(1, flat // V)
            new = d * w + torch.arange(w, device=device).expand(B, w)
            tokens[rows, new] = flat % V
            parents[rows, new] = parent
            scores[rows, new] = score
            anc[rows, new] = anc[rows, parent]
            anc[rows, new, new] = True
            leaves = new
        if self.tree_nodes is not None and self.tree_nodes < N:
            tokens, parents = self._prune(tokens, parents, scores, self.tree_nodes)
        return Draft(tokens=tokens, probs=None, parents=parents)

    @staticmethod
    def _prune(tokens, parents, scores, keep: int):
        """Keep the `keep` nodes of highest cumulative log-probability. A child never scores
        above its parent (log q <= 0; a tiny penalty on the node index, always larger for a
        child, breaks ties), so the kept nodes form a tree; their order is preserved, so
        parents stay before children."""
        B, N = tokens.shape
        index = torch.arange(N, device=tokens.device)
        chosen = (scores - 1e-6 * index).topk(keep, -1).indices.sort(-1).values  # (B, keep)
        new_index = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
        new_index.scatter_(1, chosen, torch.arange(keep, device=tokens.device).expand(B, keep))
        old_parents = parents.gather(1, chosen)
        new_parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), -1)
        return tokens.gather(1, chosen), new_parents

    def observe(self, result: VerifyResult) -> None:
        # Chain: draft entries for accepted tokens stay valid; the rest will be overwritten.
        # Sampled tree: the chain tokens (node i*w) were fed at chain positions; entries stay
        # valid while the accepted path follows them.
        # Top-w tree: nodes sit at slots L + i, not on the chain; keep only the committed tokens.
        tree = result.accepted_nodes is not None
        w = self.tree_width
        for b, (n, prev) in enumerate(zip(result.num_accepted, result.prev_lengths)):
            if not tree:
                keep = n
            elif self._sampled_tree:
                path = result.accepted_nodes[b]
                keep = next((d for d, node in enumerate(path) if node != d * w), len(path))
            else:
                keep = 0
            self.cached[b] = min(self.cached[b], prev + keep)


def draft_chain(model, ids: torch.Tensor, positions: torch.Tensor, cache, *, last: torch.Tensor, kv_len: int,
                k: int, sampling: BatchSampling, noise: torch.Tensor | None, width: int = 1, grow: bool = True):
    """Catch up on the last committed tokens, then draft k tokens: sample from the draft's
    distribution, feed the token, repeat.

    ids, positions (B, T): each row's committed tokens the draft has not seen (position -1:
    padding); last (B, 1): the index of each row's last one; kv_len: the keys the catch-up
    reads (one more for each fed draft token when `grow`; static-shape steps read the whole
    cache). noise (B, k, width, V) Exp(1) draws (None for an all-greedy batch): `width`
    tokens per depth drawn independently from q (a sampled tree's siblings), the first
    continuing the chain.
    Returns tokens (B, k * width) and q (B, k * width, V), the exact distribution each token
    was drawn from. One function of tensors, so that a compiler makes the whole draft one
    graph (StepFunction(fn=draft_chain)); `model` is the draft's forward, compiled or not.
    """
    logits = model(ids, positions, cache, kv_len=kv_len, logits_at=last)[:, 0]
    start = positions.gather(1, last)  # (B, 1) the last committed token's position
    start = torch.where(start >= 0, start + 1, -1)  # where the first draft token goes
    tokens, probs = [], []
    for i in range(k):
        q = process_logits(logits, sampling)  # (B, V) float32
        xs = [q.argmax(-1)] if noise is None else [race(q, noise[:, i, j]) for j in range(width)]
        tokens += xs
        probs += [q] * len(xs)
        if i < k - 1:  # the last draft token is never fed: the target will judge it
            pos = torch.where(start >= 0, start + i, -1)
            logits = model(xs[0][:, None], pos, cache, kv_len=kv_len + 1 + i if grow else kv_len)[:, 0]
    return torch.stack(tokens, 1), torch.stack(probs, 1)


def _chain_key(B: int, k: int, width: int, s: BatchSampling) -> tuple:
    """What a compiled chain specialises on: batch size 1 or more, k, width, the sampling mix."""
    return B > 1, k, width, s.all_greedy, s.any_greedy, s.any_top_k, s.any_top_p, s.any_min_p


def _pad_chain(ids, positions, cache, *, last, kv_len, k, sampling, noise, width, grow=True):
    """Static shapes for draft_chain (CUDA graphs): the batch padded to a bucket, keys over
    the whole cache."""
    from ..compile import pad_rows, static_rows

    Bp, cache = static_rows(cache, ids.shape[0])
    if Bp > ids.shape[0]:
        sampling = dataclasses.replace(sampling, temperature=pad_rows(sampling.temperature, Bp, 1.0),
                                       top_k=pad_rows(sampling.top_k, Bp, 0), top_p=pad_rows(sampling.top_p, Bp, 1.0),
                                       min_p=pad_rows(sampling.min_p, Bp, 0.0))
    return (pad_rows(ids, Bp, 0), pad_rows(positions, Bp, -1), cache), \
        dict(last=pad_rows(last, Bp, 0), kv_len=cache.capacity, k=k, sampling=sampling,
             noise=pad_rows(noise, Bp, 1.0), width=width, grow=False)
