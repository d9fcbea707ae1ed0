"""Speculation length per request and step (`policies`), and the measured cost model the
goodput policy reads (`costs`: the `Profile` format written by `quickdraft tune` and `quickdraft select`)."""

from .costs import Choice, MethodProfile, Profile, expected_tokens, expected_tokens_measured, load_profile, save_profile, \
    solve_alpha
from .policies import POLICIES, AcceptancePolicy, GoodputPolicy, RowState, SpecPolicy, check_policy, make_policy

__all__ = ["POLICIES", "AcceptancePolicy", "Choice", "GoodputPolicy", "MethodProfile", "Profile", "RowState", "SpecPolicy",
           "check_policy", "expected_tokens", "expected_tokens_measured", "load_profile", "make_policy",
           "save_profile", "solve_alpha"]
