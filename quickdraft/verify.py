"""Chain and token-tree verification: pure functions of tensors, batched and ragged.

Shapes: B rows, k draft tokens per row (a draft token of -1 ends that row's chain), or N
tree nodes per row; vocabulary V.
Outputs: `tokens` (B, k + 1), the emitted tokens of each row left-aligned and padded
with -1, and `num_accepted` (B,). Each row emits num_accepted + 1 tokens: the accepted
draft prefix, then either the recovered token (at the first rejection) or the bonus
token (when the path ended accepted). Tree verifiers also return the accepted path's
node indices.
"""

from __future__ import annotations

import torch

from . import kernels
from .sampling import draw
from .tree import tree_structure


def greedy_verify_host(draft_tokens: list[list[int]], target_argmax: list[list[int]]
                       ) -> tuple[list[list[int]], list[int]]:
    """Temperature 0 on host lists (what an all-greedy step reads back anyway): accept draft
    tokens while they equal the target's argmax, then emit the target's own choice there
    (recovered or bonus).

    draft_tokens: per row, k draft tokens (-1 ends a row's chain early); target_argmax: per
    row, the target's choice after each prefix (k + 1). Returns per row the emitted tokens
    (accepted drafts, then the target's choice) and the number accepted. Decided on the host
    rather than as a dozen tiny device ops: the engine reads these values back anyway."""
    tokens, num_accepted = [], []
    for drafts, target in zip(draft_tokens, target_argmax):
        n = 0
        while n < len(drafts) and drafts[n] == target[n]:  # a -1 (the chain's end) never equals a token
            n += 1
        tokens.append(drafts[:n] + [target[n]])
        num_accepted.append(n)
    return tokens, num_accepted


def rejection_sample(draft_tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniform: torch.Tensor, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, Alg. 1;
    Chen et al. 2023, arXiv 2302.01318).

    draft_tokens (B, k): the proposal x_1..x_k.
    target_probs (B, k + 1, V): p after each prefix (processed: temperature/top-k/top-p/min-p).
    draft_probs (B, k, V): q, the exact distribution each x_i was sampled from; None for a
        deterministic proposer, which is the same as q = one-hot(x_i).
    uniform (B, k): U[0, 1) draws for the accept tests; final (B,): the U[0, 1) that draws
        each row's one recovered or bonus token (sampling.draw).

    x_i is accepted with probability min(1, p(x_i) / q(x_i)); at the first rejection the
    recovered token is drawn from normalize(max(0, p - q)); if all k are accepted the bonus
    token is drawn from p after the last one. The emitted tokens are then distributed
    exactly as sampling from p alone.
    """
    B, k = draft_tokens.shape
    if k == 0:  # plain sampling: the token from p (what the steps below come to, in two ops)
        return draw(target_probs[:, 0], final)[:, None], torch.zeros(B, dtype=torch.long, device=draft_tokens.device)
    if kernels.runs_sampling((target_probs, draft_probs, uniform), (final,)):  # the steps below in one call
        return kernels.rejection_sample(draft_tokens, target_probs, draft_probs, uniform, final)
    present = draft_tokens >= 0  # -1 ends a row's chain
    x = draft_tokens.clamp(min=0)
    p_x = target_probs[:, :k].gather(-1, x[..., None]).squeeze(-1)  # (B, k)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, x[..., None]).squeeze(-1)
    accepted = present & (uniform * q_x < p_x)  # u < p/q without dividing by q
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # (B,)

    rows = torch.arange(B, device=draft_tokens.device)
    p_next = _row_of(target_probs, num_accepted)  # (B, V): p at the first rejection, or after all k
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, x[rows, at][:, None], 1.0)
        else:
            q_next = _row_of(draft_probs, at)
        residual = (p_next - q_next).clamp_min(0.0)
        # Rows that accepted everything (or reached the end of a shorter chain) sample the
        # bonus token from p itself. A residual with no mass can only come from rounding
        # (p == q); p is then the right fallback.
        use_p = (num_accepted == k) | ~present[rows, at] | (residual.sum(-1) <= 0)
        weights = torch.where(use_p[:, None], p_next, residual)
    else:
        weights = p_next
    return _emit(draft_tokens, num_accepted, draw(weights, final))


def _row_of(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """t[b, i[b]] for each b: (B, N, V) -> (B, V), the same values as t[rows, i]: index_select over
    the flattened rows copies them faster than advanced indexing on a CPU; N = 1 is a view."""
    B, N = t.shape[:2]
    if N == 1:
        return t[:, 0]
    return t.reshape(B * N, *t.shape[2:]).index_select(0, torch.arange(B, device=t.device) * N + i)


def _emit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor):
    B, k = draft_tokens.shape
    out = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), -1)], dim=1)  # (B, k + 1)
    cols = torch.arange(k + 1, device=draft_tokens.device)
    out = torch.where(cols < num_accepted[:, None], out, -1)
    out[torch.arange(B, device=out.device), num_accepted] = last
    return out, num_accepted


def tree_greedy_verify(tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor,
                       structure: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature 0 over a token tree: follow, from the root, the child equal to the
    target's argmax at each node; stop where there is none and emit the argmax there.

    tokens, parents (B, N) as in proposers.base.Draft; target_argmax (B, N + 1): after the
    root (index 0) and after each node (index 1 + i).
    Returns (emitted (B, D + 1), num_accepted (B,), path (B, D)): D the tree's depth, path
    the accepted nodes root-child first, padded with -1. `structure`: tree_structure's
    (anc, depth) when the caller has it already.
    """
    B, N = tokens.shape
    if N == 0:
        return _no_tree(tokens, target_argmax[:, 0])
    valid = tokens >= 0
    anc, depth = structure if structure is not None else tree_structure(parents, valid)
    match = valid & (tokens == target_argmax.gather(1, parents + 1))
    ok = valid & ~(anc & ~match[:, None, :]).any(-1)  # every node on the way matched
    score = torch.where(ok, depth, 0)
    num_accepted, best = score.max(-1)  # deepest accepted node (first among equals)
    rows = torch.arange(B, device=tokens.device)
    last = target_argmax[rows, torch.where(num_accepted > 0, best + 1, 0)]
    return _emit_path(tokens, anc[rows, best] & ok, depth, num_accepted, last)


