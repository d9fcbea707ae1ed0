"""KV cache indexed by position, and the KV memory budget it grows within.

Every slot (a row of the running batch) owns `capacity` positions per layer. A forward
writes each token's key/value at its absolute position; attention reads keys at
positions <= the query's position. Rolling back rejected tokens is therefore nothing
but the engine lowering its per-row length: stale entries beyond it are never read
(the position mask hides them) and are overwritten by the next write. Rows of one batch
can hold different lengths and accept different numbers of tokens in the same step.

Padding tokens (position -1) are written to one extra "trash" column past the
capacity, which no query ever attends to; this keeps writes branch-free and shapes
static for later CUDA-graph capture.

The engine sizes the cache (rows x positions) for the requests it runs and resizes it as they
come and go (`resize`: a copy of every cached entry, exact), within a `KVBudget`: the bytes all
KV memory may take (the target's rows, the proposer's caches, and anything else that registers a
claim, such as a prefix cache).

On a CPU the cache's memory is the operating system's zero pages (`zeros`: anonymous memory,
mapped on first write), so a cache of many rows and positions costs what its rows have written,
and growing it costs a copy of the kept rows' cached positions, not a fill of the whole: beside
4 SmolLM2 streams a 4,000-token prompt's admission grew the cache from 4 to 8 rows of 4,096
positions, and zeroing those 1.5 GB stalled every stream for 1.3-2.4 s.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("quickdraft")


def to_device(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list/tensor on `device` without a stream synchronisation: on CUDA the data is
    staged in pinned memory and copied asynchronously (a copy from pageable memory would
    wait for the GPU's queue to drain). Elsewhere a plain copy."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


ZERO_PAGES_MIN_BYTES = 1 << 20  # CPU tensors this large come from zeros()'s anonymous memory


def anonymous(size: int) -> mmap.mmap:
    """`size` bytes of fresh private anonymous memory (zeros until written; a private mapping, so
    neither a forked process's writes nor shmem's rules on huge pages apply to it)."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: anonymous memory has no sharing flags
        return mmap.mmap(-1, size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", mmap.MAP_ANON))


def cache_dtype(model) -> torch.dtype:
    """The element type of `model`'s KV cache: its kv_cache_dtype where one is set (the engine's
    config.kv_cache_dtype), else its weights' dtype."""
    return getattr(model, "kv_cache_dtype", None) or model.dtype


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros. On a CPU, from ZERO_PAGES_MIN_BYTES up, in fresh anonymous memory (an
    mmap of its own, freed with the tensor): the operating system maps a zeroed page at its first
    write, so nothing is filled here and memory is taken only where entries are written (torch.zeros
    writes every byte at once, taking every page). Elsewhere torch.zeros."""
    device = torch.device(device)
    count = math.prod(shape)
    size = count * dtype.itemsize
    if device.type != "cpu" or size < ZERO_PAGES_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(anonymous(size), dtype=dtype, count=count).view(shape)


@dataclass
class CacheView:
    """Rows [start, end) of a KVCache, as seen by one forward of batch size end - start."""

    k: list[torch.Tensor]  # per layer: (B, H_kv, capacity + 1, D)
    v: list[torch.Tensor]
    capacity: int
    parent: KVCache | None = None  # the cache these rows belong to (static-shape steps pad into it)
    start: int = 0

    @property
    def trash(self) -> int:
        return self.capacity


class KVCache:
    """Per layer, keys and values of (slots, kv heads, capacity + 1, head dim): row = slot.

    reserve_rows (CPU): the address space of that many rows is mapped at once (zero pages: memory
    is taken only where entries are written), the tensors viewing the first max_slots rows, so
    that growing the rows at the same capacity is a view of more of the same memory: no copy and
    no new page faults for the rows kept (a running batch otherwise stalls while a copy of every
    cached position it holds is written, page by page, into new memory). A growth past the
    reservation, or of the capacity, copies as before."""

    def __init__(self, num_layers: int, max_slots: int, num_kv_heads: int, capacity: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, reserve_rows: int = 0):
        self.capacity = capacity  # positions per slot
        self.max_slots = max_slots
        self.reserve_rows = reserve_rows if torch.device(device).type == "cpu" else 0
        shape = (num_kv_heads, capacity + 1, head_dim)  # +1: the trash column
        self._k_all = [self._rows(max_slots, shape, dtype, device) for _ in range(num_layers)]
        self._v_all = [self._rows(max_slots, shape, dtype, device) for _ in range(num_layers)]
        self._view()
        if torch.device(device).type == "cuda":
            # Compiled steps write the cache in place; CUDA graphs allow that only for inputs
            # whose address never changes, which these are (allocated once).
            for t in self.k + self.v:
                try:
                    torch._dynamo.mark_static_address(t)
                except (AttributeError, RuntimeError):  # an older torch: CUDA graphs may be skipped
                    break

    def _rows(self, rows: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """Zeros of max(rows, reserve_rows) rows of `shape` (the reservation, class doc); where the
        OS refuses that much address space (strict overcommit accounting), of `rows` rows, and no
        reservation from then on."""
        if self.reserve_rows > rows:
            try:
                return zeros((self.reserve_rows, *shape), dtype, device)
            except OSError:  # (mmap's ENOMEM)
                log.info("quickdraft: no address space for %d KV rows in reserve; growing them will copy",
                         self.reserve_rows)
                self.reserve_rows = 0
        return zeros((rows, *shape), dtype, device)

    def _view(self) -> None:
        """k and v: the first max_slots rows of each tensor."""
        self.k = [t[:self.max_slots] for t in self._k_all]
        self.v = [t[:self.max_slots] for t in self._v_all]

    @classmethod
    def for_model(cls, model, max_slots: int, capacity: int, reserve_rows: int = 0) -> KVCache:
        make = getattr(model, "new_kv_cache", None)  # a tensor-parallel target: its shard's heads, on every rank
        if make is not None:
            return make(max_slots, capacity)
        cfg = model.config
        return cls(cfg.num_hidden_layers, max_slots, cfg.num_key_value_heads, capacity,
                   cfg.head_dim, cache_dtype(model), model.model.embed_tokens.weight.device, reserve_rows=reserve_rows)

    @staticmethod
    def token_bytes(model) -> int:
        """Bytes one position of one row takes in `model`'s cache (keys and values, every layer):
        2 x layers x kv_heads x head_dim x the element size (a tensor-parallel target: this
        rank's share of the heads)."""
        per_rank = getattr(model, "kv_token_bytes", None)
        if per_rank is not None:
            return per_rank()
        return model.config.kv_token_bytes(cache_dtype(model).itemsize)  # for_model's dtype

    def rows(self, start: int, end: int) -> CacheView:
        return CacheView([k[start:end] for k in self.k], [v[start:end] for v in self.v], self.capacity, self, start)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (used to keep
        the running batch in rows 0..n-1 when a request leaves)."""
        if src == dst or length <= 0:
            return
        for layer in range(len(self.k)):
            self.k[layer][dst, :, :length] = self.k[layer][src, :, :length]
            self.v[layer][dst, :, :length] = self.v[layer][src, :, :length]

    def resize(self, max_slots: int, capacity: int, keep: int, length: int | None = None,
               reserve_rows: int | None = None) -> None:
        """Become `max_slots` rows of `capacity` positions, keeping rows 0..keep-1's entries at
        positions below min(old, new capacity, `length`) bit for bit (the caller keeps every row's
        length within the new capacity; `length`: the longest a kept row has cached, None: all).
        New memory is zeros (`zeros`); the old tensors are freed as each layer is copied, so the
        peak is one layer more than the larger of the two sizes. `reserve_rows`: the rows reserved
        where this copies (the engine's: as many as its budget affords at the new capacity, so
        that the rows admitted next are views, not another copy under the running rows); None:
        a reservation of the same bytes as before."""
        if max_slots == self.max_slots and capacity == self.capacity:
            return
        reserved = min(t.shape[0] for t in self._k_all + self._v_all)
        if capacity == self.capacity and self.max_slots < max_slots <= reserved:
            # more rows of the reservation (class doc): never written, so zeros
            self.max_slots = max_slots
            self._view()
            return
        rows, cols = min(keep, max_slots, self.max_slots), min(capacity, self.capacity)
        if length is not None:
            cols = min(cols, length)
        if reserve_rows is None:  # a reservation of no more bytes than before at the new capacity
            reserve_rows = self.reserve_rows * (self.capacity + 1) // (capacity + 1)
        self.reserve_rows = reserve_rows if self._k_all and self._k_all[0].device.type == "cpu" else 0
        for old, kept in ((self._k_all, self.k), (self._v_all, self.v)):
            for i, t in enumerate(kept):
                new = self._rows(max_slots, (t.shape[1], capacity + 1, t.shape[3]), t.dtype, t.device)
                new[:rows, :, :cols] = t[:rows, :, :cols]
                old[i] = new
                del t
                kept[i] = None  # the old memory goes as each layer is copied
        self.max_slots, self.capacity = max_slots, capacity
        self._view()
        if self.k and self.k[0].device.type == "cuda":
            for t in self.k + self.v:
                try:
                    torch._dynamo.mark_static_address(t)
                except (AttributeError, RuntimeError):
                    break

    def grow(self, capacity: int) -> None:
        """Make room for `capacity` positions per slot, keeping what is cached."""
        if capacity <= self.capacity:
            return
        KVCache.resize(self, self.max_slots, capacity, self.max_slots)  # (KVCache's: a subclass's broadcasts)

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """After tree verification: copy slots src (B, n) to dst (B, n) in rows 0..B-1,
        every layer (the accepted path's entries move to their chain positions). Entries
        of -1 in src/dst are skipped (they copy the trash column onto itself)."""
        B = src.shape[0]
        rows = torch.arange(B, device=src.device)[:, None]
        src = torch.where(src >= 0, src, self.capacity)
        dst = torch.where(src < self.capacity, dst, self.capacity)
        for layer in range(len(self.k)):
            for t in (self.k[layer], self.v[layer]):
                t[rows, :, dst] = t[rows, :, src]  # (B, n, H, D): the read is a copy, so overlaps are safe

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def row_bytes(token_bytes: int, capacity: int) -> int:
    """Bytes of one cache row of `capacity` positions (+ the trash column)."""
    return token_bytes * (capacity + 1)


class KVBudget:
    """The bytes all KV memory of one engine may take, and who holds how much of it.

    Holders `claim` what they hold under a name (the engine's rows: "rows"); a holder that can
    give memory back (a prefix cache evicting) registers `release(nbytes) -> freed bytes`,
    which `make_room` calls when another holder needs more than is free. `token_bytes` is the
    bytes one position of one request takes: the target's cache plus the proposer's own."""

    def __init__(self, total: int, token_bytes: int):
        self.total = int(total)
        self.token_bytes = int(token_bytes)
        self.claims: dict[str, int] = {}
        self._releasers: dict[str, Callable[[int], int]] = {}

    def claim(self, name: str, nbytes: int) -> None:
        """`name` now holds `nbytes` (replacing what it held before)."""
        self.claims[name] = int(nbytes)

    @property
    def used(self) -> int:
        return sum(list(self.claims.values()))  # a copy: other threads (metrics) read it while holders claim

    def free_for(self, name: str) -> int:
        """Bytes `name` may hold in all: the total less what every other holder holds."""
        return self.total - sum(n for who, n in self.claims.items() if who != name)

    def on_pressure(self, name: str, release: Callable[[int], int]) -> None:
        """`release(nbytes)` frees up to nbytes of `name`'s memory (updating its claim) and returns
        the bytes freed; called by make_room."""
        self._releasers[name] = release

    def make_room(self, name: str, nbytes: int) -> bool:
        """Whether `name` can hold `nbytes` in all, asking the other holders to release memory
        first where it cannot yet."""
        for who, release in self._releasers.items():
            short = nbytes - self.free_for(name)
            if short <= 0:
                break
            if who != name:
                release(short)
        return nbytes <= self.free_for(name)

    def row_tokens(self) -> int:
        """The positions one row can hold when it has the whole budget."""
        return max(0, self.total // self.token_bytes - 1)


def return_freed_memory() -> None:
    """Hand memory freed on the host back to the OS (glibc keeps freed blocks below its mmap
    threshold, such as one small row's per-layer tensors, in its arenas: the process's resident
    memory would not drop). A no-op where there is no glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            pass
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def available_memory(device: torch.device) -> int:
    """Bytes free for new allocations on `device` now: the CUDA allocator's free memory on a
    GPU, else the host's available memory (Linux: MemAvailable; elsewhere the free pages)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30  # nothing says: assume a small machine
