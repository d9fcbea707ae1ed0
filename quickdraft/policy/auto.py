"""The default policy (`auto`): speculate only as far as this machine's measured costs pay.

Whether speculation pays depends on the machine as much as on the method: the same SmolLM2
EAGLE-3 head runs at 1.18x plain decoding on an AVX-512 CPU and at 0.42x on an AVX2 one,
where a (k + 1)-row verify step costs 1.5-2.9x a one-row step. So the default policy measures
the step costs on the machine it runs on, with no user step, and picks per step the k in 0..k
(0 = plain decoding) that maximises expected tokens per second:

    rate(k) = sum_b E_b(k) / C(B, k),      rate(0) = B / C(B, 0),

where C(B, k) is the measured wall time of one decode step of a batch of B rows drafting k
(proposing, verifying, sampling and bookkeeping: what observe_step reports) and E_b(k) is
row b's expected emitted tokens at k, from its running mean acceptance length L_b (accepted
tokens per speculating step, plus one) turned into an i.i.d. alpha at the k it was measured
at (`solve_alpha`) and projected to k (`expected_tokens`). Counting accepted tokens per step,
rather than per drafted token, covers proposers that sometimes draft nothing (suffix, n-gram)
and trees alike. Speculation is chosen only when it beats plain decoding by `margin` (3%): a
method that cannot pay here falls back to plain decoding, one that pays less at k than at a
smaller k runs the smaller k. One k for the batch (its rows share the padded forwards).

The cost model C: for each batch-size bucket (1, 2, 3-4, 5-8, ...: B rounded up to a power of
two) the median step time at k = 0, 1 and k_max, linear in k between 1 and k_max. It comes
from a **calibration**: the first steps the engine runs at a bucket cycle through those
three k (after two warm-up steps, `samples` steps each, interleaved so that a change in load
hits all three alike), then the medians are frozen, logged and written to the quickdraft
cache (`costs/<key>.json` under `quickdraft.paths.cache_dir()`), keyed by everything the
costs depend on: the target's and the draft's shapes and weight formats, the method and its
options, k_max, the forward (eager, compiled, AOT), the CPU, a forced kernel ISA, torch's threads
and version. A later engine with the same key (in this process or another) starts from the
cached costs and does not calibrate again. A new request, before its own speculating steps,
starts from a prior acceptance length (worth `prior_steps` of its steps): pooled over the key's
first `prior_samples` speculating row-steps, the calibration's included, then frozen and cached
beside the costs; while it pools it is never below the neutral 1 + k_max / 2 (the calibration's
few steps open the first request, often its least predictable part). Delete the file (or point
QUICKDRAFT_CACHE elsewhere) to measure again, e.g. after calibrating on a loaded machine. A
profile from `quickdraft tune` given as `profile=` makes `auto` the `goodput` policy on that
profile.

Why frozen costs, not a running mean of the step times: the output must not depend on
wall-clock time. Greedy output is the same whatever k (the verifier emits the target's
argmax), but a seeded sampled request is not: its random draws are keyed by the position at
which each step starts (sampling.StepRandom), and k decides where steps start, so another k
sequence samples other (equally distributed) tokens. With the costs frozen, the k sequence of
a request is a function of its own tokens (its acceptance), its batch and the cached costs,
so a seeded request is reproducible run to run once the calibration and the prior are cached.
The first runs at a new key (the calibration, then the prior's pooling) pick k by the schedule
and a prior still moving, and later runs differ from them; `policy="fixed"` gives the same k
every step and is what tests and benchmarks that count steps or compare seeded samples between
engines pin.

While speculation is off, the batch speculates once at the best k > 0 after `probe_first`
steps, then after twice as many each time it stays off, up to every `probe_every`-th step, so
the acceptance estimates stay current and speculation comes back when a request starts to
repeat itself (suffix decoding on an edit), or after an unlucky opening: a request whose first
two drafts are rejected turns speculation off, and at a fixed 32 steps a 128-token request
of the bundled pair that then accepted five drafts a step waited 31 steps plain (Zen 3).
Speculation chosen on its rates again starts the gaps over. Lossless by construction: the
policy only chooses k.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..paths import cache_dir
from .costs import expected_tokens, solve_alpha
from .policies import RowState, SpecPolicy

log = logging.getLogger("quickdraft")

COSTS_VERSION = 2  # (1: the prior from the calibration's own steps at k_max alone)

# in-process calibrations by cache key: engines built with the same key share one
_CALIBRATED: dict[str, dict[int, dict[int, float]]] = {}
_PRIOR: dict[str, float] = {}  # key -> the acceptance length at k_max a new request starts from, once frozen
_POOL: dict[str, dict[str, float]] = {}  # key -> speculating row-steps pooled for it until frozen


def bucket(batch_size: int) -> int:
    """The batch-size bucket whose calibration a step of batch_size rows uses: the power of two >= it."""
    return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))


def key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def costs_path(key: Mapping[str, Any]) -> Path:
    return cache_dir() / "costs" / f"{key_digest(key)}.json"


def load_costs(key: Mapping[str, Any]) -> tuple[dict[int, dict[int, float]], float | None]:
    """The calibrated step costs {bucket: {k: seconds}} cached for `key` and the frozen prior
    acceptance length ({} and None when there are none or the file is unreadable; None too while
    the prior is still pooling: load_pool)."""
    costs, prior, _ = _read_costs(key)
    return costs, prior


def load_pool(key: Mapping[str, Any]) -> dict[str, float] | None:
    """The speculating row-steps pooled so far for `key`'s prior, while it is not frozen."""
    return _read_costs(key)[2]