def tree_rejection_sample(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                          draft_probs: torch.Tensor | None, uniform: torch.Tensor, final: torch.Tensor,
                          structure: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-candidate recursive rejection sampling over a token tree (SpecInfer,
    Miao et al. 2023, arXiv 2305.09781, multi-step speculative sampling; EAGLE-2 uses
    the same rule).

    tokens, parents (B, N); target_probs (B, N + 1, V): p after the root and after each node;
    draft_probs (B, N, V) or None: for a sampled node, the q it was drawn from (siblings are
    independent draws from their parent's q); None means deterministic candidates.
    uniform (B, N): one U[0, 1) per node; final (B,): the U[0, 1) that draws the last token.

    At each node, with residual r = p(node), the children x are tried in order:
    - deterministic: accept x with probability r(x); else set r(x) = 0 and renormalise;
    - sampled: accept with probability min(1, r(x) / q(x)); else r = norm(max(r - q, 0)).
    An accepted child becomes the node (r = p(child)); when no child is accepted, the last
    token is drawn from r, so every emitted token is distributed exactly as under p.
    Returns (emitted (B, D + 1), num_accepted (B,), path (B, D)) as tree_greedy_verify.
    """
    B, N = tokens.shape
    if N == 0:
        return _no_tree(tokens, draw(target_probs[:, 0], final))
    device = tokens.device
    rows = torch.arange(B, device=device)
    valid = tokens >= 0
    anc, depth = structure if structure is not None else tree_structure(parents, valid)
    if kernels.runs_sampling((target_probs, draft_probs, uniform), (final,)):  # the walk below in one call
        accepted_node, last = kernels.tree_rejection_sample(tokens, parents, target_probs, draft_probs, uniform, final)
        num_accepted = torch.where(accepted_node >= 0, depth[rows, accepted_node.clamp(min=0)], 0)
        on_path = anc[rows, accepted_node.clamp(min=0)] & (accepted_node >= 0)[:, None]
        return _emit_path(tokens, on_path, depth, num_accepted, last)
    # Host syncs in tree verification (chains have none): the tree's depth and widest sibling
    # set size the loops and buffers below. Both are bounded by the draft's shape (k, width),
    # which could replace them with static bounds for CUDA graphs at the cost of padded work.
    D = int(depth.max())
    children = _children(parents, valid)  # (B, N + 1, W) node ids, root = row 0
    cur = torch.zeros(B, dtype=torch.long, device=device)  # 0 = root, 1 + i = node i
    alive = torch.ones(B, dtype=torch.bool, device=device)
    r = target_probs[:, 0].clone()
    accepted_node = torch.full((B,), -1, dtype=torch.long, device=device)
    for _ in range(D):
        moved = torch.zeros(B, dtype=torch.bool, device=device)
        nxt = cur
        for j in range(children.shape[-1]):
            c = children[rows, cur, j]
            trying = alive & ~moved & (c >= 0)
            c0 = c.clamp(min=0)
            x = tokens[rows, c0].clamp(min=0)[:, None]
            r_x = r.gather(1, x).squeeze(1)
            if draft_probs is None:
                q_x = torch.ones_like(r_x)
                residual = r.scatter(1, x, 0.0)
            else:
                q = _row_of(draft_probs, c0)
                q_x = q.gather(1, x).squeeze(1)
                residual = (r - q).clamp_min(0.0)
            acc = trying & (uniform[rows, c0] * q_x < r_x)
            rej = trying & ~acc
            mass = residual.sum(-1, keepdim=True)
            # a massless residual can only come from rounding (r == q): keep r then
            residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), r)
            r = torch.where(rej[:, None], residual, r)
            moved = moved | acc
            nxt = torch.where(acc, c0 + 1, nxt)
            accepted_node = torch.where(acc, c0, accepted_node)
        cur = nxt
        r = torch.where(moved[:, None], _row_of(target_probs, cur), r)
        alive = alive & moved
    num_accepted = torch.where(accepted_node >= 0, depth[rows, accepted_node.clamp(min=0)], 0)
    on_path = anc[rows, accepted_node.clamp(min=0)] & (accepted_node >= 0)[:, None]
    return _emit_path(tokens, on_path, depth, num_accepted, draw(r, final))


def _no_tree(tokens: torch.Tensor, last: torch.Tensor):
    B = tokens.shape[0]
    return last[:, None], torch.zeros(B, dtype=torch.long, device=tokens.device), tokens.new_zeros((B, 0))


def _children(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, N + 1, W) child node ids of the root (row 0) and of each node (row 1 + i), in
    index order, padded with -1; W = the most children any node has."""
    B, N = parents.shape
    device = parents.device
    owner = torch.where(valid, parents + 1, N + 1)  # invalid nodes go to a dummy row
    idx = torch.arange(N, device=device)
    same = (owner[:, :, None] == owner[:, None, :]) & (idx[None, None, :] < idx[None, :, None])
    rank = same.sum(-1)  # (B, N): how many earlier siblings
    W = int(rank.max()) + 1 if N else 1  # a host sync (see tree_rejection_sample)
    children = torch.full((B, N + 2, W), -1, dtype=torch.long, device=device)
    children[torch.arange(B, device=device)[:, None], owner, rank] = idx.expand(B, N)
    return children[:, : N + 1]


def _emit_path(tokens: torch.Tensor, on_path: torch.Tensor, depth: torch.Tensor, num_accepted: torch.Tensor,
               last: torch.Tensor):
    """Order the nodes flagged on_path (B, N) by depth; emit their tokens, then `last`."""
    B, N = tokens.shape
    D = int(depth.max()) if N else 0  # a host sync (see tree_rejection_sample)
    idx = torch.arange(N, device=tokens.device).expand(B, N)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=tokens.device)
    path.scatter_(1, torch.where(on_path, depth - 1, D), idx)  # off-path nodes land in column D
    path = path[:, :D]
    out = torch.cat([tokens.gather(1, path.clamp(min=0)), tokens.new_full((B, 1), -1)], 1)
    cols = torch.arange(D + 1, device=tokens.device)
    out = torch.where(cols < num_accepted[:, None], out, -1)
    out[torch.arange(B, device=tokens.device), num_accepted] = last
    return out, num_accepted, path
