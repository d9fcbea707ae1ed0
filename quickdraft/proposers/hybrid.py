"""The hybrid proposer: several methods at once, the one that pays chosen per request and step.

`method="suffix,draft"` (or a list, `["suffix", "draft"]`) combines the free proposers (suffix
decoding and n-gram lookup: a CPU lookup, no model) with at most one model proposer (a draft
model, a self-draft or an EAGLE-3 head). `method="auto"` is the free ones plus the model's own
draft or head when there is one (quickdraft.llm expands it).

Each step, for each row:

1. The free members propose (every step: they cost next to nothing), so each row has its free
   candidates; the model member proposes for the whole batch only when the cost model says it
   pays for the batch (or every `probe_every`-th step, so its estimates stay current; and
   while its cost is being measured).
2. Each candidate's value is its expected emitted tokens E = expected_tokens(alpha, depth)
   (quickdraft.policy.costs), alpha solved from that row's running acceptance of that method
   (accepted tokens per step and the depth it drafted, exponentially weighted, with the mean over
   earlier requests as a prior). The batch runs the model when
   sum_b max(E_free, E_model) / (c_verify + k c_token) > sum_b E_free / c_verify, with c_verify
   the measured step without the model's drafting and c_token its drafting per token
   (medians of the first steps of each batch-size bucket, then frozen and cached on disk as
   the auto policy's costs are, under the engine's cost key: a later engine, in this process
   or another, starts from them and measures nothing, so from then on a seeded request's
   choices are a function of its tokens, not of the clock; `draft_cost` fixes c_token /
   c_verify instead). Each row then takes its candidate of largest E (a free one on a tie).
3. Every candidate a member produced, chosen or not, is scored after the fact against the
   tokens the row committed (its "shadow" acceptance: how deep its tree follows them), so the
   estimates of methods not chosen stay current; for the chosen candidate this is exactly
   what the verifier accepted.

4. With `merge` (off by default), a row with several candidates verifies them in one token tree: its
   chosen candidate, then the others (largest E first) grafted on where they part from it, at
   most k nodes more and no more than a row may draft. The verifier keeps the longest path the
   target accepts, so a row gets the better of its candidates wherever they differ, for the
   price of their extra nodes in the verify step (a few rows: at batch 1 on a CPU nearly free).
   The model's candidate joins as a deterministic chain only (greedy requests, or a model that
   drafts deterministically); a step in which a row verifies the model's sampled draft (its q)
   merges nothing.

The rows' chosen candidates become one draft (quickdraft.proposers.base.Draft): a chain when
all are chains, else a token tree (a chain is a tree whose node i hangs under node i - 1). With
q (the model drafted a row by sampling), the deterministic rows' q is one-hot at their tokens,
which the rejection rule treats exactly as a deterministic draft; such rows are chains (a
tree's first path) since a tree with q is a sampled tree. Verification is the engine's one
verify with the same rules, so the output is lossless whatever the choices.

The model member keeps its state consistent for the rows it did not draft: it hears, per row,
how many of its own drafted tokens the committed tokens follow (its cached positions for them
stay valid) and catches up on the rest before it next drafts.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import QuickdraftError
from ..policy.auto import bucket, costs_path, key_digest, write_cached
from ..policy.costs import expected_tokens, solve_alpha
from .base import Draft, ProposeBatch, Proposer, VerifyResult, check_int

log = logging.getLogger("quickdraft")

COSTS_VERSION = 1
# measured (c_verify, c_token) per bucket by cost-key digest: engines of one key in a process share them
_MEASURED: dict[str, dict[int, tuple[float, float]]] = {}

FREE_METHODS = ("suffix", "ngram")  # deterministic proposers that read the tokens only
AUTO_FREE = ("suffix", "ngram")  # what method="auto" combines with the model's draft or head
OWN_OPTIONS = ("draft_cost", "probe_every", "merge")


def parse_method(method) -> tuple[str, ...]:
    """The method names a `method` value gives: one name, a comma-separated string of names or a
    list of names (clear errors on anything else). The one check of a method's form; the names
    themselves are checked by the registry (quickdraft.proposers.get)."""
    if isinstance(method, str):
        names = tuple(m.strip() for m in method.split(","))
    elif isinstance(method, (list, tuple)) and all(isinstance(m, str) for m in method):
        names = tuple(m.strip() for m in method)
    else:
        raise QuickdraftError(f"method must be a name or a list of names, got {method!r}", field="method")
    if not names or any(not n for n in names):
        raise QuickdraftError(f"method has an empty name: {method!r}", field="method")
    if len(names) > 1:
        for special in ("none", "auto"):
            if special in names:
                raise QuickdraftError(f"method {special!r} cannot be part of a list of methods", field="method")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise QuickdraftError(f"method lists {', '.join(dup)} twice", field="method")
    return names


def method_name(method) -> str:
    """The canonical spelling of a method value: its names joined by commas."""
    return ",".join(parse_method(method))


@functools.cache
def hybrid_class(names: tuple[str, ...], registry_items: tuple) -> type[HybridProposer]:
    """The HybridProposer subclass combining `names` (checked: known, at most one model
    proposer, the others free). Class attributes say what LLM must load for it."""
    registry = dict(registry_items)
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise QuickdraftError(f"method must be one of none, auto, {', '.join(sorted(registry))} or a list of them, "
                              f"got {unknown[0]!r}", field="method")
    models = [n for n in names if registry[n].needs_draft_model]
    if len(models) > 1:
        raise QuickdraftError(f"a list of methods takes at most one model proposer, got {', '.join(models)}",
                              field="method")
    other = [n for n in names if n not in models and n not in FREE_METHODS]
    if other:
        raise QuickdraftError(f"method {other[0]!r} cannot be combined with others (lists take "
                              f"{', '.join(FREE_METHODS)} and one of {', '.join(sorted(n for n, c in registry.items() if c.needs_draft_model))})",
                              field="method")
    model = models[0] if models else None
    attrs = dict(MEMBERS=names, MODEL=model, needs_draft_model=model is not None,
                 draft_is_head=model is not None and registry[model].draft_is_head,
                 CLASSES=tuple(registry[n] for n in names))
    return type(f"HybridProposer[{','.join(names)}]", (HybridProposer,), attrs)


@dataclass
class _Stat:
    """A method's acceptance for one row (or over all rows: the prior), exponentially weighted."""
    steps: float = 0.0
    accepted: float = 0.0  # accepted tokens per step, summed with the weights
    depth: float = 0.0  # the candidates' depths, likewise


