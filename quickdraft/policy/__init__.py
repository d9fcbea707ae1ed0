"""Speculation length per request and step (`policies`; the default, `auto`, from this machine's
calibrated step costs), and the measured cost model the goodput policy reads (`costs`: the
`Profile` format written by `quickdraft tune` and `quickdraft select`)."""

from __future__ import annotations

from .costs import Choice, MethodProfile, Profile, expected_tokens, expected_tokens_measured, load_profile, save_profile, \
    solve_alpha
from . import policies
from .auto import AutoPolicy
from .policies import POLICIES, AcceptancePolicy, GoodputPolicy, RowState, SpecPolicy, check_policy

__all__ = ["POLICIES", "AcceptancePolicy", "AutoPolicy", "Choice", "GoodputPolicy", "MethodProfile", "Profile",
           "RowState", "SpecPolicy", "check_policy", "expected_tokens", "expected_tokens_measured", "load_profile",
           "make_policy",
           "save_profile", "solve_alpha"]


def make_policy(name: str, k_max: int, profile: dict | Profile | None = None, method: str | None = None,
                cost_key: dict | None = None) -> SpecPolicy:
    """The policy `name` for speculation up to k_max. auto: `cost_key` is what its cached step
    costs are keyed by (the engine's `cost_key()`; None: nothing cached, its own calibration);
    with a profile that measured this method (`quickdraft tune`), auto is the goodput policy on
    that profile; one without it (a `quickdraft select` choice of another method, or of none) leaves
    auto to its own calibration."""
    check_policy(name, profile)
    if name == "auto":
        measured = profile is not None and (method or "draft") in (
            profile.methods if isinstance(profile, Profile) else Profile.from_dict(profile).methods)
        if not measured:
            return AutoPolicy(k_max, cost_key or {}, method or "draft", persist=cost_key is not None)
        name = "goodput"
    return policies.make_policy(name, k_max, profile, method)
