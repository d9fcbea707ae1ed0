"""A small draft model that shares the target's vocabulary: a chain, or a token tree.

It keeps its own KV cache in the engine's row layout. `cached[b]` counts the positions
of row b its cache holds; before proposing, the draft catches up on the committed tokens
it has not seen (the whole prompt at first, then the step's accepted tokens and the
token after them).

Chain (tree_width 1): k tokens sampled one at a time with the rows' sampling parameters,
keeping q exactly as sampled from (draft_chain). Rows with penalties or logit_bias draft from
the draft's logits penalised by the same rule as the target's (their output and the chain so
far count; `penalize=False` drafts from the raw ones): measured on the bundled pair
(benchmarks/results/penalty_acceptance_cpu.json), it accepts more on average, most with a
strong repetition penalty. That chain runs one forward at a time, not as the compiled graph. Where compiled, the whole chain is one
graph for the variants warm-up registered (quickdraft.compile.CompiledVariants), else one
compiled forward at a time; the same tokens either way. With confidence_threshold, a row
stops drafting once the draft is unsure (one forward at a time: it needs a host sync).

Sampled tree (tree_width w > 1, tree_sampled): the chain with w independent draws from q
per depth, the first continuing the chain. An all-greedy batch drafts a chain instead (its
siblings would all be the argmax).

Top-w tree (tree_width w > 1): the w likeliest continuations per depth, verified as
deterministic candidates. Both tree kinds are in quickdraft.proposers.draft_tree.
"""

from __future__ import annotations

import functools

import torch

from ..cache import KVCache, to_device
from ..compile import CompiledVariants, chain_key, pad_chain, warm_samplings, warms_up
from ..errors import QuickdraftError
from ..model.transformer import Transformer, forward_chunks
from ..sampling import BatchSampling, StepRandom, Stream, draw, process_logits
from .base import Draft, OwnKVProposer, ProposeBatch, VerifyResult, check_int, check_options, register
from .draft_tree import chain_prefix, sampled_tree_parents, top_w_tree