@dataclass
class _Row:
    stats: dict[str, _Stat] = field(default_factory=dict)
    # candidates not scored yet: (method, committed length before the step, tokens, parents)
    pending: list[tuple[str, int, list[int], list[int]]] = field(default_factory=list)


def _row_lists(draft: Draft) -> list[tuple[list[int], list[int]]]:
    """Each row of a draft as (tokens, parents) lists, a chain's parents i - 1 (a -1 token ends
    a chain; a tree's unused nodes stay, token -1)."""
    tokens = draft.tokens.tolist()
    if draft.parents is None:
        rows = []
        for t in tokens:
            n = next((i for i, x in enumerate(t) if x < 0), len(t))
            rows.append((t[:n], list(range(-1, n - 1))))
        return rows
    return list(zip(tokens, draft.parents.tolist()))


def _depth(tokens: list[int], parents: list[int]) -> int:
    depth = [0] * len(tokens)
    most = 0
    for i, (t, p) in enumerate(zip(tokens, parents)):
        if t >= 0:
            depth[i] = 1 if p < 0 else depth[p] + 1
            most = max(most, depth[i])
    return most


def _is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def _first_path(tokens: list[int], parents: list[int]) -> list[int]:
    """A tree's likeliest path (siblings are listed likelier first)."""
    path, node = [], -1
    while True:
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t >= 0), None)
        if child is None:
            return path
        path.append(tokens[child])
        node = child


