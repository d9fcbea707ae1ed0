"""The cost model: this hardware's measured costs (the `Profile` format), and the
speculation length k they make best per batch size. Pure lookups, no timing: the harness
that measures a profile is `quickdraft.bench.measure`.

A step of speculative decoding for a batch of B rows costs the proposer's time to draft k
tokens, T_propose(B, k), plus one target forward over k + 1 query tokens per row, T(B, k+1),
and emits E(k) tokens per row on average. Its goodput (tokens per second) is

    goodput(B, k) = B * E(k) / (T_propose(B, k) + T(B, k + 1)),   goodput(B, 0) = B / T(B, 1)

(k = 0 is plain decoding). T grows with B and q once the target's matmuls stop being bound by
reading the weights, so a k that pays at batch 1 can lose at batch 32: the best k shrinks with
B, down to 0. E(k) = 1 + sum_{i<k} P(the accepted run reaches draft position i+1), measured at
k_max (for a chain the first i drafts do not depend on k), which is more faithful than the
i.i.d. (1 - a^(k+1)) / (1 - a): acceptance on code is bursty.

Two refinements keep other proposers honest; both reduce to the formula above for a draft
model's chain. A proposer that drafts nothing in a share 1 - r of steps (no n-gram match)
gets E(k) = 1 + r * sum(...), and a batch in which no row drafted (probability (1 - r)^B)
runs a plain 1-token forward. A tree verifies 1 + N nodes, not k + 1 (`verify_q`, from the
proposer's `max_draft_tokens(k)`: exact for chains and top-w trees, an upper bound for
suffix and lookahead trees).

The measured numbers live in a JSON profile (version 1, see `Profile`), written by
`quickdraft tune` and read by the engine's adaptive policy through `step_time`,
`propose_time` and `best_k`, which are cheap (no IO, memoised) and interpolate linearly in B
between measured batch sizes (clamped outside). A profile written by `quickdraft select` also
carries its `choice` (`Choice`: method, draft, k, measured end to end), which `LLM(profile=...)`
uses when no method or draft is given.
"""

from __future__ import annotations

import json
import logging
import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import QuickdraftError

log = logging.getLogger("quickdraft")

PROFILE_VERSION = 1


# ---- the goodput model (pure) ------------------------------------------------------------

def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits with k drafts under i.i.d. acceptance alpha: (1 - a^(k+1)) / (1 - a)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_measured(acceptance_per_pos: Sequence[float], k: int, draft_rate: float = 1.0) -> float:
    """Tokens per step from measured acceptance: 1 + r * sum_{i<k} P(run reaches position i+1).
    Positions past the measured ones continue geometrically at the last measured ratio."""
    if k <= 0:
        return 1.0
    acc = list(acceptance_per_pos[:k])
    if len(acc) < k:
        last = acc[-1] if acc else 0.0
        ratio = acc[-1] / acc[-2] if len(acc) >= 2 and acc[-2] > 0 else last
        while len(acc) < k:
            last *= ratio
            acc.append(last)
    return 1.0 + draft_rate * sum(acc)


def solve_alpha(mean_acceptance_length: float, k: int) -> float:
    """The i.i.d. alpha with expected_tokens(alpha, k) = mean_acceptance_length (bisection)."""
    if k <= 0 or mean_acceptance_length <= 1.0:
        return 0.0
    if mean_acceptance_length >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < mean_acceptance_length else (lo, mid)
    return (lo + hi) / 2


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through sorted xs, clamped outside."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    j = bisect_left(xs, x)
    if xs[j] == x:
        return ys[j]
    x0, x1 = xs[j - 1], xs[j]
    return ys[j - 1] + (ys[j] - ys[j - 1]) * (x - x0) / (x1 - x0)


def _lookup(bs: Sequence[float], cols: Sequence[int], by_col: Sequence[Sequence[float]], b: float, c: float) -> float:
    """A table measured at batch sizes bs (rows) and columns cols, stored column-major
    (by_col[j][i]): linear in B within each column, then linear between columns; clamped."""
    if c <= cols[0] or c >= cols[-1] or c in cols:
        j = 0 if c <= cols[0] else len(cols) - 1 if c >= cols[-1] else cols.index(c)
        return _interp(bs, by_col[j], b)
    j = bisect_left(cols, c)
    t0, t1 = _interp(bs, by_col[j - 1], b), _interp(bs, by_col[j], b)
    return t0 + (t1 - t0) * (c - cols[j - 1]) / (cols[j] - cols[j - 1])


