"""Token-tree bookkeeping shared by the engine (target verify forward) and tree-drafting
proposers: ancestor sets, depths and the tree attention mask.

Layout used everywhere: a row whose committed length is L holds its committed tokens at
cache slots 0..L-1 (the last one, at L-1, is the tree's root). Draft node i is written at
slot L + i and has position L - 1 + depth(i), so a chain (node i at depth i + 1) lands
exactly where plain decoding would put it. A node attends to the committed slots, its
ancestors and itself; never to its siblings or cousins.
"""

from __future__ import annotations

import torch


def tree_structure(parents: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents (B, N) (-1 = under the root; parents[b, i] < i), valid (B, N) bool ->
    anc (B, N, N) bool, anc[b, i, j] = node j is node i or one of its ancestors;
    depth (B, N) int64, 1 for the root's children (0 for invalid nodes)."""
    B, N = parents.shape
    device = parents.device
    # Reachability by repeated squaring: R holds paths of length < 2^t after t rounds, so
    # ceil(log2(N)) batched matmuls replace a Python loop over the nodes.
    has_parent = (parents >= 0) & valid
    step = torch.zeros(B, N, N, device=device)
    step.scatter_(2, parents.clamp(min=0)[..., None], has_parent[..., None].float())
    reach = step + torch.eye(N, device=device)
    for _ in range(max(0, (N - 1).bit_length())):
        reach = (reach @ reach).clamp_(max=1.0)
    anc = (reach > 0) & valid[:, :, None] & valid[:, None, :]
    depth = anc.sum(-1)  # the node and its ancestors
    return anc, depth


def tree_mask(lengths: torch.Tensor, query_nodes: torch.Tensor, anc: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Attention mask (B, T, kv_len) for queries that are tree nodes (query_nodes (B, T),
    -1 = the root or a padding query: committed slots only). lengths (B,) committed lengths L;
    node j's key lives at slot L + j. Requires kv_len >= max(L) + N."""
    B, T = query_nodes.shape
    N = anc.shape[1]
    device = anc.device
    key = torch.arange(kv_len, device=device)
    mask = (key < lengths[:, None, None]).expand(B, T, kv_len).clone()  # committed, root included
    seen = anc.gather(1, query_nodes.clamp(min=0)[..., None].expand(B, T, N)) & (query_nodes >= 0)[..., None]
    cols = (lengths[:, None, None] + torch.arange(N, device=device)).expand(B, T, N)
    return mask.scatter_(2, cols, seen)  # (B, T, kv_len)
