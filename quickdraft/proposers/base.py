"""The proposer interface: `propose(batch) -> Draft` and `observe(result)`.

The engine knows nothing else about a proposer. Stateful proposers (a draft model
with its own KV cache, a suffix trie per request) also follow the engine's batch layout
through lifecycle hooks, which default to doing nothing: `reserve` (size state for the
batch), `start` (a request took a row), `move_row` (the engine compacted its rows) and
`finish` (a request is leaving its row).

A draft is a chain or a token tree:

- chain: `tokens` (B, k), `parents` None. Row b proposes tokens[b, 0], tokens[b, 1], ...
  after its last committed token; -1 ends a row's chain early (a row may propose nothing).
- tree: `tokens` (B, N) and `parents` (B, N). Node i hangs under node parents[b, i]
  (always < i), or under the last committed token when parents[b, i] == -1. A node's
  depth (1 for the root's children) must not exceed `ProposeBatch.k`. Siblings are tried
  in index order, so list the likelier child first. Unused nodes have token -1 (their
  children too). With `probs` None (deterministic candidates), siblings must be distinct.

`probs` is q: for node i, the exact distribution its token was drawn from (after the
rows' sampling processing), or None when the proposer is deterministic. Sampled siblings
of a tree must be independent draws from the same q (their parent's distribution), so a
tree with q is a sampled tree (`Draft.sampled`).

`observe` gets a VerifyResult: per row the accepted count and, for trees, the accepted
path; and the draft it verifies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..cache import KVCache
from ..errors import QuickdraftError
from ..sampling import BatchSampling, PenaltyState, StepRandom


@dataclass
class ProposeBatch:
    tokens: list[list[int]]  # per row: prompt + generated tokens committed so far
    k: int  # most tokens any path may propose this step (>= 1): a tree's depth bound
    sampling: BatchSampling  # the rows' sampling parameters; q must use the same processing
    random: StepRandom  # per-row randomness, keyed by each row's request and position
    # the rows' penalties / logit_bias (None: no row has any) and generated tokens: a proposer
    # may draft from penalised distributions (q is then what it sampled from) or ignore them
    penalties: PenaltyState | None = None
    outputs: list[list[int]] | None = None
    ks: list[int] | None = None  # each row's own depth bound (<= k); None: k for every row

    def row_k(self, b: int) -> int:
        """Row b's own depth bound. The engine drafts to the deepest row's k and cuts each row's
        draft to its own; a proposer whose drafts or state for a row depend on the bound (a node
        budget, a Jacobi window) uses this, so that a row's drafts never depend on the others'."""
        return self.k if self.ks is None else min(self.k, self.ks[b])


@dataclass
class Draft:
    tokens: torch.Tensor  # (B, N) int64 proposed token ids; -1 = no token
    probs: torch.Tensor | None  # (B, N, V) float32: the exact q each token was drawn from; None if deterministic
    parents: torch.Tensor | None = None  # (B, N) int64 parent node (-1 = the last committed token); None = chain

    @property
    def sampled(self) -> bool:
        """A tree whose siblings were independent draws from q (a sampled tree), rather than
        deterministic candidates (top-w, n-gram, suffix). Derived, not stored: a tree with q
        is sampled by the contract above, and a derived flag survives code that rebuilds a
        Draft from its fields (the engine's depth limit)."""
        return self.parents is not None and self.probs is not None

    @classmethod
    def chain(cls, rows: Sequence[Sequence[int]], device: torch.device | str) -> Draft:
        """A deterministic chain draft from per-row token lists of any lengths (>= 0)."""
        width = max((len(r) for r in rows), default=0)  # 0 when no row proposes anything
        tokens = torch.full((len(rows), width), -1, dtype=torch.long)
        for b, r in enumerate(rows):
            if r:
                tokens[b, :len(r)] = torch.tensor(list(r), dtype=torch.long)
        return cls(tokens.to(device), None)

    @classmethod
    def tree(cls, rows: Sequence[tuple[Sequence[int], Sequence[int]]], device: torch.device | str) -> Draft:
        """A deterministic tree draft from per-row (tokens, parents) lists of any sizes."""
        width = max((len(t) for t, _ in rows), default=0)
        tokens = torch.full((len(rows), width), -1, dtype=torch.long)
        parents = torch.full((len(rows), width), -1, dtype=torch.long)
        for b, (toks, pars) in enumerate(rows):
            if len(toks) != len(pars):
                raise ValueError("a tree row needs one parent per token")
            if toks:
                tokens[b, :len(toks)] = torch.tensor(list(toks), dtype=torch.long)
                parents[b, :len(pars)] = torch.tensor(list(pars), dtype=torch.long)
        return cls(tokens.to(device), None, parents.to(device))


@dataclass
class VerifyResult:
    num_accepted: list[int]  # per row, draft tokens the verifier kept
    prev_lengths: list[int]  # per row, committed length before the step
    k: int  # the step's depth bound (ProposeBatch.k)
    # For trees: per row, the node indices of the accepted path (root's child first).
    accepted_nodes: list[list[int]] | None = None
    # Only for proposers with `wants_target_tokens`: per row, the target's argmax after the
    # last committed token (index 0) and after each draft node (index 1 + i).
    target_tokens: list[list[int]] | None = None
    draft: Draft | None = None  # the draft this result verifies (as the verifier saw it)


class Proposer:
    OPTIONS: tuple[str, ...] = ()  # option names build() accepts
    needs_draft_model = False  # LLM loads a draft model folder and passes it as `draft`
    wants_target_tokens = False  # observe() gets the target's argmax at every draft node
    draft_is_head = False  # `draft` is a head reading the target's states (LLM loads it as such)
    # Target layers whose hidden states this proposer reads (EAGLE-3); the engine then passes
    # them from its prefill and verify forwards to add_hidden. None: no hidden states.
    hidden_layers: tuple[int, ...] | None = None
    hidden_width: int = 0  # the width of those states together (what add_hidden receives per position)

    @classmethod
    def build(cls, *, target, draft=None, **options) -> Proposer:
        """Construct from the loaded models and method options (clear errors on bad ones)."""
        check_options(cls.__name__, options, cls.OPTIONS)
        return cls(**options)

    def max_draft_tokens(self, k: int) -> int:
        """The most draft nodes one row may propose in a step with depth bound k (sizes caches)."""
        return k

    def may_draft_trees(self, k: int) -> bool:
        """Whether `propose` may return a tree (a Draft with parents) at depth bound k: the engine
        then loads (or warms up) the compiled tree verify step. It must be true whenever a tree
        can come back, even one with no more nodes than k: a tree verified eagerly between
        compiled chain steps rounds differently from them, and greedy output then leaves plain
        decoding's. By default: when a row may propose more nodes than k (a chain has k)."""
        return self.max_draft_tokens(k) > k

    def reserve(self, max_slots: int, capacity: int) -> None:
        """Prepare state for up to `max_slots` rows of `capacity` positions."""

    def reserve_rows(self, rows: int) -> None:
        """The engine's hint, before its first allocation and before a resize to a new capacity:
        caches on a CPU may map the address space of this many rows at once (KVCache's
        reserve_rows), so that growing the rows later is a view of the same memory, not a copy
        under the running requests. By default nothing."""

    def resize(self, max_slots: int, capacity: int, keep: int) -> None:
        """Hold state for `max_slots` rows of `capacity` positions from now on, keeping rows
        0..keep-1's state exactly (the engine's cache grows or shrinks under its running
        requests); max_slots 0 frees it all. By default: reserve."""
        self.reserve(max_slots, capacity)

    def kv_token_bytes(self) -> int:
        """Bytes of this proposer's own caches per position of one row (what `resize` allocates
        per row and position), counted in the engine's KV budget; 0 when it holds none."""
        return 0

    def start(self, row: int, prompt: list[int]) -> None:
        """A new request now occupies `row`."""

    def move_row(self, src: int, dst: int) -> None:
        """The request in row `src` now lives in row `dst` (src's old state is dropped)."""

    def finish(self, row: int, tokens: list[int], prompt_len: int) -> None:
        """The request in `row` is leaving (finished or aborted): tokens = prompt + output."""

    # Prefix caching (quickdraft.prefix_cache) keeps a proposer's per-position state with the target's
    # KV blocks: "none" keeps none (token state comes from start(): n-gram, suffix, lookahead);
    # "rebuild" keeps it (a draft model's KV) and computes the positions a hit lacks from the tokens;
    # "required" cannot compute them (an EAGLE-3 head's KV comes from the target's hidden states),
    # so a hit covers only blocks that carry its state.
    prefix_state: str = "none"

    def state_cache(self) -> KVCache | None:
        """The KV cache holding that state, rows as the engine's (the prefix cache copies blocks of it)."""
        return None

    def state_length(self, row: int) -> int:
        """Positions [0, n) of `row` whose state is in state_cache (committed tokens only)."""
        return 0

    def loaded_state(self, row: int, length: int) -> None:
        """After start(row, ...): the prefix cache wrote positions [0, length) of `row` in state_cache."""

    def add_hidden(self, start: int, hidden: torch.Tensor, index: list[list[int]]) -> None:
        """For proposers with `hidden_layers`: the target's states hidden (B, T, ...) from a
        forward over rows start .. start + B - 1, and per row the columns holding its next
        committed positions, in order (every token committed but the last has its state)."""

    def warm_up(self, k: int) -> None:
        """Compile this proposer's steps for the shapes drafting k tokens uses (after compile())."""

    def use_forward(self, make) -> None:
        """Run this proposer's model forward through `make(model, trees=...)` where that returns
        a step (an ahead-of-time compiled one, quickdraft.aot) rather than None; `trees`: the
        proposer calls its model with slots and a mask (token trees). Proposers without a model
        ignore it."""

    def forget_requests(self) -> None:
        """Forget what finished requests taught this proposer (suffix decoding's tree of earlier
        outputs): benchmarks that run a workload again call it between runs, so a run does not
        draft from the previous run's outputs of the same prompts. Stateless ones ignore it."""

    def set_cost_key(self, key: dict) -> None:
        """What the engine's step costs depend on (Engine.cost_key: models, formats, method,
        forward, machine, kernels), given when the engine starts and again when its forward
        changes; a proposer that measures costs caches them under it. Others ignore it."""

    def compile(self, make_step) -> None:
        """Compile this proposer's model steps: `make_step(model, name)` returns a callable
        with the model's forward signature, `make_step(model, name, fn=f, pad=p)` one for
        `f(model, ...)` as a whole (quickdraft.compile.StepFunction). Proposers without a
        model ignore it."""

    def propose(self, batch: ProposeBatch) -> Draft:
        raise NotImplementedError

    def observe(self, result: VerifyResult) -> None:
        """Feedback after verification."""


class OwnKVProposer(Proposer):
    """A proposer with a KV cache of its own (a draft model's, an EAGLE-3 head's): its rows follow
    the engine's, `cached[row]` positions of a row are built, and the prefix cache keeps that KV
    with the target's blocks (state_cache / state_length / loaded_state). A subclass says how to
    allocate the cache (`new_cache`) and how many bytes a position takes (`kv_token_bytes`)."""

    def __init__(self) -> None:
        self.cache: KVCache | None = None
        self.cached: list[int] = []  # per row: positions [0, n) of its KV built in `cache`
        self.rows_reserved = 0  # (reserve_rows)

    def new_cache(self, max_slots: int, capacity: int, reserve_rows: int = 0) -> KVCache:
        raise NotImplementedError

    def reserve_rows(self, rows: int) -> None:
        self.rows_reserved = rows

    def reserve(self, max_slots: int, capacity: int) -> None:
        c = self.cache
        if c is None or c.max_slots < max_slots or c.capacity < capacity:
            self.cache = None  # free the old one first
            self.cache = self.new_cache(max_slots, capacity, reserve_rows=self.rows_reserved)
        self.cached = [0] * max_slots

    def resize(self, max_slots: int, capacity: int, keep: int) -> None:
        if max_slots == 0:
            self.cache, self.cached = None, []
        elif self.cache is None:
            self.reserve(max_slots, capacity)
        else:
            self.cache.resize(max_slots, capacity, keep, reserve_rows=self.rows_reserved or None)
            self.cached = (self.cached + [0] * max_slots)[:max_slots]

    def start(self, row: int, prompt: list[int]) -> None:
        self.cached[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst, self.cached[src])
        self.cached[dst] = self.cached[src]

    def state_cache(self) -> KVCache:
        return self.cache

    def state_length(self, row: int) -> int:
        return self.cached[row]

    def loaded_state(self, row: int, length: int) -> None:
        self.cached[row] = length


def check_options(method: str, options: dict, allowed: Sequence[str]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise QuickdraftError(f"unknown {method} option(s) {', '.join(unknown)}; "
                              f"valid options: {', '.join(allowed) or 'none'}")


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise QuickdraftError(f"{name} must be an integer {bound}, got {value!r}")
    return value


class TrieBuilder:
    """Merges token paths into one tree in priority order: parents before children,
    siblings in the order their first path arrived, so the likelier path's nodes are tried first."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._index: dict[tuple[int, int], int] = {}

    def add(self, path: Sequence[int]) -> list[int]:
        """Insert a path under the root; returns its node indices."""
        parent, nodes = -1, []
        for t in path:
            node = self._index.get((parent, t))
            if node is None:
                node = self._index[(parent, t)] = len(self.tokens)
                self.tokens.append(t)
                self.parents.append(parent)
            nodes.append(node)
            parent = node
        return nodes


def merge_paths(paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the trie of `paths`, for Draft.tree."""
    trie = TrieBuilder()
    for path in paths:
        trie.add(path)
    return trie.tokens, trie.parents


PROPOSERS: dict[str, type[Proposer]] = {}


def register(name: str) -> Callable[[type[Proposer]], type[Proposer]]:
    def wrap(cls):
        PROPOSERS[name] = cls
        return cls
    return wrap
