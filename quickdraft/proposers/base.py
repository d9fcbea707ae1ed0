"""The proposer interface: `propose(batch) -> Draft` and `observe(result)`.

The engine knows nothing else about a proposer. Stateful proposers (a draft model
with its own KV cache) also follow the engine's batch layout through three lifecycle
hooks, which default to doing nothing: `reserve` (size state for the batch), `start`
(a request took a row) and `move_row` (the engine compacted its rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..sampling import BatchSampling


@dataclass
class ProposeBatch:
    tokens: list[list[int]]  # per row: prompt + generated tokens committed so far
    k: int  # tokens to propose per row this step (>= 1)
    sampling: BatchSampling  # the rows' sampling parameters; q must use the same processing
    generators: list[torch.Generator]  # per-row randomness


@dataclass
class Draft:
    tokens: torch.Tensor  # (B, k) int64 proposed token ids (a chain)
    probs: torch.Tensor | None  # (B, k, V) float32: the exact q each token was drawn from; None if deterministic


@dataclass
class VerifyResult:
    num_accepted: list[int]  # per row, draft tokens the verifier kept
    prev_lengths: list[int]  # per row, committed length before the step
    k: int  # tokens that were proposed per row


class Proposer:
    def reserve(self, max_slots: int, capacity: int) -> None:
        """Prepare state for up to `max_slots` rows of `capacity` positions."""

    def start(self, row: int, prompt: list[int]) -> None:
        """A new request now occupies `row`."""

    def move_row(self, src: int, dst: int) -> None:
        """The request in row `src` now lives in row `dst` (src's old state is dropped)."""

    def propose(self, batch: ProposeBatch) -> Draft:
        raise NotImplementedError

    def observe(self, result: VerifyResult) -> None:
        """Feedback after verification."""


PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register(name: str):
    def wrap(cls):
        PROPOSERS[name] = cls
        return cls
    return wrap
