"""Proposers: what guesses the tokens the target verifies. Each method registers itself
under its name (`register`); `get(name)` is the one place a method name is checked."""

from ..errors import QuickdraftError
from .base import PROPOSERS, Draft, ProposeBatch, Proposer, VerifyResult
from . import draft_model, eagle3, lookahead, ngram, suffix  # noqa: F401  (each registers its method)


def get(method: str) -> type[Proposer] | None:
    """The proposer class registered as `method`; None for "none" (plain decoding)."""
    if method == "none":
        return None
    cls = PROPOSERS.get(method)
    if cls is None:
        raise QuickdraftError(f"method must be one of none, {', '.join(sorted(PROPOSERS))}, got {method!r}")
    return cls


__all__ = ["PROPOSERS", "Draft", "ProposeBatch", "Proposer", "VerifyResult", "get"]
