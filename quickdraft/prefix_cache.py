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

Eviction: least recently used block first (a hit or a store touches its chain from the root
on, so a block is never older than its parent and leaves go first); evicting a block evicts its
descendants (unreachable without it). `max_bytes` bounds the bytes blocks hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cache import KVCache

BLOCK_SIZE = 16  # tokens per block (vLLM's default); measured against 32 in docs/server.md


def read_positions(cache: KVCache, row: int, start: int, end: int) -> torch.Tensor:
    """Positions [start, end) of one row, every layer: (layers, 2, H_kv, end - start, D), a copy."""
    return torch.stack([torch.stack((k[row, :, start:end], v[row, :, start:end]))
                        for k, v in zip(cache.k, cache.v)])


def write_positions(cache: KVCache, row: int, start: int, kv: torch.Tensor) -> None:
    """The inverse of read_positions: kv (layers, 2, H_kv, n, D) into positions [start, start + n)."""
    n = kv.shape[3]
    for layer, (k, v) in enumerate(zip(cache.k, cache.v)):
        k[row, :, start:start + n] = kv[layer, 0]
        v[row, :, start:start + n] = kv[layer, 1]


@dataclass(eq=False)
class Block:
    id: int
    key: tuple  # (parent id, tokens)
    kv: torch.Tensor  # the target's (layers, 2, H_kv, block_size, D)
    extra: torch.Tensor | None = None  # the proposer's state of these positions (its save_state), if kept
    children: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        size = self.kv.numel() * self.kv.element_size()
        return size + (0 if self.extra is None else self.extra.numel() * self.extra.element_size())


@dataclass
class PrefixCacheStats:
    """Counters under vLLM's names: queries and hits in tokens (a request's prompt looked up, the
    tokens found), blocks evicted."""
    queries: int = 0
    hits: int = 0
    evictions: int = 0


class PrefixCache:
    def __init__(self, max_bytes: int, block_size: int = BLOCK_SIZE):
        self.max_bytes = max_bytes
        self.block_size = block_size
        self._index: dict[tuple, Block] = {}
        self._lru: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.nbytes = 0
        self.stats = PrefixCacheStats()

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

    def load(self, blocks: list[Block], cache: KVCache, row: int) -> int:
        """Copy the blocks' target KV into positions [0, n) of `row`; returns n."""
        if not blocks:
            return 0
        write_positions(cache, row, 0, torch.cat([b.kv for b in blocks], dim=3))
        return len(blocks) * self.block_size

    def store(self, tokens: list[int], length: int, cache: KVCache, row: int,
              extra: Callable[[int, int], torch.Tensor] | None = None, extra_length: int = 0) -> None:
        """Keep the KV of tokens[:length] (positions whose KV `row` holds), whole blocks only;
        `extra(start, end)` gives the proposer's state of positions it holds ([0, extra_length))
        for the blocks that lack it."""
        bs = self.block_size
        parent, chain = -1, set()
        new_from = None
        for i, s in enumerate(range(0, length - bs + 1, bs)):
            key = (parent, tuple(tokens[s:s + bs]))
            block = self._index.get(key)
            if block is None:
                new_from = s
                break
            chain.add(block.id)
            self._lru.move_to_end(block.id)
            if block.extra is None and extra is not None and s + bs <= extra_length:
                block.extra = extra(s, s + bs).clone()
                self.nbytes += block.extra.numel() * block.extra.element_size()
            parent = block.id
        if new_from is not None:
            end = new_from + (length - new_from) // bs * bs
            kv = read_positions(cache, row, new_from, end)
            ex = None
            ex_end = min(end, extra_length - extra_length % bs) if extra is not None else new_from
            if ex_end > new_from:
                ex = extra(new_from, ex_end)
            for j, s in enumerate(range(new_from, end, bs)):
                block = Block(self._next_id, (parent, tuple(tokens[s:s + bs])), kv[:, :, :, j * bs:(j + 1) * bs].clone(),
                              None if s + bs > ex_end else ex[..., j * bs:(j + 1) * bs, :].clone())
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
        self._make_room(0, chain)  # the proposer states added above may have passed the limit

    def _make_room(self, nbytes: int, keep: set[int]) -> bool:
        """Evict least recently used blocks (not in `keep`: the chain being stored) until
        `nbytes` more fit; False if they cannot."""
        while self.nbytes + nbytes > self.max_bytes:
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

    def clear(self) -> None:
        self._index.clear()
        self._lru.clear()
        self.nbytes = 0