# ---- the profile -------------------------------------------------------------------------

@dataclass
class MethodProfile:
    options: dict[str, Any]  # the proposer's options (spec_options) when measured
    ks: list[int]  # measured speculation lengths, increasing, >= 1
    propose_s: list[list[float]]  # [per batch size][per k] median seconds of one propose()
    acceptance_per_pos: list[float]  # P(accepted run reaches draft position i+1 | the step drafted)
    alpha: float  # i.i.d. acceptance that gives the same mean acceptance length at max(ks)
    draft_rate: float = 1.0  # share of steps in which the proposer drafted anything
    verify_q: list[int] | None = None  # [per k] query tokens of the verify forward; None = k + 1

    def verify_tokens(self, k: int) -> float:
        if self.verify_q is None:
            return k + 1.0
        return _interp(self.ks, self.verify_q, k)


@dataclass(frozen=True)
class Choice:
    """What `quickdraft select` measured fastest on its workload: the speculation to run."""

    method: str  # a proposer's name, or "none": plain decoding was fastest
    k: int  # num_speculative_tokens (0 with method "none")
    draft: str | None = None  # LLM's draft argument: a folder, a .gguf, a named model, "self"; None
    options: dict[str, Any] = field(default_factory=dict)  # spec_options
    speedup: float = 1.0  # measured tokens/s over plain decoding's, paired (1 for "none")
    workload: str = ""  # what it was measured on (a prompts file, a built-in workload)

    def to_dict(self) -> dict:
        return {"method": self.method, "k": self.k, "draft": self.draft, "options": dict(self.options),
                "speedup": self.speedup, "workload": self.workload}

    @classmethod
    def from_dict(cls, data: Any, where: str = "choice") -> Choice:
        c = _Checker(where)
        if not isinstance(data, Mapping):
            c.fail("", "must be a JSON object")
        c.string(data, "method")
        k = c.integer(data, "k", 0)
        if (data["method"] == "none") != (k == 0):
            c.fail("k", "must be 0 exactly when method is 'none'")
        if data.get("draft") is not None:
            c.string(data, "draft")
        options = data.get("options", {})
        if not isinstance(options, Mapping):
            c.fail("options", "must be an object")
        c.string(data, "workload", required=False)
        speedup = c.number(data, "speedup", 0.0, math.inf, default=1.0)
        return cls(data["method"], k, data.get("draft"), dict(options), speedup, data.get("workload", ""))