def _read_costs(key: Mapping[str, Any]) -> tuple[dict[int, dict[int, float]], float | None, dict[str, float] | None]:
    path = costs_path(key)
    if not path.exists():
        return {}, None, None
    try:
        data = json.loads(path.read_text())
        if data.get("version") != COSTS_VERSION or data.get("key") != json.loads(json.dumps(key, default=str)):
            raise ValueError("another version or key")
        costs = {int(b): {int(k): float(s) for k, s in ks.items()} for b, ks in data["buckets"].items()}
        if any(s <= 0 or not math.isfinite(s) for ks in costs.values() for s in ks.values()):
            raise ValueError("a non-positive step time")
        prior = data.get("acceptance_length")
        pool = data.get("acceptance_pool")
        pool = None if pool is None else {n: float(pool[n]) for n in ("steps", "accepted", "k")}
        if pool is not None and not (pool["steps"] >= 0 and 0 <= pool["accepted"] <= pool["k"]):
            raise ValueError("an impossible acceptance pool")
        return costs, None if prior is None else float(prior), pool
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("quickdraft: ignoring the cached step costs %s (%s); measuring them again", path, exc)
        return {}, None, None


def save_costs(key: Mapping[str, Any], costs: Mapping[int, Mapping[int, float]], acceptance_length: float | None,
               pool: Mapping[str, float] | None = None) -> None:
    """Write the calibration atomically (several processes may calibrate the same key at once:
    the last one wins, each file whole): the costs, the frozen prior acceptance length (None while
    it pools) and the pool so far (another process goes on pooling from it)."""
    write_cached(key, {"version": COSTS_VERSION, "key": key, "acceptance_length": acceptance_length,
                       "acceptance_pool": None if acceptance_length is not None or pool is None else dict(pool),
                       "buckets": {str(b): {str(k): s for k, s in sorted(ks.items())} for b, ks in sorted(costs.items())}})


def write_cached(key: Mapping[str, Any], data: Mapping[str, Any]) -> None:
    """Write `data` as `key`'s file in the costs cache, atomically (the last writer wins, each
    file whole); a failure is a warning (the next engine measures again)."""
    path = costs_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("quickdraft: cannot cache the measured step costs in %s (%s); the next engine measures "
                    "them again", path, exc.strerror or exc)


