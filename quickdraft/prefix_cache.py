"""Automatic prefix caching: the KV of computed tokens, kept after a request and reused by
later requests that start with the same tokens (multi-turn chat resends its whole history;
many requests share a system prompt).

Layout. The cache holds blocks of `block_size` tokens. A block is keyed by its parent block's id
and its own tokens, so one dict lookup per block walks a prompt's chain from the start, and a
key is the exact token prefix (no hash can collide: the dict compares the tokens). A block holds
the target's keys and values of its positions, every layer, as one tensor (layers, 2, H_kv,
block_size, D), and, when the proposer keeps per-position state (a draft model's KV, an EAGLE-3
head's KV), that state for the same positions (`extra`).

Reuse copies. A request that hits copies its blocks into its own row of the engine's KV cache
(the kernels read contiguous rows: no paged attention) and prefills only the rest, from the first
position past the copied prefix; at least one prompt token is always prefilled, so the first
token's logits come from a forward as without the cache. A copy costs a memory copy of the
prefix against a prefill of it (figures in docs/server.md).
Running requests never read the cache's blocks, so eviction never touches what a request uses.

Exactness. A position's KV is a function of the tokens up to it whenever the forward gives a row
the same bits whatever rows are beside it (row-invariant matmuls: quant.row_invariant; the CPU
attention kernel, kernels.attend): then a copied prefix is the bits a prefill gives, and output
with a hit is output without one, to the bit. Elsewhere (PyTorch's GEMMs, GPU) the bits of a
prefill depend on its row count, as they already do between batch sizes.

Memory. The blocks are claimed from the engine's KV budget (cache.KVBudget) under "prefix": a
store keeps what the budget has free beside the requests' rows (and at most `max_bytes`, when
given), and when admitting a request needs more than is free, the budget asks the prefix cache to
`release` blocks; it can release every one (no running request reads them), so a request that
fits the budget is never kept waiting by cached blocks.

Checking (prefix_cache_check, a debug mode). A cache bug must not produce wrong text: with the check
on, every hit also prefills the cached prefix from scratch into a scratch cache (outside the KV
budget; the engine's chunk size) and compares the two KV, every layer and position: bit for bit
where the kernels are row-invariant, else within a tolerance (PyTorch's GEMMs change the last
bits with the row count). A mismatch is logged and counted (stats.check_mismatches), the row gets
the recomputed KV (the output stays right), and the blocks from the first bad one on are evicted.

Eviction: least recently used block first (a hit or a store touches its chain from the root
on, so a block is never older than its parent and leaves go first); evicting a block evicts its
descendants (unreachable without it).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .cache import KVBudget, KVCache
from .model.transformer import forward_chunks

log = logging.getLogger("quickdraft")

BLOCK_SIZE = 16  # tokens per block (vLLM's default); measured against 32 in docs/server.md


def _tensors(cache: KVCache) -> list[torch.Tensor]:
    """The cache's tensors in block order: layer 0's keys, its values, layer 1's keys ..."""
    return [t for pair in zip(cache.k, cache.v) for t in pair]


def _views(cache: KVCache, row: int, start: int, size: int) -> list[torch.Tensor]:
    """Positions [start, start + size) of one row: per layer its keys' and values' views (H_kv, size, D)."""
    return [t[row, :, start:start + size] for t in _tensors(cache)]


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Every copy in one call (thousands of small ones for a long prefix: ~2 us each one by one)."""
    if dst:
        torch._foreach_copy_(dst, src)


def _span(cache: KVCache, row: int, start: int, count: int, size: int) -> list[torch.Tensor]:
    """Positions [start, start + count size) of one row as `count` blocks: per layer its keys' and
    values' (count, H_kv, size, D) views (one strided view per tensor, not one per block)."""
    return [t[row, :, start:start + count * size].unflatten(1, (count, size)).transpose(0, 1) for t in _tensors(cache)]


def read_blocks(cache: KVCache, row: int, start: int, count: int, size: int) -> list[torch.Tensor]:
    """`count` blocks of `size` positions of one row from `start` on, each a new (layers, 2, H_kv,
    size, D) tensor with memory of its own (evicting a block frees it). One strided copy per
    layer's keys and values gathers them all, then each block is copied out: 2 x layers + count
    copies instead of 2 x layers x count small ones (each a view made and copied in Python's
    time: thousands for a long prompt)."""
    if count <= 0:
        return []
    _, H, _, D = cache.k[0].shape
    whole = cache.k[0].new_empty(count, 2 * len(cache.k), H, size, D)
    _copy(list(whole.unbind(1)), _span(cache, row, start, count, size))
    return [b.unflatten(0, (len(cache.k), 2)).clone() for b in whole.unbind(0)]


def write_blocks(cache: KVCache, row: int, blocks: list[torch.Tensor]) -> int:
    """Blocks (read_blocks') into positions 0, size, 2 size ... of one row; returns the positions written."""
    if not blocks:
        return 0
    size = blocks[0].shape[3]  # (a cache's blocks are all block_size long)
    whole = torch.stack(blocks).flatten(1, 2)  # (count, layers x 2, H_kv, size, D): then one copy per tensor
    _copy(_span(cache, row, 0, len(blocks), size), list(whole.unbind(1)))
    return len(blocks) * size


