"""Chain verification: pure functions of tensors, batched and ragged.

Shapes: B rows, k draft tokens per row, vocabulary V.
Outputs: `tokens` (B, k + 1), the emitted tokens of each row left-aligned and padded
with -1, and `num_accepted` (B,). Each row emits num_accepted + 1 tokens: the accepted
draft prefix, then either the recovered token (at the first rejection) or the bonus
token (when all k were accepted).
"""

from __future__ import annotations

import torch

from .sampling import race


def greedy_verify(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept draft tokens while they equal the target's argmax.

    draft_tokens (B, k), target_argmax (B, k + 1): the target's choice after each prefix.
    The token after the accepted prefix is the target's own choice there (recovered or bonus).
    """
    B, k = draft_tokens.shape
    match = (draft_tokens == target_argmax[:, :k]).long()
    num_accepted = match.cumprod(-1).sum(-1)  # (B,)
    return _emit(draft_tokens, num_accepted, target_argmax.gather(1, num_accepted[:, None]).squeeze(1))


def rejection_sample(draft_tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniform: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, Alg. 1;
    Chen et al. 2023, arXiv 2302.01318).

    draft_tokens (B, k): the proposal x_1..x_k.
    target_probs (B, k + 1, V): p after each prefix (processed: temperature/top-k/top-p/min-p).
    draft_probs (B, k, V): q, the exact distribution each x_i was sampled from; None for a
        deterministic proposer, which is the same as q = one-hot(x_i).
    uniform (B, k): U[0, 1) draws for the accept tests; noise (B, V): Exp(1) draws for the
        one recovered/bonus token per row.

    x_i is accepted with probability min(1, p(x_i) / q(x_i)); at the first rejection the
    recovered token is drawn from normalize(max(0, p - q)); if all k are accepted the bonus
    token is drawn from p after the last one. The emitted tokens are then distributed
    exactly as sampling from p alone.
    """
    B, k = draft_tokens.shape
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, k)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accepted = uniform * q_x < p_x  # u < p/q without dividing by q
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # (B,)

    rows = torch.arange(B, device=draft_tokens.device)
    p_next = target_probs[rows, num_accepted]  # (B, V): p at the first rejection, or after all k
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, draft_tokens[rows, at][:, None], 1.0)
        else:
            q_next = draft_probs[rows, at]
        residual = (p_next - q_next).clamp_min(0.0)
        # Rows that accepted everything sample the bonus token from p itself. A residual
        # with no mass can only come from rounding (p == q); p is then the right fallback.
        use_p = (num_accepted == k) | (residual.sum(-1) <= 0)
        weights = torch.where(use_p[:, None], p_next, residual)
    else:
        weights = p_next
    return _emit(draft_tokens, num_accepted, race(weights, noise))


def _emit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor):
    B, k = draft_tokens.shape
    out = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), -1)], dim=1)  # (B, k + 1)
    cols = torch.arange(k + 1, device=draft_tokens.device)
    out = torch.where(cols < num_accepted[:, None], out, -1)
    out[torch.arange(B, device=out.device), num_accepted] = last
    return out, num_accepted