def _merge(first: tuple[list[int], list[int]], other: tuple[list[int], list[int]],
           most: int) -> tuple[list[int], list[int]]:
    """`first` as it is, then `other`'s nodes grafted onto it as a trie (a node whose path is
    already there is shared), parents before children, at most `most` nodes in all (the rest of
    `other` left out: a left-out node's subtree with it)."""
    tokens, parents = list(first[0]), list(first[1])
    child = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents)) if t >= 0}
    where: list[int | None] = []
    for t, p in zip(*other):
        at = None
        if t >= 0 and (p < 0 or (p < len(where) and where[p] is not None)):
            parent = -1 if p < 0 else where[p]
            at = child.get((parent, t))
            if at is None and len(tokens) < most:
                at = len(tokens)
                tokens.append(t)
                parents.append(parent)
                child[(parent, t)] = at
        where.append(at)
    return tokens, parents


def _walk(tokens: list[int], parents: list[int], emitted: Sequence[int]) -> tuple[int, bool]:
    """How deep a candidate follows the emitted tokens, and whether that is final (it stopped
    at a known token, or at a leaf)."""
    node, depth = -1, 0
    while True:
        children = [i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t >= 0]
        if not children:
            return depth, True
        if depth >= len(emitted):
            return depth, False
        node = next((i for i in children if tokens[i] == emitted[depth]), None)
        if node is None:
            return depth, True
        depth += 1