@dataclass(eq=False)
class Block:
    id: int
    key: tuple  # (parent id, tokens)
    kv: torch.Tensor  # the target's (layers, 2, H_kv, block_size, D)
    extra: torch.Tensor | None = None  # the proposer's cache at these positions (Proposer.state_cache), if kept
    children: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        size = self.kv.numel() * self.kv.element_size()
        return size + (0 if self.extra is None else self.extra.numel() * self.extra.element_size())


@dataclass
class PrefixCacheStats:
    """Counters under vLLM's names: queries and hits in tokens (a request's prompt looked up, the
    tokens found), blocks evicted; with the debug check, hits checked and those that mismatched."""
    queries: int = 0
    hits: int = 0
    evictions: int = 0
    checks: int = 0
    check_mismatches: int = 0


@dataclass(frozen=True)
class CheckMismatch:
    """A hit whose cached KV differs from a fresh prefill's (PrefixCache.check)."""
    position: int  # the first prompt position whose KV differs
    length: int  # positions the hit covered
    max_abs_diff: float

    def __str__(self) -> str:
        return (f"prefix cache hit of {self.length} positions differs from a fresh prefill from position "
                f"{self.position} on (max |diff| {self.max_abs_diff:.3g})")


def _first_bad(cached: torch.Tensor, fresh: torch.Tensor, exact: bool) -> tuple[int | None, float]:
    """The first position (dim 1 of (H_kv, n, D)) where `cached` differs from `fresh` (exactly, or
    past a tolerance relative to the layer's largest value), and the largest difference."""
    if torch.equal(cached, fresh):
        return None, 0.0
    diff = (cached.float() - fresh.float()).abs()
    if exact:
        bad = diff.ne(0) | cached.isnan().ne(fresh.isnan())
    else:  # float32 sums in another order differ by ~1e-6 relative; bf16 / fp16 KV by ~1e-2
        tol = (1e-3 if fresh.dtype == torch.float32 else 3e-2) * max(fresh.float().abs().max().item(), 1e-6)
        bad = diff.gt(tol) | diff.isnan()
    at = bad.any(dim=2).any(dim=0).nonzero()
    return (int(at[0]) if len(at) else None), float(diff.nan_to_num(float("inf")).max())


