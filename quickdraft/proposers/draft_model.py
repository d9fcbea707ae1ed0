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

import torch

from ..cache import KVCache, to_device
from ..config import QuickdraftError
from ..model.transformer import Transformer, forward_chunks
from ..sampling import process_logits, sample
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

    def compile(self, make_step) -> None:
        self._step = make_step(self.model, "draft")

    def warm_up(self, k: int) -> None:
        from ..compile import warm_up

        # one-token draft steps; catch-up after all k were accepted feeds 2; tree levels feed w
        warm_up(self._step, self.model, (1, 2, self.tree_width), gather=True)

    @classmethod
    def build(cls, *, target, draft=None, **options) -> DraftModelProposer:
        if draft is None:
            raise QuickdraftError("method 'draft' needs a draft model folder")
        check_options("draft", options, cls.OPTIONS)
        return cls(draft, **options)

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
        logits = self._catch_up(batch)
        # Greedy rows would draw w identical siblings: an all-greedy batch drafts a plain chain.
        w = 1 if self.tree_width == 1 or (self.tree_sampled and batch.sampling.all_greedy) else self.tree_width
        self._sampled_tree = self.tree_sampled and w > 1
        if w > 1 and not self.tree_sampled:
            return self._propose_tree(batch, logits)
        B, k = len(batch.tokens), batch.k
        view = self.cache.rows(0, B)
        lengths = [len(t) for t in batch.tokens]
        device = logits.device
        tokens, probs = [], []
        stop_at = self.confidence_threshold if w == 1 else 0.0
        going = torch.ones(B, dtype=torch.bool, device=device)
        start = to_device(lengths, device)[:, None]
        fed = 0
        for i in range(k):
            if stop_at > 0:
                going &= logits.float().softmax(-1).amax(-1) >= stop_at
                if i > 0 and not bool(going.any()):  # a host sync, only with the confidence stop
                    break
            q = process_logits(logits, batch.sampling)  # (B, V) float32
            xs = [sample(q, batch.generators, batch.sampling.all_greedy) for _ in range(w)]  # w x (B,)
            if stop_at > 0:
                xs = [torch.where(going, x, -1) for x in xs]
            tokens += xs
            probs += [q] * w
            if i < k - 1:  # the last draft token is never fed: the target will judge it
                pos = start + i
                logits = self._step(xs[0][:, None].clamp(min=0), pos, view, kv_len=max(lengths) + i + 1)[:, 0]
                fed += 1
        for b in range(B):
            self.cached[b] = lengths[b] + fed
        draft = Draft(tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1))
        if w > 1:  # sampled siblings: node i*w + j hangs under node (i-1)*w, the chain's token
            depth = torch.arange(k * w, device=device) // w
            draft.parents = torch.where(depth > 0, (depth - 1) * w, -1).expand(B, k * w).contiguous()
        return draft

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
            pos = (L - 1 + d)[:, None].expand(B, w)
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
