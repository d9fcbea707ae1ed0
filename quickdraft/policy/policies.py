"""Speculation-length policies: how many tokens each running request drafts this step.

Speculation that pays at batch 1 can slow a busy server down: a verify step over k + 1
tokens per row costs more as the batch grows, and a request whose drafts are rarely
accepted wastes it. A policy picks k per request each step, 0 meaning "no speculation".
All policies are lossless: they only change how many tokens are proposed.

- `auto` (the default): the k in 0..k that maximises expected tokens per second from this
  machine's measured step costs (calibrated on the first steps, cached per model, method and
  machine) and each request's running acceptance; plain decoding where speculation cannot
  pay. See `quickdraft.policy.auto`.
- `fixed`: k every step (the configured num_speculative_tokens).
- `acceptance`: per request, grow k by 2 after a step that accepted every drafted token,
  shrink it by 1 otherwise (the heuristic of transformers' assisted generation), within
  [1, k].
- `goodput`: from a measured cost profile (`quickdraft tune`) and each request's running
  acceptance estimate alpha_b, the k in [0, k_max] that maximises the batch's expected
  tokens per second at its current size B: sum_b E(alpha_b, k) / (T_propose(B, k) +
  T_target(B, q(k))), against B / T_target(B, 1) for plain decoding (k = 0). One k for the
  batch: its rows share the padded forwards.

The draft-confidence stop (stop drafting a row when the draft's top probability falls
under a threshold) lives in the draft-model proposer (`confidence_threshold`), since only
it sees the draft's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QuickdraftError
from .costs import Profile, expected_tokens

POLICIES = ("auto", "fixed", "acceptance", "goodput")


@dataclass
class RowState:
    """A request's speculation history, kept by the engine on the request."""
    k: int  # the acceptance policy's current k for this request
    drafted: float = 0.0  # exponentially weighted drafted tokens
    accepted: float = 0.0  # ... and accepted ones
    # the auto policy's view: the k of the row's last step, exponentially weighted speculating
    # steps, tokens accepted in them and their k, and the acceptance they imply (None: stale)
    last_k: int = 0
    spec_steps: float = 0.0
    spec_accepted: float = 0.0
    spec_k: float = 0.0
    alpha: float | None = None


class SpecPolicy:
    name = "fixed"

    def __init__(self, k_max: int):
        self.k_max = k_max

    def new_state(self) -> RowState:
        return RowState(k=self.k_max)

    def choose(self, states: list[RowState], k_bound: int) -> list[int]:
        """Per row, the drafts to propose this step (0..k_bound)."""
        return [min(self.k_max, k_bound)] * len(states)

    def observe_step(self, batch_size: int, k: int, seconds: float) -> None:
        """The engine's wall time for a decode step of batch_size rows drafting (at most) k."""

    def observe(self, state: RowState, drafted: int, accepted: int) -> None:
        if drafted > 0:  # running acceptance estimate, recent steps weighted more
            state.drafted = 0.9 * state.drafted + drafted
            state.accepted = 0.9 * state.accepted + accepted