class PrefixCache:
    """Blocks of computed KV. `max_bytes`: a cap of its own (None: none); `budget`: the KV budget
    its blocks are claimed from (under "prefix"), which evicts them when others need the memory."""

    NAME = "prefix"  # its holder name in the KV budget

    def __init__(self, max_bytes: int | None = None, block_size: int = BLOCK_SIZE, budget: KVBudget | None = None):
        if max_bytes is None and budget is None:
            raise ValueError("a prefix cache needs max_bytes or a budget to bound it")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.budget = budget
        self._index: dict[tuple, Block] = {}
        self._lru: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self._next_id = 0
        self._nbytes = 0
        self.stats = PrefixCacheStats()
        if budget is not None:
            budget.claim(self.NAME, 0)
            budget.on_pressure(self.NAME, self.release)

    @property
    def nbytes(self) -> int:
        """Bytes the blocks hold (the budget's "prefix" claim)."""
        return self._nbytes

    @nbytes.setter
    def nbytes(self, value: int) -> None:
        self._nbytes = value
        if self.budget is not None:
            self.budget.claim(self.NAME, value)

    def limit(self) -> int:
        """The bytes the blocks may hold now: the cap, and what the budget leaves free."""
        if self.budget is None:
            return self.max_bytes
        free = self.budget.free_for(self.NAME)
        return free if self.max_bytes is None else min(self.max_bytes, free)

    def release(self, nbytes: int) -> int:
        """Evict least recently used blocks until `nbytes` are freed or none is left (the KV
        budget's pressure callback); returns the bytes freed."""
        before = self.nbytes
        while self._lru and before - self.nbytes < nbytes:
            self._evict(next(iter(self._lru.values())))
        return before - self.nbytes

    @property
    def num_cached_tokens(self) -> int:
        return len(self._lru) * self.block_size

    def _chain(self, tokens: list[int], limit: int) -> list[Block]:
        """The cached blocks covering tokens[:limit] from the start, longest first-to-last."""
        bs, parent, out = self.block_size, -1, []
        for s in range(0, limit - bs + 1, bs):
            block = self._index.get((parent, tuple(tokens[s:s + bs])))
            if block is None:
                break
            out.append(block)
            parent = block.id
        return out

    def match(self, tokens: list[int], need_extra: bool) -> list[Block]:
        """The longest cached prefix of `tokens` that leaves at least one token to compute (as
        blocks, touched as recently used); with `need_extra`, only blocks that carry the
        proposer's state. Counts a query of len(tokens) tokens."""
        blocks = self._chain(tokens, len(tokens) - 1)
        if need_extra:
            n = next((i for i, b in enumerate(blocks) if b.extra is None), len(blocks))
            blocks = blocks[:n]
        for b in blocks:
            self._lru.move_to_end(b.id)
        self.stats.queries += len(tokens)
        self.stats.hits += len(blocks) * self.block_size
        return blocks

    def load(self, blocks: list[Block], cache: KVCache, row: int, state: KVCache | None = None) -> tuple[int, int]:
        """Copy the blocks' target KV into positions [0, n) of `row`, and into `state` (the
        proposer's cache) the proposer's state of the leading blocks that carry it, positions [0, m);
        returns (n, m)."""
        n = write_blocks(cache, row, [b.kv for b in blocks])
        m = 0
        if state is not None:
            with_state = next((i for i, b in enumerate(blocks) if b.extra is None), len(blocks))
            m = write_blocks(state, row, [b.extra for b in blocks[:with_state]])
        return n, m

    def store(self, tokens: list[int], length: int, cache: KVCache, row: int, state: KVCache | None = None,
              state_length: int = 0) -> None:
        """Keep the KV of tokens[:length] (positions whose KV `row` holds), whole blocks only,
        with the proposer's state (`state`: its cache, positions [0, state_length) of `row`) for
        the blocks it covers and that lack it."""
        bs = self.block_size
        if state is None:
            state_length = 0
        parent, chain = -1, set()
        new_from = length - length % bs  # where the blocks not cached yet start
        for s in range(0, length - bs + 1, bs):
            block = self._index.get((parent, tuple(tokens[s:s + bs])))
            if block is None:
                new_from = s
                break
            chain.add(block.id)
            self._lru.move_to_end(block.id)
            if block.extra is None and s + bs <= state_length:
                block.extra = read_blocks(state, row, s, 1, bs)[0]
                self.nbytes += block.extra.numel() * block.extra.element_size()
            parent = block.id
        count = (length - new_from) // bs
        kvs = read_blocks(cache, row, new_from, count, bs)
        extras = read_blocks(state, row, new_from, max(0, min(count, (state_length - new_from) // bs)), bs) \
            if state is not None else []
        for j, kv in enumerate(kvs):
            s = new_from + j * bs
            block = Block(self._next_id, (parent, tuple(tokens[s:s + bs])), kv, extras[j] if j < len(extras) else None)
            if not self._make_room(block.nbytes, chain):
                break
            self._next_id += 1
            self._index[block.key] = block
            self._lru[block.id] = block
            if parent >= 0:
                self._lru[parent].children.append(block.id)
            self.nbytes += block.nbytes
            chain.add(block.id)
            parent = block.id
        self._make_room(0, chain)  # the proposer states added to cached blocks may have passed the limit

    def _make_room(self, nbytes: int, keep: set[int]) -> bool:
        """Evict least recently used blocks (not in `keep`: the chain being stored) until
        `nbytes` more fit; False if they cannot."""
        limit = self.limit()
        while self.nbytes + nbytes > limit:
            victim = next((b for b in self._lru.values() if b.id not in keep), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, block: Block) -> None:
        stack = [block]
        parent = self._lru.get(block.key[0])
        if parent is not None:
            parent.children.remove(block.id)
        while stack:
            b = stack.pop()
            del self._index[b.key]
            del self._lru[b.id]
            self.nbytes -= b.nbytes
            self.stats.evictions += 1
            stack.extend(self._lru[c] for c in b.children)

    def check(self, target, cache: KVCache, row: int, tokens: list[int], length: int, chunk: int | None,
              exact: bool, prefill=None) -> CheckMismatch | None:
        """The debug check of a hit just loaded: prefill tokens[:length] from scratch (`chunk`
        tokens per forward, as the engine's prefill: `prefill(tokens, start, view)`, else the
        target's eager forward) and compare its KV with positions [0, length) of `row`; on a
        mismatch, count and log it, give the row the fresh KV and evict the blocks from the first
        bad one on. `exact`: compare bits (row-invariant kernels), else within a tolerance."""
        fresh = KVCache.for_model(target, 1, length)
        view = fresh.rows(0, 1)
        step = chunk or length
        for s in range(0, length, step):
            part = tokens[s:min(s + step, length)]
            if prefill is None:
                forward_chunks(target, [part], [s], view)
            else:
                prefill(part, s, view)
        self.stats.checks += 1
        first, worst = None, 0.0
        for a, b in zip(_views(cache, row, 0, length), _views(fresh, 0, 0, length)):
            at, diff = _first_bad(a, b, exact)
            worst = max(worst, diff)
            if at is not None:
                first = at if first is None else min(first, at)
        if first is None:
            return None
        mismatch = CheckMismatch(first, length, worst)
        self.stats.check_mismatches += 1
        log.warning("quickdraft: %s; the recomputed KV is used and the cached blocks from there on evicted", mismatch)
        _copy(_views(cache, row, 0, length), _views(fresh, 0, 0, length))
        chain = self._chain(tokens, length)
        if first // self.block_size < len(chain):
            self._evict(chain[first // self.block_size])
        return mismatch

    def clear(self) -> None:
        self._index.clear()
        self._lru.clear()
        self.nbytes = 0
