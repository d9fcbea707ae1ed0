"""Proposers: what guesses the tokens the target verifies. Each method registers itself
under its name (`register`); `get(method)` is the one place a method is checked: one name, "auto"
(the free proposers; quickdraft.llm adds the model's own draft or head) or a list of names
("suffix,draft" or ["suffix", "draft"]: the hybrid proposer, quickdraft.proposers.hybrid)."""

from ..errors import QuickdraftError
from .base import PROPOSERS, Draft, ProposeBatch, Proposer, VerifyResult
from . import draft_model, eagle3, lookahead, ngram, suffix  # noqa: F401  (each registers its method)
from .hybrid import AUTO_FREE, HybridProposer, hybrid_class, method_name, parse_method


def get(method) -> type[Proposer] | None:
    """The proposer class for `method`: a registered one, the hybrid of a list of them (or of
    "auto"); None for "none" (plain decoding)."""
    names = parse_method(method)
    if names == ("none",):
        return None
    if names == ("auto",):
        names = AUTO_FREE
    if len(names) == 1:
        cls = PROPOSERS.get(names[0])
        if cls is None:
            raise QuickdraftError(f"method must be one of none, auto, {', '.join(sorted(PROPOSERS))} or a list of "
                                  f"them, got {names[0]!r}", field="method")
        return cls
    return hybrid_class(names, tuple(sorted(PROPOSERS.items())))


__all__ = ["PROPOSERS", "Draft", "HybridProposer", "ProposeBatch", "Proposer", "VerifyResult", "get", "method_name",
           "parse_method"]
