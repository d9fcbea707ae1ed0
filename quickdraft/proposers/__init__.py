from .base import PROPOSERS, Draft, ProposeBatch, Proposer, VerifyResult
from . import draft_model, lookahead, ngram, suffix  # noqa: F401  (each registers its method)

__all__ = ["PROPOSERS", "Draft", "ProposeBatch", "Proposer", "VerifyResult"]