class AutoPolicy(SpecPolicy):
    name = "auto"
    warmup = 2  # steps per bucket not timed (first-call costs)
    samples = 6  # timed steps per calibrated k (medians: a loaded machine jitters)
    probe_first = 4  # while off: speculate once after this many steps, twice as many each time after
    probe_every = 32  # ... up to once every this many steps
    margin = 1.03  # speculation must predict this much over plain decoding
    prior_steps = 2.0  # the prior acceptance length counts as this many steps of a new request
    prior_samples = 48  # speculating row-steps pooled (calibration's included) before the prior is frozen

    def __init__(self, k_max: int, key: Mapping[str, Any], method: str = "draft", persist: bool = True):
        super().__init__(k_max)
        self.key = dict(key)
        self.method = method
        self.persist = persist
        self.arms = sorted({0, 1, k_max})
        self._load()

    def _load(self) -> None:
        digest = key_digest(self.key)
        # engines of one key share its calibration; without a key (persist=False) a policy has its own
        calibrated, self._priors, self._pools = (_CALIBRATED, _PRIOR, _POOL) if self.persist else ({}, {}, {})
        if digest not in calibrated:
            costs, prior, pool = _read_costs(self.key) if self.persist else ({}, None, None)
            calibrated[digest] = {b: c for b, c in costs.items() if set(self.arms) <= set(c)}  # else measured again
            if prior is not None:
                self._priors[digest] = prior
            elif pool is not None:
                self._pools[digest] = pool
        self.costs = calibrated[digest]  # frozen per bucket once calibrated
        self._digest = digest
        self._timing: dict[int, dict[int, list[float]]] = {}  # bucket -> k -> step seconds, while calibrating
        self._seen: dict[int, int] = {}  # bucket -> steps seen while calibrating
        self._plan: dict[int, int] = {}  # bucket -> the k the calibration schedule ran last step
        self._idle = 0
        self._gap = self.probe_first  # off steps before the next probe
        self._mode: dict = {}  # bucket -> the last decision ("off", "lower", "on"); (bucket, "lower") once logged

    def set_key(self, key: Mapping[str, Any]) -> None:
        """The forward changed (an AOT build finished): its own costs, cached or measured anew."""
        if dict(key) != self.key:
            self.key = dict(key)
            self._load()

    @property
    def prior_length(self) -> float:
        """A new request's acceptance length at k_max before its own steps: frozen once
        prior_samples speculating row-steps (the calibration's among them, any k > 0, projected to
        k_max through their i.i.d. alpha) are pooled; until then the pooled estimate, but never
        below the neutral 1 + k_max / 2, so that a few unlucky first steps (the first request's
        opening, where the calibration runs) do not turn speculation off before it has been
        measured (on an AMD EPYC Zen 3 the bundled pair's EAGLE-3 head measured 1.33 on the six
        calibration steps at k = 5 of a 16-token warm-up, against 3.47 over whole requests, and
        the default then decoded mostly plain)."""
        frozen = self._priors.get(self._digest)
        if frozen is not None:
            return frozen
        neutral = 1.0 + 0.5 * self.k_max
        pool = self._pools.get(self._digest)
        return neutral if not pool or pool["steps"] <= 0 else max(neutral, self._pooled_length(pool))

    def _pooled_length(self, pool: Mapping[str, float]) -> float:
        steps = pool["steps"]
        alpha = solve_alpha(1.0 + pool["accepted"] / steps, max(1, round(pool["k"] / steps)))
        return expected_tokens(alpha, self.k_max)

    # -- per row ------------------------------------------------------------------------------

    def new_state(self) -> RowState:
        return RowState(k=self.k_max)

    def observe(self, state: RowState, drafted: int, accepted: int) -> None:
        super().observe(state, drafted, accepted)
        k = state.last_k
        if k > 0:  # a speculating step, drafted or not: acceptance length per step at k
            state.spec_steps = 0.9 * state.spec_steps + 1.0
            state.spec_accepted = 0.9 * state.spec_accepted + accepted
            state.spec_k = 0.9 * state.spec_k + k
            state.alpha = None
            if self._digest not in self._priors:
                self._pool_step(k, accepted)

    def alpha(self, state: RowState) -> float:
        """The row's i.i.d. acceptance: its running acceptance length per speculating step (with
        the calibration's as a prior worth prior_steps steps), solved at the k it was measured at."""
        if state.alpha is None:
            w = self.prior_steps
            length = (state.spec_accepted + state.spec_steps + w * self.prior_length) / (state.spec_steps + w)
            k_seen = (state.spec_k + w * self.k_max) / (state.spec_steps + w)
            state.alpha = solve_alpha(length, max(1, round(k_seen)))
        return state.alpha

    def expected(self, state: RowState, k: int) -> float:
        """Row's expected emitted tokens per step at k (1 at k = 0)."""
        return 1.0 if k <= 0 else expected_tokens(self.alpha(state), k)

    # -- the batch ----------------------------------------------------------------------------

    def cost(self, batch_size: int, k: int) -> float | None:
        """Calibrated seconds of one step at batch_size rows and k (None while calibrating)."""
        c = self.costs.get(bucket(batch_size))
        if c is None:
            return None
        if k in c:
            return c[k]
        lo, hi = 1, self.k_max
        return c[lo] + (c[hi] - c[lo]) * (k - lo) / (hi - lo)

    def rates(self, states: list[RowState], k_bound: int) -> dict[int, float] | None:
        """Predicted tokens per second for each k in 0..min(k_max, k_bound) (None while calibrating)."""
        B = len(states)
        if self.cost(B, 0) is None:
            return None
        out = {0: B / self.cost(B, 0)}
        for k in range(1, min(self.k_max, k_bound) + 1):
            out[k] = sum(self.expected(s, k) for s in states) / self.cost(B, k)
        return out

    def choose(self, states: list[RowState], k_bound: int) -> list[int]:
        B = len(states)
        b = bucket(B)
        rates = self.rates(states, k_bound)
        if rates is None:  # calibrating this bucket: its schedule, not the clock, picks k
            seen = self._seen.get(b, 0)
            self._seen[b] = seen + 1
            k = 0 if seen < self.warmup else self.arms[(seen - self.warmup) % len(self.arms)]
            k = min(k, k_bound)
            self._plan[b] = k if seen >= self.warmup else -1
        else:
            spec = [c for c in rates if c > 0]
            best = max(spec, key=lambda c: (rates[c], -c)) if spec else 0
            k = best if spec and rates[best] > self.margin * rates[0] else 0
            self._idle = self._idle + 1 if k == 0 else 0
            if k == 0 and spec and self._idle >= self._gap:
                k, self._idle, self._gap = best, 0, min(2 * self._gap, self.probe_every)
            else:
                if k > 0:
                    self._gap = self.probe_first
                self._report(b, k, rates, best, k_bound)
        for s in states:
            s.last_k = k
        return [k] * B

    def _pool_step(self, k: int, accepted: int) -> None:
        pool = self._pools.setdefault(self._digest, {"steps": 0.0, "accepted": 0.0, "k": 0.0})
        pool["steps"] += 1
        pool["accepted"] += accepted
        pool["k"] += k
        if pool["steps"] >= self.prior_samples:
            prior = self._priors[self._digest] = self._pooled_length(pool)
            del self._pools[self._digest]
            log.info("quickdraft: acceptance length at k = %d measured over %d speculating steps: %.2f (what a new "
                     "request starts from, with the measured step costs)", self.k_max, int(pool["steps"]), prior)
            if self.persist and self.costs:
                save_costs(self.key, self.costs, prior)

    def observe_step(self, batch_size: int, k: int, seconds: float) -> None:
        b = bucket(batch_size)
        if b in self.costs or self._plan.get(b, -1) != k:
            return
        times = self._timing.setdefault(b, {})
        times.setdefault(k, []).append(seconds)
        if all(len(times.get(a, ())) >= self.samples for a in self.arms):
            self.costs[b] = {a: statistics.median(times[a]) for a in self.arms}  # frozen from here on
            del self._timing[b]
            c = self.costs[b]
            log.info("quickdraft: measured decode steps on this machine (method %s, batch %s): plain %.2f ms, "
                     "%s", self.method, _bucket_name(b), 1e3 * c[0],
                     ", ".join(f"k = {a} {1e3 * c[a]:.2f} ms" for a in self.arms if a > 0))
            if self.persist:
                save_costs(self.key, self.costs, self._priors.get(self._digest), self._pools.get(self._digest))

    def _report(self, b: int, k: int, rates: dict[int, float], best: int, k_bound: int) -> None:
        """One line when the decision for a bucket turns speculation off (a warning the first
        time) or back on, and the first time it lowers k."""
        mode = "off" if k == 0 else "lower" if k < min(self.k_max, k_bound) else "on"
        before = self._mode.get(b, "on")
        self._mode[b] = mode
        top = min(self.k_max, k_bound)
        if mode == "off" and before != "off":
            level = logging.INFO if (b, "off") in self._mode else logging.WARNING  # a warning once, then info
            self._mode[(b, "off")] = "logged"
            log.log(level, "quickdraft: speculation off for this model on this machine (batch %s): measured %.1f tok/s "
                    "plain vs %.1f tok/s predicted for %s at k = %d (%.1f at k = %d); probing after %d steps, then "
                    "less often (up to every %d)", _bucket_name(b), rates[0], rates[best], self.method, best, rates[top],
                    top, self._gap, self.probe_every)
        elif mode == "lower" and (b, "lower") not in self._mode:
            self._mode[(b, "lower")] = "logged"
            log.info("quickdraft: speculating k = %d instead of %d (batch %s): %.1f tok/s predicted vs %.1f at k = %d "
                     "and %.1f plain, from the measured step costs", k, top, _bucket_name(b), rates[k], rates[top],
                     top, rates[0])
        elif mode != "off" and before == "off":
            log.info("quickdraft: speculation back on (batch %s): %.1f tok/s predicted at k = %d vs %.1f plain",
                     _bucket_name(b), rates[k], k, rates[0])


def _bucket_name(b: int) -> str:
    return "1" if b == 1 else str(b) if b == 2 else f"{b // 2 + 1}-{b}"
