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

Dynamic token trees (tree_width w > 1; EAGLE-2, arXiv 2406.16858): depth 1 holds the root's
w likeliest tokens; each further depth feeds the w nodes of the previous one (one head
forward per depth, tree attention over each node's ancestors in scratch slots of the
head's cache) and keeps the w children of highest cumulative draft log-probability among
their w x w candidates. The `tree_nodes` best nodes of the whole tree (all when None) go to
the verifier, as deterministic candidates (like the draft model's top-w trees: lossless at
any temperature by the tree verifier's rule for candidates without q).
"""

from __future__ import annotations

import torch

from ..cache import KVCache, to_device
from ..errors import QuickdraftError
from ..model.eagle3 import Eagle3Head
from ..sampling import draw, process_logits
from .base import Draft, OwnKVProposer, ProposeBatch, check_int, check_options, register
from .draft_tree import prune


@register("eagle3")
class Eagle3Proposer(OwnKVProposer):
    OPTIONS = ("tree_width", "tree_nodes")
    needs_draft_model = True
    draft_is_head = True  # LLM loads `draft` with quickdraft.model.eagle3.load_eagle3

    def __init__(self, head: Eagle3Head, vocab_size: int, tree_width: int = 1, tree_nodes: int | None = None):
        self.head = head
        self.vocab_size = vocab_size
        self.hidden_layers = head.aux_layers  # the engine returns these target layers' states
        self.hidden_width = len(head.aux_layers) * head.head_config.target_hidden_size
        self.tree_width = check_int("tree_width", tree_width, 1, 16)
        if tree_nodes is not None and tree_width == 1:
            raise QuickdraftError("tree_nodes needs tree_width > 1 (a chain has k nodes)")
        self.tree_nodes = None if tree_nodes is None else check_int("tree_nodes", tree_nodes, 1, 1024)
        self._head = head  # what runs the head: the head, or its AOT packages (use_forward)
        super().__init__()  # the head's KV cache (OwnKVProposer), built from target states
        self.pending: list[list[torch.Tensor]] = []  # per row: target states not yet fed to the head

    @classmethod
    def build(cls, *, target, draft=None, **options) -> Eagle3Proposer:
        if draft is None:
            raise QuickdraftError("method 'eagle3' needs an EAGLE-3 head folder (draft=...)")
        check_options("eagle3", options, cls.OPTIONS)
        return cls(draft, target.config.vocab_size, **options)

    def use_forward(self, make) -> None:
        step = make(self.head, trees=self.tree_width > 1)
        if step is not None:
            self._head = step

    def max_draft_tokens(self, k: int) -> int:
        w = self.tree_width
        return k if w == 1 else min(k * w, self.tree_nodes or k * w)

    def may_draft_trees(self, k: int) -> bool:
        return self.tree_width > 1

    # --- the engine's batch layout ------------------------------------------------------

    def new_cache(self, max_slots: int, capacity: int, reserve_rows: int = 0) -> KVCache:
        cfg = self.head.config
        return KVCache(1, max_slots, cfg.num_key_value_heads, capacity, cfg.head_dim, self.head.dtype, self.head.device,
                       reserve_rows=reserve_rows)

    def reserve(self, max_slots: int, capacity: int) -> None:
        super().reserve(max_slots, capacity)
        self.pending = [[] for _ in range(max_slots)]

    def resize(self, max_slots: int, capacity: int, keep: int) -> None:
        super().resize(max_slots, capacity, keep)
        self.pending = (self.pending + [[] for _ in range(max_slots)])[:max_slots]

    def kv_token_bytes(self) -> int:
        cfg = self.head.config  # one decoder layer
        return 2 * cfg.num_key_value_heads * cfg.head_dim * self.head.dtype.itemsize

    def start(self, row: int, prompt: list[int]) -> None:
        super().start(row, prompt)
        self.pending[row] = []

    def move_row(self, src: int, dst: int) -> None:
        super().move_row(src, dst)
        self.pending[dst], self.pending[src] = self.pending[src], []

    def finish(self, row: int, tokens: list[int], prompt_len: int) -> None:
        self.pending[row] = []

    # The head's KV is cached with the target's: a hit brings no target states for its positions,
    # so it covers only blocks that carry the head's KV (acceptance on a hit is acceptance without).
    prefix_state = "required"

    def loaded_state(self, row: int, length: int) -> None:
        super().loaded_state(row, length)
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
        head, device = self._head, self.head.device
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
        if self.tree_width > 1:
            return self._tree(logits, state, lengths, kv_len, k)
        sampling = batch.sampling
        draws = None
        if not sampling.all_greedy:  # every draw of the chain up front, keyed by row, position and depth
            draws = batch.random.draft_draws(k)
        tokens, probs = [], []
        for i in range(k):
            if draws is None:  # all greedy: the draft vocabulary's argmax, as a target id (no target-size tensors)
                x = self.head.target_ids(logits.argmax(-1))
            else:
                q = process_logits(self.head.to_target(logits, self.vocab_size), sampling)  # (B, V) float32
                x = draw(q, draws[:, i, 0])
                probs.append(q)
            tokens.append(x)
            if i < k - 1:  # the last draft token is never fed: the target will judge it
                logits, state = self._head(x[:, None], state[:, None], lengths - 1 + i, self.cache.rows(0, B),
                                          kv_len=kv_len + 1 + i, project=False)
                logits, state = logits[:, 0], state[:, 0]
        return Draft(tokens=torch.stack(tokens, 1), probs=None if draws is None else torch.stack(probs, 1))

    def _tree(self, logits: torch.Tensor, state: torch.Tensor, lengths: torch.Tensor, kv_len: int, k: int) -> Draft:
        """EAGLE-2's dynamic tree (module doc). Nodes are numbered depth by depth, w per depth;
        node i of row b, once fed, has its key in the head's scratch slot L_b - 1 + i."""
        head, w, V = self._head, self.tree_width, self.vocab_size  # the head or its packages
        B, device = logits.shape[0], logits.device
        n_max = w * k
        need = kv_len + n_max
        if self.cache.capacity < need:
            self.cache.grow(need)
        base = lengths - 1  # (B, 1): the first scratch slot; the context's pairs sit below it
        score, tok = head.to_target(logits, V).float().log_softmax(-1).topk(w, dim=-1)  # depth 1
        tokens, parents, scores = [tok], [torch.full((B, w), -1, dtype=torch.long, device=device)], [score]
        anc = torch.zeros(B, n_max, n_max, dtype=torch.bool, device=device)  # anc[b, i, j]: j is i or above it
        anc[:, torch.arange(w), torch.arange(w)] = True
        states = state[:, None].expand(B, w, state.shape[-1])  # what each frontier node is fed with
        keys = torch.arange(need, device=device)
        rel = keys[None, :] - base  # (B, need): the scratch node a slot holds, if any
        scratch = (rel >= 0) & (rel < n_max)
        for d in range(1, k):
            idx = torch.arange((d - 1) * w, d * w, device=device)  # the frontier: depth d's nodes
            mask = (rel < 0)[:, None, :] | (anc[:, idx].gather(2, rel.clamp(0, n_max - 1)[:, None, :].expand(B, w, need))
                                            & scratch[:, None, :])
            lg, st = head(tokens[-1], states, (base - 1 + d).expand(B, w), self.cache.rows(0, B), kv_len=need,
                          slots=base + idx, attn_mask=mask, project=False)
            child_lp, child_tok = head.to_target(lg, V).float().log_softmax(-1).topk(w, dim=-1)  # (B, w, w)
            best, order = (scores[-1][..., None] + child_lp).flatten(1).topk(w, dim=-1)
            local = order // w  # which frontier node each kept child hangs under
            new = torch.arange(d * w, (d + 1) * w, device=device)
            anc[:, new] = anc.gather(1, (idx[local])[..., None].expand(B, w, n_max))
            anc[:, new, new] = True
            tokens.append(child_tok.flatten(1).gather(1, order))
            parents.append(idx[local])
            scores.append(best)
            states = st.gather(1, local[..., None].expand(B, w, st.shape[-1]))
        # nodes are stored depth by depth (a parent before its children): prune's stable sort
        # keeps equal scores parent-first, and a child never scores above its parent
        ranked = torch.cat(scores, 1)
        return _rerank(torch.cat(tokens, 1), torch.cat(parents, 1), ranked, self.max_draft_tokens(k))


def _rerank(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, budget: int) -> Draft:
    """Each row's `budget` nodes of highest score (a tree: no node outscores its parent),
    renumbered in their original order (parents before children)."""
    tokens, parents = prune(tokens, parents, scores, budget)
    return Draft(tokens=tokens, probs=None, parents=parents)