class HybridProposer(Proposer):
    """Several proposers, the best per row and step (module doc). Built through hybrid_class,
    which sets the members."""
    MEMBERS: tuple[str, ...] = ()
    MODEL: str | None = None
    CLASSES: tuple = ()
    decay = 0.8  # a row's estimates: weight of the past per step scored
    prior_decay = 0.98  # the prior over all rows
    prior_steps = 2.0  # the prior counts as this many steps of a new row
    warmup = 2  # steps per bucket not timed
    samples = 6  # timed steps per bucket (medians)

    def __init__(self, members: dict[str, Proposer], draft_cost: float | None = None, probe_every: int = 16,
                 merge: bool = False, device: torch.device | str = "cpu"):
        self.members = members
        self.free = [(n, members[n]) for n in self.MEMBERS if n != self.MODEL]
        self.model = None if self.MODEL is None else members[self.MODEL]
        if draft_cost is not None and (isinstance(draft_cost, bool) or not isinstance(draft_cost, (int, float))
                                       or not 0 <= draft_cost < 1e6):
            raise QuickdraftError(f"draft_cost must be a number >= 0 (the model's drafting per token over a "
                                  f"verify step), got {draft_cost!r}")
        self.draft_cost = None if draft_cost is None else float(draft_cost)
        self.probe_every = check_int("probe_every", probe_every, 1)
        if not isinstance(merge, bool):
            raise QuickdraftError(f"merge must be true or false, got {merge!r}")
        self.merge = merge
        self.device = torch.device(device)
        # what the engine reads from a proposer with a model: its hidden states, its cached state
        if self.model is not None:
            self.hidden_layers = self.model.hidden_layers
            self.hidden_width = self.model.hidden_width
            self.prefix_state = self.model.prefix_state
            # the model in this object's own fields, where the engine's cost key looks for models
            self.draft_module = getattr(self.model, "model", None) or getattr(self.model, "head", None)
        self.rows: dict[int, _Row] = {}
        self.prior: dict[str, _Stat] = {n: _Stat(1.0, 1.0, 2.0) for n in self.MEMBERS}
        self._verify_times: dict[int, list[float]] = {}  # bucket -> step seconds without the model's drafting
        self._token_times: dict[int, list[float]] = {}  # bucket -> the model's drafting seconds per token
        self._costs: dict[int, tuple[float, float]] = {}  # bucket -> (c_verify, c_token), frozen
        self._key: dict | None = None  # the engine's cost key (set_cost_key): where the costs are cached
        self._seen: dict[int, int] = {}
        self._idle = 0  # steps since the model last drafted
        self._step: dict | None = None  # what this step proposed, for observe
        self.drafted_by: dict[str, int] = dict.fromkeys(self.MEMBERS, 0)  # row-steps each method drafted
        self.model_steps = 0  # steps the model drafted (for any row)
        self.merged_rows = 0  # row-steps whose draft held several members' candidates in one tree (module doc, 4)

    @classmethod
    def build(cls, *, target, draft=None, **options) -> HybridProposer:
        """options: the hybrid's own (OWN_OPTIONS) and each member's as "member.option"
        ({"suffix.tree": False, "draft.tree_width": 2}; `--spec-option suffix.tree=false`)."""
        own, per_member = {}, {n: {} for n in cls.MEMBERS}
        for key, value in options.items():
            name, dot, option = key.partition(".")
            if dot and name in per_member and option:
                per_member[name][option] = value
            elif key in OWN_OPTIONS:
                own[key] = value
            else:
                raise QuickdraftError(f"unknown {','.join(cls.MEMBERS)} option {key!r}; valid options: "
                                      f"{', '.join(OWN_OPTIONS)} and a member's own as member.option "
                                      f"(e.g. {cls.MEMBERS[0]}.{(cls.CLASSES[0].OPTIONS or ('option',))[0]})")
        members = {name: member.build(target=target, draft=draft if name == cls.MODEL else None, **per_member[name])
                   for name, member in zip(cls.MEMBERS, cls.CLASSES)}
        return cls(members, **own, device=target.device)

    # ---- the engine's hooks, passed on --------------------------------------------------------

    def max_draft_tokens(self, k: int) -> int:
        return max(m.max_draft_tokens(k) for m in self.members.values())

    def may_draft_trees(self, k: int) -> bool:
        return any(m.may_draft_trees(k) for m in self.members.values())

    def reserve(self, max_slots: int, capacity: int) -> None:
        for m in self.members.values():
            m.reserve(max_slots, capacity)

    def resize(self, max_slots: int, capacity: int, keep: int) -> None:
        for m in self.members.values():
            m.resize(max_slots, capacity, keep)

    def reserve_rows(self, rows: int) -> None:
        for m in self.members.values():
            m.reserve_rows(rows)

    def kv_token_bytes(self) -> int:
        return sum(m.kv_token_bytes() for m in self.members.values())

    def start(self, row: int, prompt: list[int]) -> None:
        self.rows[row] = _Row()
        for m in self.members.values():
            m.start(row, prompt)

    def move_row(self, src: int, dst: int) -> None:
        state = self.rows.pop(src, None)
        self.rows.pop(dst, None)
        if state is not None:
            self.rows[dst] = state
        for m in self.members.values():
            m.move_row(src, dst)

    def finish(self, row: int, tokens: list[int], prompt_len: int) -> None:
        state = self.rows.pop(row, None)
        if state is not None:
            self._score(state, tokens, final=True)
        for m in self.members.values():
            m.finish(row, tokens, prompt_len)

    def forget_requests(self) -> None:
        """The members' memories of finished requests, and the acceptance prior over requests
        (the measured costs stay: they are the machine's)."""
        for m in self.members.values():
            m.forget_requests()
        self.prior = {n: _Stat(1.0, 1.0, 2.0) for n in self.MEMBERS}

    def state_cache(self):
        return None if self.model is None else self.model.state_cache()

    def state_length(self, row: int) -> int:
        return 0 if self.model is None else self.model.state_length(row)

    def loaded_state(self, row: int, length: int) -> None:
        if self.model is not None:
            self.model.loaded_state(row, length)

    def add_hidden(self, start: int, hidden: torch.Tensor, index: list[list[int]]) -> None:
        if self.model is not None:
            self.model.add_hidden(start, hidden, index)

    def warm_up(self, k: int) -> None:
        for m in self.members.values():
            m.warm_up(k)

    def use_forward(self, make) -> None:
        for m in self.members.values():
            m.use_forward(make)

    def compile(self, make_step) -> None:
        for m in self.members.values():
            m.compile(make_step)

    # ---- estimates ----------------------------------------------------------------------------

    def _score(self, row: _Row, tokens: list[int], final: bool = False) -> None:
        """Score the row's pending candidates against its committed tokens (module doc, 3)."""
        kept = []
        for method, prev, toks, pars in row.pending:
            if prev > len(tokens):  # not this request's (cannot happen with start(); be safe)
                continue
            depth, done = _walk(toks, pars, tokens[prev:])
            if not (done or final):
                kept.append((method, prev, toks, pars))
                continue
            drafted = _depth(toks, pars)
            s = row.stats.setdefault(method, _Stat())
            s.steps = self.decay * s.steps + 1.0
            s.accepted = self.decay * s.accepted + depth
            s.depth = self.decay * s.depth + drafted
            p = self.prior[method]
            p.steps = self.prior_decay * p.steps + 1.0
            p.accepted = self.prior_decay * p.accepted + depth
            p.depth = self.prior_decay * p.depth + drafted
        row.pending = kept

    def expected(self, row: _Row, method: str, depth: int) -> float:
        """Expected emitted tokens of a candidate `depth` deep from `method` for this row."""
        if depth <= 0:
            return 1.0
        s, p = row.stats.get(method, _Stat()), self.prior[method]
        w = self.prior_steps
        length = (s.accepted + s.steps + w * (p.accepted + p.steps) / p.steps) / (s.steps + w)
        seen = (s.depth + w * p.depth / p.steps) / (s.steps + w)
        return expected_tokens(solve_alpha(length, max(1, round(seen))), depth)

    def costs(self, batch_size: int) -> tuple[float, float] | None:
        """(c_verify, c_token) for a batch of this size: draft_cost's fixed ratio, or the
        frozen medians (None while measuring)."""
        if self.draft_cost is not None:
            return 1.0, self.draft_cost
        return self._costs.get(bucket(batch_size))

    def _measured(self, times: dict[int, list[float]], b: int, seconds: float) -> None:
        if b in self._costs:
            return
        times.setdefault(b, []).append(seconds)
        v, t = self._verify_times.get(b, []), self._token_times.get(b, [])
        if len(v) >= self.warmup + self.samples and len(t) >= self.warmup + self.samples:
            self._costs[b] = (statistics.median(v[self.warmup:]), statistics.median(t[self.warmup:]))
            del self._verify_times[b], self._token_times[b]
            log.info("quickdraft: measured the hybrid's steps (%s, batch bucket %d): verify %.2f ms, the model's "
                     "drafting %.2f ms per token", ",".join(self.MEMBERS), b, 1e3 * self._costs[b][0],
                     1e3 * self._costs[b][1])
            if self._key is not None:
                write_cached(self._key, {"version": COSTS_VERSION, "key": self._key, "buckets": {
                    str(c): {"verify_s": cv, "token_s": ct} for c, (cv, ct) in sorted(self._costs.items())}})

    def set_cost_key(self, key: dict) -> None:
        """Cache the measured costs under the engine's cost key (module doc, 2): the costs
        already measured for it (in this process, else on disk) are used from the first step;
        a new key (the engine's forward changed) measures its own. Only a hybrid with a model
        member and no fixed draft_cost measures anything."""
        if self.model is None or self.draft_cost is not None:
            return
        key = json.loads(json.dumps({**key, "costs": "hybrid"}, default=str))  # as it reads back from disk
        if key == self._key:
            return
        self._key = key
        digest = key_digest(key)
        if digest not in _MEASURED:
            _MEASURED[digest] = _load_costs(key)
        self._costs = _MEASURED[digest]
        self._verify_times, self._token_times = {}, {}

    # ---- the step -----------------------------------------------------------------------------

    def propose(self, batch: ProposeBatch) -> Draft:
        started, model_s = time.perf_counter(), 0.0
        B, k = len(batch.tokens), batch.k
        rows = []
        for b, tokens in enumerate(batch.tokens):
            row = self.rows.setdefault(b, _Row())
            self._score(row, tokens)
            rows.append(row)
        cands: list[dict[str, tuple[list[int], list[int]]]] = [{} for _ in range(B)]
        for name, member in self.free:
            for b, (toks, pars) in enumerate(_row_lists(member.propose(batch))):
                if any(t >= 0 for t in toks):
                    cands[b][name] = (toks, pars)
        value = [{n: self.expected(rows[b], n, _depth(*c)) for n, c in cands[b].items()} for b in range(B)]
        best_free = [max(v.values(), default=1.0) for v in value]
        model_draft = None
        if self.model is not None and self._model_pays(rows, best_free, k):
            at = time.perf_counter()
            model_draft = self.model.propose(batch)
            for b, c in enumerate(_row_lists(model_draft)):  # (the host sync: the drafting has finished)
                if any(t >= 0 for t in c[0]):
                    cands[b][self.MODEL] = c
                    value[b][self.MODEL] = self.expected(rows[b], self.MODEL, _depth(*c))
            model_s = time.perf_counter() - at
            if self.draft_cost is None:
                self._measured(self._token_times, bucket(B), model_s / k)
            self._idle, self.model_steps = 0, self.model_steps + 1
        else:
            self._idle += 1
        chosen: list[str | None] = []
        for b in range(B):
            # the likeliest to emit the most; a free candidate on a tie (listed first)
            order = [n for n in self.MEMBERS if n in value[b] and n != self.MODEL] + \
                    ([self.MODEL] if self.MODEL in value[b] else [])
            pick = max(order, key=lambda n: value[b][n], default=None)
            chosen.append(pick)
            if pick is not None:
                self.drafted_by[pick] += 1
            for n, (toks, pars) in cands[b].items():
                rows[b].pending.append((n, len(batch.tokens[b]), toks, pars))
        merged = self._merged(cands, value, chosen, model_draft, batch)
        draft, used = self._combine(cands, chosen, model_draft, batch, merged)
        self._step = dict(chosen=chosen, model_draft=model_draft, cands=cands, used=used, B=B, started=started,
                          model_s=model_s, merged=merged)
        return draft

    def _model_pays(self, rows: list[_Row], best_free: list[float], k: int) -> bool:
        """Whether the model's drafting pays for this batch (module doc, 1-2)."""
        costs = self.costs(len(rows))
        if costs is None or self._idle + 1 >= self.probe_every:  # measuring, or probing
            return True
        c_verify, c_token = costs
        with_model = sum(max(f, self.expected(r, self.MODEL, k)) for r, f in zip(rows, best_free))
        return with_model / (c_verify + k * c_token) > sum(best_free) / c_verify

    def _merged(self, cands, value, chosen, model_draft: Draft | None, batch: ProposeBatch) -> dict:
        """Row -> its chosen candidate with the row's other candidates grafted on, in one tree
        (module doc, 4). The model's candidate joins only as a deterministic chain; a step in
        which a row verifies the model's sampled draft (its q) merges nothing."""
        if not self.merge:
            return {}
        sampled = model_draft is not None and model_draft.probs is not None and not batch.sampling.all_greedy
        if sampled and self.MODEL in chosen:
            return {}
        model_joins = model_draft is not None and model_draft.parents is None and not sampled
        k, most = batch.k, self.max_draft_tokens(batch.k)
        merged = {}
        for b, pick in enumerate(chosen):
            others = sorted((n for n in cands[b] if n != pick and (n != self.MODEL or model_joins)),
                            key=lambda n: -value[b][n])
            if pick is None or not others:
                continue
            toks, pars = cands[b][pick]
            size = len(toks)
            limit = min(most, size + k)  # (the verify step grows by at most k nodes)
            for other in others:
                toks, pars = _merge((toks, pars), cands[b][other], limit)
            if len(toks) > size:
                merged[b] = (toks, pars)
                self.merged_rows += 1
        return merged

    def _combine(self, cands, chosen, model_draft: Draft | None, batch: ProposeBatch, merged: dict | None = None):
        """The rows' chosen candidates (or merged trees) as one draft (module doc), and each row's
        (tokens, parents) in it."""
        B = len(chosen)
        probs_from = None
        if model_draft is not None and model_draft.probs is not None and not batch.sampling.all_greedy \
                and self.MODEL in chosen:
            probs_from = model_draft.probs  # (B, N, V): rows of the model keep their q, the others one-hot
        rows: list[tuple[list[int], list[int]]] = []
        for b, pick in enumerate(chosen):
            if pick is None:
                rows.append(([], []))
                continue
            toks, pars = merged[b] if merged and b in merged else cands[b][pick]
            if probs_from is not None and pick != self.MODEL and not _is_chain(pars):
                toks = _first_path(toks, pars)
                pars = list(range(-1, len(toks) - 1))
            rows.append((toks, pars))
        tree = (probs_from is not None and model_draft.parents is not None) or \
            not all(_is_chain(p) for _, p in rows)
        draft = Draft.tree(rows, self.device) if tree else Draft.chain([t for t, _ in rows], self.device)
        if probs_from is None:
            return draft, rows
        W, V = draft.tokens.shape[1], probs_from.shape[-1]
        probs = probs_from.new_zeros(B, W, V)
        for b, pick in enumerate(chosen):
            n = len(rows[b][0])
            if pick == self.MODEL:
                probs[b, :min(n, probs_from.shape[1])] = probs_from[b, :n]
            elif n:
                probs[b, torch.arange(n, device=probs.device), draft.tokens[b, :n]] = 1.0
        return Draft(draft.tokens, probs, draft.parents), rows

    def observe(self, result: VerifyResult) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        B = step["B"]
        if self.draft_cost is None and self.model is not None:  # the step but the model's drafting
            self._measured(self._verify_times, bucket(B), time.perf_counter() - step["started"] - step["model_s"])
        md = step["model_draft"]
        if md is None:
            return
        # the model hears, per row, how many of its own tokens the committed ones follow (module doc)
        chosen, cands = step["chosen"], step["cands"]
        tree = md.parents is not None
        num, nodes = [], []
        for b in range(B):
            n = result.num_accepted[b]
            if chosen[b] == self.MODEL and b not in step["merged"]:  # (a merged row's path may leave its chain)
                num.append(n)
                nodes.append(result.accepted_nodes[b] if tree and result.accepted_nodes is not None
                             else list(range(n)))
                continue
            if tree or self.MODEL not in cands[b] or chosen[b] is None:
                num.append(0)
                nodes.append([])
                continue
            # the row's accepted tokens: its accepted path in the draft the verifier saw
            toks, pars = step["used"][b]
            if result.accepted_nodes is not None:
                path = [toks[i] for i in result.accepted_nodes[b]]
            else:
                path = toks[:n]
            own = cands[b][self.MODEL][0]
            keep = next((i for i, (a, c) in enumerate(zip(path[:n], own)) if a != c), min(n, len(own)))
            num.append(keep)
            nodes.append(list(range(keep)))
        self.model.observe(VerifyResult(num, result.prev_lengths, result.k, nodes if tree else None,
                                        None, draft=md))


def _load_costs(key: dict) -> dict[int, tuple[float, float]]:
    """The hybrid's costs cached for `key` ({} when there are none, or the file is unreadable)."""
    path = costs_path(key)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("version") != COSTS_VERSION or data.get("key") != key:
            raise ValueError("another version or key")
        costs = {int(b): (float(c["verify_s"]), float(c["token_s"])) for b, c in data["buckets"].items()}
        if any(not (math.isfinite(v) and math.isfinite(t) and v > 0 and t >= 0) for v, t in costs.values()):
            raise ValueError("a step time out of range")
        return costs
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("quickdraft: ignoring the hybrid's cached step costs %s (%s); measuring them again", path, exc)
        return {}
