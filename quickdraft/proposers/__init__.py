from .base import PROPOSERS, Draft, ProposeBatch, Proposer, VerifyResult
from . import draft_model  # noqa: F401  (registers "draft")

__all__ = ["PROPOSERS", "Draft", "ProposeBatch", "Proposer", "VerifyResult"]