@dataclass
class Profile:
    """A measured profile. JSON (version 1) is `to_dict()`: these fields, with `methods` as
    {name: {"options", "ks", "propose_s", "acceptance_per_pos", "alpha", "draft_rate"
    (optional, default 1), "verify_q" (optional, default k + 1)}} and `best_k_by_batch` under
    "best_k". Treat it as read-only once built: lookups are memoised."""

    device: str  # cpu | cuda | mps
    cpu_or_gpu_name: str
    torch: str  # torch.__version__
    target: str  # the target's folder
    dtype: str  # float32 | bfloat16 | float16
    context: int  # tokens cached per row while timing
    batch_sizes: list[int]  # increasing
    query_lengths: list[int]  # increasing, from 1: query tokens per row of the timed target forwards
    target_step_s: list[list[float]]  # [per batch size][per query length] median seconds
    methods: dict[str, MethodProfile]
    # JSON "best_k": {method: {str(B): k}} at the measured batch sizes, as chosen when tuning
    best_k_by_batch: dict[str, dict[str, int]] = field(default_factory=dict)
    created: str = ""  # ISO date
    command: str = ""
    version: int = PROFILE_VERSION
    threads: int = 0  # torch's CPU threads while timing (0: not recorded); CPU step times depend on it
    choice: Choice | None = None  # `quickdraft select`'s pick (what LLM(profile=...) runs); None: tune's

    def __post_init__(self) -> None:
        self._bs = [float(b) for b in self.batch_sizes]
        self._t_by_q = [[row[j] for row in self.target_step_s] for j in range(len(self.query_lengths))]
        self._p_by_k = {name: [[row[j] for row in m.propose_s] for j in range(len(m.ks))]
                        for name, m in self.methods.items()}
        self._memo: dict[tuple, float | int] = {}

    # -- lookups the adaptive policy calls every step (memoised) ---------------------------

    def step_time(self, batch_size: float, q: float) -> float:
        """Seconds of one target forward over q query tokens per row for batch_size rows."""
        key = ("T", batch_size, q)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = _lookup(self._bs, self.query_lengths, self._t_by_q, batch_size, q)
        return t

    def propose_time(self, method: str, batch_size: float, k: float) -> float:
        """Seconds of one propose() of k tokens for batch_size rows (0 at k = 0)."""
        if k <= 0:
            return 0.0
        key = ("P", method, batch_size, k)
        t = self._memo.get(key)
        if t is None:
            t = _lookup(self._bs, self._method(method).ks, self._p_by_k[method], batch_size, k)
            self._memo[key] = t
        return t

    def goodput(self, method: str, batch_size: float, k: int) -> float:
        """Predicted tokens per second for batch_size rows at speculation length k (0 = plain)."""
        B = batch_size
        if k <= 0:
            return B / self.step_time(B, 1)
        m = self._method(method)
        r = m.draft_rate
        E = expected_tokens_measured(m.acceptance_per_pos, k, r)
        none_drafted = (1.0 - r) ** B  # every row came up empty: a plain 1-token forward
        cost = self.propose_time(method, B, k) + (1.0 - none_drafted) * self.step_time(B, m.verify_tokens(k)) \
            + none_drafted * self.step_time(B, 1)
        return B * E / cost

    def best_k(self, method: str, batch_size: float) -> int:
        """The k (0 = no speculation, or one of the method's measured ks) of highest goodput;
        ties go to the smaller k."""
        key = ("K", method, batch_size)
        k = self._memo.get(key)
        if k is None:
            best, k = self.goodput(method, batch_size, 0), 0
            for cand in self._method(method).ks:
                g = self.goodput(method, batch_size, cand)
                if g > best * (1 + 1e-9):
                    best, k = g, cand
            self._memo[key] = k
        return k

    def best_k_table(self) -> dict[str, dict[str, int]]:
        return {name: {str(b): self.best_k(name, b) for b in self.batch_sizes} for name in self.methods}

    def _method(self, method: str) -> MethodProfile:
        m = self.methods.get(method)
        if m is None:
            raise QuickdraftError(f"the profile has no method {method!r}; it has {', '.join(self.methods) or 'none'}")
        return m

    # -- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        methods = {}
        for name, m in self.methods.items():
            d = {"options": dict(m.options), "ks": list(m.ks), "propose_s": [list(r) for r in m.propose_s],
                 "acceptance_per_pos": list(m.acceptance_per_pos), "alpha": m.alpha, "draft_rate": m.draft_rate}
            if m.verify_q is not None:
                d["verify_q"] = list(m.verify_q)
            methods[name] = d
        return {"version": self.version, "device": self.device, "cpu_or_gpu_name": self.cpu_or_gpu_name,
                "torch": self.torch, "target": self.target, "dtype": self.dtype, "context": self.context,
                "batch_sizes": list(self.batch_sizes), "query_lengths": list(self.query_lengths),
                "target_step_s": [list(r) for r in self.target_step_s], "methods": methods,
                "best_k": {n: dict(t) for n, t in self.best_k_by_batch.items()}, "created": self.created,
                "command": self.command, "threads": self.threads,
                **({"choice": self.choice.to_dict()} if self.choice is not None else {})}

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> Profile:
        """Validate a JSON-shaped profile; QuickdraftError naming the bad field otherwise."""
        c = _Checker(where)
        if not isinstance(data, Mapping):
            c.fail("", "must be a JSON object")
        version = data.get("version")
        if version != PROFILE_VERSION:
            c.fail("version", f"must be {PROFILE_VERSION}, got {version!r}")
        for key in ("device", "cpu_or_gpu_name", "torch", "target", "dtype"):
            c.string(data, key)
        for key in ("created", "command"):
            c.string(data, key, required=False)
        context = c.integer(data, "context", 0)
        threads = c.integer({"threads": data.get("threads", 0)}, "threads", 0)
        bs = c.increasing(data, "batch_sizes", 1)
        qs = c.increasing(data, "query_lengths", 1)
        if qs[0] != 1:
            c.fail("query_lengths", "must start at 1 (plain decoding's step)")
        steps = c.matrix(data, "target_step_s", len(bs), len(qs), positive=True)
        methods_in = data.get("methods")
        if not isinstance(methods_in, Mapping):
            c.fail("methods", "must be an object of method name -> measurements")
        methods = {}
        for name, m in methods_in.items():
            mc = _Checker(f"{where}: methods.{name}")
            if not isinstance(m, Mapping):
                mc.fail("", "must be an object")
            options = m.get("options", {})
            if not isinstance(options, Mapping):
                mc.fail("options", "must be an object")
            ks = mc.increasing(m, "ks", 1)
            propose = mc.matrix(m, "propose_s", len(bs), len(ks), positive=False)
            acc = m.get("acceptance_per_pos")
            if not isinstance(acc, list) or len(acc) < ks[-1] or not all(_is_num(a) and 0 <= a <= 1 for a in acc):
                mc.fail("acceptance_per_pos", f"must be a list of at least {ks[-1]} numbers in [0, 1]")
            alpha = mc.number(m, "alpha", 0.0, 1.0)
            rate = mc.number(m, "draft_rate", 0.0, 1.0, default=1.0)
            verify_q = None
            if m.get("verify_q") is not None:
                verify_q = mc.int_list(m, "verify_q", 2)
                if len(verify_q) != len(ks):
                    mc.fail("verify_q", f"must have one entry per k ({len(ks)})")
            needed = max(verify_q) if verify_q else ks[-1] + 1
            if needed > qs[-1]:
                mc.fail("ks", f"verifying needs {needed} query tokens but query_lengths stop at {qs[-1]}")
            methods[name] = MethodProfile(dict(options), ks, propose, [float(a) for a in acc], alpha, rate,
                                          verify_q)
        best = data.get("best_k", {})
        if not isinstance(best, Mapping) or not all(
                isinstance(t, Mapping) and all(isinstance(b, str) and _is_int(v) and v >= 0 for b, v in t.items())
                for t in best.values()):
            c.fail("best_k", "must be an object {method: {batch size: k}}")
        choice = None if data.get("choice") is None else Choice.from_dict(data["choice"], f"{where}: choice")
        return cls(data["device"], data["cpu_or_gpu_name"], data["torch"], data["target"], data["dtype"], context,
                   bs, qs, steps, methods, {n: dict(t) for n, t in best.items()}, data.get("created", ""),
                   data.get("command", ""), version, threads, choice)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Checker:
    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, message: str):
        raise QuickdraftError(f"{self.where}{': ' + key if key else ''} {message}")

    def string(self, d: Mapping, key: str, required: bool = True) -> None:
        if (key in d or required) and not isinstance(d.get(key), str):
            self.fail(key, "must be a string")

    def integer(self, d: Mapping, key: str, low: int) -> int:
        v = d.get(key)
        if not _is_int(v) or v < low:
            self.fail(key, f"must be an integer >= {low}, got {v!r}")
        return v

    def number(self, d: Mapping, key: str, low: float, high: float, default: float | None = None) -> float:
        v = d.get(key, default)
        if not _is_num(v) or not low <= v <= high:
            self.fail(key, f"must be a number in [{low}, {high}], got {v!r}")
        return float(v)

    def int_list(self, d: Mapping, key: str, low: int) -> list[int]:
        v = d.get(key)
        if not isinstance(v, list) or not v or not all(_is_int(x) and x >= low for x in v):
            self.fail(key, f"must be a non-empty list of integers >= {low}")
        return list(v)

    def increasing(self, d: Mapping, key: str, low: int) -> list[int]:
        v = self.int_list(d, key, low)
        if any(a >= b for a, b in zip(v, v[1:])):
            self.fail(key, "must be strictly increasing")
        return v

    def matrix(self, d: Mapping, key: str, rows: int, cols: int, positive: bool) -> list[list[float]]:
        v = d.get(key)
        ok = isinstance(v, list) and len(v) == rows and all(
            isinstance(r, list) and len(r) == cols and all(_is_num(x) and (x > 0 if positive else x >= 0) for x in r)
            for r in v)
        if not ok:
            self.fail(key, f"must be {rows} lists (one per batch size) of {cols} "
                           f"{'positive' if positive else 'non-negative'} numbers")
        return [[float(x) for x in r] for r in v]


def save_profile(path: str | Path, profile: Profile | Mapping) -> None:
    data = profile.to_dict() if isinstance(profile, Profile) else dict(profile)
    Profile.from_dict(data)  # never write a profile load_profile would refuse
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise QuickdraftError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuickdraftError(f"profile {path} is not valid JSON: {exc}") from None
    profile = Profile.from_dict(data, where=f"profile {path}")
    if profile.device == "cpu" and profile.threads and profile.threads != torch.get_num_threads():
        log.warning("quickdraft: profile %s was measured with %d CPU threads, this process uses %d; its step "
                    "times are off by that much (the goodput policy recalibrates them as it runs)",
                    path, profile.threads, torch.get_num_threads())
    return profile
