"""Token trees from a small draft model (DraftModelProposer with tree_width w > 1).

Top-w tree (in the manner of EAGLE-2's expansion): the w likeliest tokens under the draft
at the root, then at each further depth the w likeliest continuations of the current w
leaves by cumulative draft log-probability (one draft forward per depth over the w leaves,
with tree attention). The candidates are a deterministic function of the draft's
distribution, so they are verified as deterministic (q = None), which is lossless at any
temperature. Tree nodes sit past the committed tokens in the draft's cache (slot L + i, as
in quickdraft.tree) and are simply overwritten next step. `prune` keeps the best
`tree_nodes` of them.

Sampled tree (tree_sampled): at each depth w tokens drawn independently from q
(SpecInfer's sampled siblings); the first continues the chain, so the draft chain
(draft_model.draft_chain with width w) drafts it at a chain's cost, and the verifier's
q-aware residual keeps it lossless. Here: its parent layout and how much of the draft's
cache an accepted path leaves valid.
"""

from __future__ import annotations

import torch

from ..cache import KVCache, to_device
from ..tree import tree_mask
from .base import Draft


def top_w_tree(step, cache: KVCache, logits: torch.Tensor, lengths: list[int], k: int, w: int,
               nodes: int | None) -> Draft:
    """Expand a top-w tree k deep from the draft's logits after each row's last committed
    token (B, V); `step` is the draft's one-token forward over `cache` (which holds the
    committed tokens; the nodes go to slots L + i). `nodes`: keep only that many (prune)."""
    B = len(lengths)
    device = logits.device
    L = to_device(lengths, device)
    N = w * k
    kv_len = max(lengths) + N  # from the host lists: no device sync
    # the engine sized caches for the nodes the target sees (tree_nodes); drafting holds all N
    cache.grow(kv_len)
    view = cache.rows(0, B)
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
        out = step(tokens[rows, leaves], pos, view, kv_len=kv_len, slots=slots, attn_mask=mask)
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
    if nodes is not None and nodes < N:
        tokens, parents = prune(tokens, parents, scores, nodes)
    return Draft(tokens=tokens, probs=None, parents=parents)


def prune(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
          keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the `keep` nodes of highest cumulative log-probability, parents before children
    (every parent's index is below its children's). A child never scores above its parent
    (log q <= 0), and equal scores are ranked by index (a stable sort: exact at any magnitude,
    unlike a small penalty, which float32 loses below -16), so the kept nodes form a tree;
    their order is preserved. Returns (tokens, parents), both (B, keep)."""
    B, N = tokens.shape
    if keep >= N:
        return tokens, parents
    ranked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :keep]
    chosen = ranked.sort(-1).values  # (B, keep)
    new_index = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
    new_index.scatter_(1, chosen, torch.arange(keep, device=tokens.device).expand(B, keep))
    old_parents = parents.gather(1, chosen)
    new_parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), -1)
    return tokens.gather(1, chosen), new_parents


def sampled_tree_parents(B: int, k: int, w: int, device: torch.device) -> torch.Tensor:
    """Parents (B, k * w) of a sampled tree in draft_chain's token order: node i*w + j hangs
    under node (i-1)*w, the chain's token at the depth above."""
    depth = torch.arange(k * w, device=device) // w
    return torch.where(depth > 0, (depth - 1) * w, -1).expand(B, k * w).contiguous()


def chain_prefix(path: list[int], w: int) -> int:
    """How many nodes of an accepted path of a sampled tree lie on its chain (node d*w at
    depth d + 1): the draft fed those at chain positions, so their cache entries stay valid."""
    return next((d for d, node in enumerate(path) if node != d * w), len(path))