@register("draft")
class DraftModelProposer(OwnKVProposer):
    OPTIONS = ("tree_width", "tree_nodes", "tree_sampled", "confidence_threshold", "penalize")
    needs_draft_model = True

    def __init__(self, model: Transformer, tree_width: int = 1, tree_nodes: int | None = None,
                 tree_sampled: bool = False, confidence_threshold: float = 0.0, penalize: bool = True):
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
        if not isinstance(penalize, bool):
            raise QuickdraftError(f"penalize must be true or false, got {penalize!r}")
        self.penalize = penalize  # chains and sampled trees: q follows the rows' penalties too
        if isinstance(confidence_threshold, bool) or not isinstance(confidence_threshold, (int, float)) \
                or not 0.0 <= confidence_threshold < 1.0:
            raise QuickdraftError(f"confidence_threshold must be a number in [0, 1), got {confidence_threshold!r}")
        # chain mode: a row stops drafting once the draft's top probability (at temperature 1)
        # falls under this; the step stops early when every row has stopped
        self.confidence_threshold = float(confidence_threshold)
        super().__init__()  # the draft's KV cache (OwnKVProposer)
        self._step = model  # the draft's forward for one-token steps (compiled by compile())
        self._chains: CompiledVariants | None = None  # the whole k-token chain as one graph (compile())

    # The compiled chain's step and its registered variants (tests spy on both).
    @property
    def _chain(self):
        return None if self._chains is None else self._chains.step

    @property
    def _chain_ready(self) -> set[tuple]:
        return set() if self._chains is None else self._chains.ready

    def use_forward(self, make) -> None:
        step = make(self.model, trees=self.tree_width > 1)
        if step is not None:
            self._step = step

    def compile(self, make_step) -> None:
        self._step = make_step(self.model, "draft")
        if self.confidence_threshold == 0 and (self.tree_width == 1 or self.tree_sampled):
            self._chains = CompiledVariants(make_step(self.model, "draft chain", fn=draft_chain, pad=pad_chain),
                                            fallback=functools.partial(draft_chain, self._step))

    def _width(self, sampling: BatchSampling) -> int:
        """Tokens per depth: greedy rows would draw w identical siblings, so an all-greedy
        batch drafts a plain chain."""
        if self.tree_width == 1 or (self.tree_sampled and sampling.all_greedy):
            return 1
        return self.tree_width

    def warm_up(self, k: int) -> None:
        from ..compile import warm_up

        # one-token draft steps; catch-up after all k were accepted feeds 2; tree levels feed w
        top_w = self.tree_width > 1 and not self.tree_sampled
        warm_up(self._step, self.model, (1, 2, self.tree_width), gather=True,
                tree_lengths=(self.tree_width,) if top_w else ())
        chains = self._chains
        if chains is None or not chains.usable:
            return
        # The k-token chain for the start-up variants (warm_samplings). Other k (near a
        # request's end, adaptive k) and other sampling mixes run the same chain one compiled
        # forward at a time rather than stall a request to compile.
        variants = [(B, sampling, self._width(sampling)) for B, sampling in warm_samplings(self.model.device)]
        for B, sampling, w in variants:
            chains.register(chain_key(B, k, w, sampling))
        if not warms_up(chains.step):
            return  # static (CUDA-graph) chains are captured per batch bucket on first use, like the steps
        cache, cached = self.cache, self.cached
        try:
            with torch.inference_mode():  # the engine's caches are inference tensors: guards check it
                self.cache, self.cached = KVCache.for_model(self.model, 2, 64), [0, 0]  # a scratch cache
                for B, sampling, w in variants:
                    for length in (8, 9):  # two context lengths: the graph settles on symbolic sizes
                        self.cached[:B] = [length - 2] * B
                        self._draft_chain([[0] * length] * B, k, sampling, w,
                                          StepRandom([0] * B, [length] * B, self.model.device))
        finally:
            self.cache, self.cached = cache, cached

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

    def new_cache(self, max_slots: int, capacity: int, reserve_rows: int = 0) -> KVCache:
        return KVCache.for_model(self.model, max_slots, capacity, reserve_rows=reserve_rows)

    def kv_token_bytes(self) -> int:
        return KVCache.token_bytes(self.model)

    prefix_state = "rebuild"  # the draft's KV is cached with the target's; a hit without it is caught up

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
        w = self._width(batch.sampling)
        B, k = len(batch.tokens), batch.k
        lengths = [len(t) for t in batch.tokens]
        if w > 1 and not self.tree_sampled:
            return top_w_tree(self._step, self.cache, self._catch_up(batch), lengths, k, w, self.tree_nodes)
        if self.confidence_threshold > 0 and w == 1:
            logits = self._catch_up(batch)
            tokens, probs, fed = self._confident_chain(batch, logits, lengths, self.cache.rows(0, B))
        else:
            penalties = batch.penalties if self.penalize else None
            tokens, probs = self._draft_chain(batch.tokens, k, batch.sampling, w, batch.random,
                                              None if penalties is None else (penalties, batch.outputs))
            fed = k - 1
        for b in range(B):
            self.cached[b] = lengths[b] + fed
        parents = sampled_tree_parents(B, k, w, tokens.device) if w > 1 else None
        return Draft(tokens=tokens, probs=probs, parents=parents)

    def _draft_chain(self, rows: list[list[int]], k, sampling, w, rnd: StepRandom, penalize=None):
        """Catch up and draft (draft_chain): as one compiled graph where one is registered
        for this batch shape and sampling mix, else one (compiled) forward at a time; the same
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
        draws = None
        if not sampling.all_greedy:  # every draw of the chain up front, depth i's keyed by i (StepRandom)
            draws = rnd.draft_draws(k, w)
        args = (to_device(ids, device), to_device(pos, device), view)
        kwargs = dict(last=to_device(last, device), kv_len=max(len(t) for t in rows), k=k, sampling=sampling,
                      draws=draws, width=w)
        if self._chains is None or penalize is not None:
            return draft_chain(self._step, *args, **kwargs, penalize=penalize)
        return self._chains(chain_key(B, k, w, sampling), *args, **kwargs)

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
            # depth i's draws as in the chain (draft_draws): where the batch stops changes nothing
            x = q.argmax(-1) if batch.sampling.all_greedy else draw(q, batch.random.draws(Stream.DRAFT, 1, i)[:, 0])
            tokens.append(torch.where(going, x, -1))
            probs.append(q)
            if i < k - 1:  # the last draft token is never fed: the target will judge it
                logits = self._step(tokens[-1][:, None].clamp(min=0), start + i, view,
                                    kv_len=max(lengths) + i + 1)[:, 0]
                fed += 1
        return torch.stack(tokens, 1), torch.stack(probs, 1), fed

    def observe(self, result: VerifyResult) -> None:
        # Chain: draft entries for accepted tokens stay valid; the rest will be overwritten.
        # Sampled tree: the chain tokens (node i*w) were fed at chain positions; entries stay
        # valid while the accepted path follows them.
        # Top-w tree (or a result without its draft): nodes sit at slots L + i, not on the
        # chain; keep only the committed tokens.
        tree = result.accepted_nodes is not None
        sampled = result.draft is not None and result.draft.sampled
        for b, (n, prev) in enumerate(zip(result.num_accepted, result.prev_lengths)):
            if not tree:
                keep = n
            elif sampled:
                keep = chain_prefix(result.accepted_nodes[b], self.tree_width)
            else:
                keep = 0
            self.cached[b] = min(self.cached[b], prev + keep)


def draft_chain(model, ids: torch.Tensor, positions: torch.Tensor, cache, *, last: torch.Tensor, kv_len: int,
                k: int, sampling: BatchSampling, draws: torch.Tensor | None, width: int = 1, grow: bool = True,
                penalize: tuple | None = None):
    """Catch up on the last committed tokens, then draft k tokens: sample from the draft's
    distribution, feed the token, repeat.

    ids, positions (B, T): each row's committed tokens the draft has not seen (position -1:
    padding); last (B, 1): the index of each row's last one; kv_len: the keys the catch-up
    reads (one more for each fed draft token when `grow`; static-shape steps read the whole
    cache). draws (B, k, width) U[0, 1) float64 (StepRandom.draft_draws; None for an
    all-greedy batch): `width` tokens per depth drawn independently from q (a sampled tree's
    siblings), the first continuing the chain.
    Returns tokens (B, k * width) and q (B, k * width, V), the exact distribution each token
    was drawn from. One function of tensors, so that a compiler makes the whole draft one
    graph (StepFunction(fn=draft_chain)); `model` is the draft's forward, compiled or not.
    penalize: (PenaltyState, each row's output so far) to draft from penalised logits, the
    chain's tokens before each depth counting as output (eager only).
    """
    logits = model(ids, positions, cache, kv_len=kv_len, logits_at=last)[:, 0]
    start = positions.gather(1, last)  # (B, 1) the last committed token's position
    start = torch.where(start >= 0, start + 1, -1)  # where the first draft token goes
    tokens, probs = [], []
    counts = None
    if penalize is not None:
        counts = penalize[0].output_counts(penalize[1])  # once per step, not per depth
    for i in range(k):
        if penalize is not None:  # a sibling's context is the chain before it
            chain = torch.stack(tokens[::width], 1) if i else logits.new_zeros(logits.shape[0], 0, dtype=torch.long)
            logits = penalize[0].apply(logits, counts, (chain, chain.new_ones(chain.shape[0], 1, chain.shape[1],
                                                                              dtype=torch.bool)))
        q = process_logits(logits, sampling)  # (B, V) float32
        xs = [q.argmax(-1)] if draws is None else [draw(q, draws[:, i, j]) for j in range(width)]
        tokens += xs
        probs += [q] * len(xs)
        if i < k - 1:  # the last draft token is never fed: the target will judge it
            pos = torch.where(start >= 0, start + i, -1)
            logits = model(xs[0][:, None], pos, cache, kv_len=kv_len + 1 + i if grow else kv_len)[:, 0]
    return torch.stack(tokens, 1), torch.stack(probs, 1)