class AcceptancePolicy(SpecPolicy):
    name = "acceptance"

    def __init__(self, k_max: int, k_start: int | None = None):
        super().__init__(k_max)
        self.k_start = min(k_max, k_start if k_start is not None else max(1, k_max // 2))

    def new_state(self) -> RowState:
        return RowState(k=self.k_start)

    def choose(self, states: list[RowState], k_bound: int) -> list[int]:
        return [min(s.k, k_bound) for s in states]

    def observe(self, state: RowState, drafted: int, accepted: int) -> None:
        super().observe(state, drafted, accepted)
        if drafted > 0:
            state.k = min(self.k_max, state.k + 2) if accepted == drafted else max(1, state.k - 1)


class GoodputPolicy(SpecPolicy):
    """Goodput from the profile, corrected by what the engine measures as it runs.

    The profile times the two forwards in isolation; a real step also pays for sampling,
    bookkeeping and the draft's catch-up, which grow with batch size and k. So the engine
    reports every decode step's wall time (observe_step) and the policy keeps a running
    mean per (batch size, k): a measured cost replaces the profile's; an unmeasured one is
    the profile's scaled by how far off the profile was for that batch size (or, failing
    that, for that k at the nearest batch size). Every `probe_every`-th step that would not
    speculate drafts the best k > 0 once, so acceptance estimates and costs stay current
    and the policy can turn speculation back on.
    """

    name = "goodput"
    probe_every = 32

    def __init__(self, k_max: int, profile, method: str, prior_weight: float = 4.0):
        super().__init__(k_max)
        if not isinstance(profile, Profile):
            profile = Profile.from_dict(profile)
        if method not in profile.methods:
            raise QuickdraftError(f"the profile has no measurements for method {method!r}; "
                                  f"it has: {', '.join(profile.methods) or 'none'} (run quickdraft tune)")
        self.profile, self.method = profile, method
        measured = profile.methods[method]
        self.measured = measured
        self.prior_alpha = float(measured.alpha)
        self.prior_weight = prior_weight  # the profile's alpha counts as this many drafted tokens
        self.k_measured = max(measured.ks)
        self.step_s: dict[tuple[int, int], float] = {}  # (batch size, k) -> running mean of measured steps
        self._idle = 0  # steps since the policy last speculated

    def alpha(self, s: RowState) -> float:
        return (s.accepted + self.prior_alpha * self.prior_weight) / (s.drafted + self.prior_weight)

    def predicted_cost(self, batch_size: int, k: int) -> float:
        """The profile's seconds for one step of batch_size rows drafting k."""
        if k == 0:
            return self.profile.step_time(batch_size, 1)
        return self.profile.propose_time(self.method, batch_size, k) + \
            self.profile.step_time(batch_size, self.measured.verify_tokens(k))

    def cost(self, batch_size: int, k: int) -> float:
        """Seconds of one step: measured if seen, else the profile's, calibrated."""
        seen = self.step_s.get((batch_size, k))
        if seen is not None:
            return seen
        ratios = [t / self.predicted_cost(b, j) for (b, j), t in self.step_s.items() if b == batch_size]
        if not ratios:
            same_k = [(abs(b - batch_size), t / self.predicted_cost(b, j)) for (b, j), t in self.step_s.items()
                      if j == k]
            ratios = [min(same_k)[1]] if same_k else [1.0]
        ratios.sort()
        return self.predicted_cost(batch_size, k) * ratios[len(ratios) // 2]

    def observe_step(self, batch_size: int, k: int, seconds: float) -> None:
        key = (batch_size, k)
        old = self.step_s.get(key)
        self.step_s[key] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _rate(self, alphas: list[float], batch_size: int, k: int) -> float:
        """Predicted output tokens per second of the batch when every row drafts k."""
        if k == 0:
            return batch_size / self.cost(batch_size, 0)
        return sum(expected_tokens(a, k) for a in alphas) / self.cost(batch_size, k)

    def best_k(self, alpha: float, batch_size: int, k_bound: int) -> int:
        """The best k for `batch_size` rows that all accept with probability alpha."""
        return self._best([alpha] * batch_size, k_bound, 0)

    def _best(self, alphas: list[float], k_bound: int, low: int) -> int:
        top = min(self.k_max, k_bound, self.k_measured)
        if top < low:
            return 0
        B = len(alphas)
        return max(range(low, top + 1), key=lambda c: (self._rate(alphas, B, c), -c))

    def choose(self, states: list[RowState], k_bound: int) -> list[int]:
        # One k for the whole batch: rows share the padded draft and verify forwards, so a
        # row drafting less saves almost nothing, while the batch's goodput depends on every
        # row's acceptance (measured: per-row choices ran at 0.67x plain at batch 32).
        B = len(states)
        alphas = [round(self.alpha(s), 2) for s in states]
        k = self._best(alphas, k_bound, 0)
        self._idle = self._idle + 1 if k == 0 else 0
        if k == 0 and self._idle >= self.probe_every:  # look again: acceptance and costs change
            k = self._best(alphas, k_bound, 1)
            self._idle = 0
        return [k] * B


_NEEDS_PROFILE = "the goodput policy needs a cost profile: run `quickdraft tune --out FILE` and pass it as profile"


def check_policy(name: str, profile: object | None) -> None:
    """The policy name is known and has what it needs (the engine checks this up front, even
    when it will not speculate)."""
    if name not in POLICIES:
        raise QuickdraftError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")
    if name == "goodput" and profile is None:
        raise QuickdraftError(_NEEDS_PROFILE)


def make_policy(name: str, k_max: int, profile: dict | Profile | None = None,
                method: str | None = None) -> SpecPolicy:
    """The fixed, acceptance and goodput policies (`quickdraft.policy.make_policy` adds auto)."""
    check_policy(name, profile)
    if name == "fixed":
        return SpecPolicy(k_max)
    if name == "acceptance":
        return AcceptancePolicy(k_max)
    return GoodputPolicy(k_max, profile, method or "draft")
