"""Speculation-length policies: how many tokens each running request drafts this step.

Speculation that pays at batch 1 can slow a busy server down: a verify step over k + 1
tokens per row costs more as the batch grows, and a request whose drafts are rarely
accepted wastes it. A policy picks k per request each step, 0 meaning "no speculation".
All policies are lossless: they only change how many tokens are proposed.

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

from .config import QuickdraftError

POLICIES = ("fixed", "acceptance", "goodput")


@dataclass
class RowState:
    """A request's speculation history, kept by the engine on the request."""
    k: int  # the acceptance policy's current k for this request
    drafted: float = 0.0  # exponentially weighted drafted tokens
    accepted: float = 0.0  # ... and accepted ones


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits with k drafts under i.i.d. acceptance alpha: (1 - a^(k+1)) / (1 - a)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpecPolicy:
    name = "fixed"

    def __init__(self, k_max: int):
        self.k_max = k_max

    def new_state(self) -> RowState:
        return RowState(k=self.k_max)

    def choose(self, states: list[RowState], k_bound: int) -> list[int]:
        """Per row, the drafts to propose this step (0..k_bound)."""
        return [min(self.k_max, k_bound)] * len(states)

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
    name = "goodput"

    def __init__(self, k_max: int, profile, method: str, prior_weight: float = 4.0):
        super().__init__(k_max)
        from .bench.profile import Profile

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
        self._cache: dict[tuple[int, float, int], int] = {}

    def alpha(self, s: RowState) -> float:
        return (s.accepted + self.prior_alpha * self.prior_weight) / (s.drafted + self.prior_weight)

    def _rate(self, alphas: list[float], batch_size: int, k: int) -> float:
        """Predicted output tokens per second of the batch when every row drafts k."""
        if k == 0:
            return batch_size / self.profile.step_time(batch_size, 1)
        cost = self.profile.propose_time(self.method, batch_size, k) + \
            self.profile.step_time(batch_size, self.measured.verify_tokens(k))
        return sum(expected_tokens(a, k) for a in alphas) / cost

    def best_k(self, alpha: float, batch_size: int, k_bound: int) -> int:
        """The best k for `batch_size` rows that all accept with probability alpha."""
        key = (batch_size, round(alpha, 2), k_bound)
        if key not in self._cache:
            top = min(self.k_max, k_bound, self.k_measured)
            rates = [self._rate([alpha] * batch_size, batch_size, k) for k in range(top + 1)]
            self._cache[key] = max(range(top + 1), key=lambda k: (rates[k], -k))
        return self._cache[key]

    def choose(self, states: list[RowState], k_bound: int) -> list[int]:
        # One k for the whole batch: rows share the padded draft and verify forwards, so a
        # row drafting less saves almost nothing, while the batch's goodput depends on every
        # row's acceptance (measured: per-row choices ran at 0.67x plain at batch 32).
        B = len(states)
        alphas = [round(self.alpha(s), 2) for s in states]
        if len(set(alphas)) == 1:
            return [self.best_k(alphas[0], B, k_bound)] * B
        top = min(self.k_max, k_bound, self.k_measured)
        k = max(range(top + 1), key=lambda c: (self._rate(alphas, B, c), -c))
        return [k] * B


def make_policy(name: str, k_max: int, profile: dict | None = None, method: str | None = None) -> SpecPolicy:
    if name == "fixed":
        return SpecPolicy(k_max)
    if name == "acceptance":
        return AcceptancePolicy(k_max)
    if name == "goodput":
        if profile is None:
            raise QuickdraftError("the goodput policy needs a cost profile: run `quickdraft tune --out FILE` "
                                  "and pass it as profile")
        return GoodputPolicy(k_max, profile, method or "draft")
    raise QuickdraftError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")
