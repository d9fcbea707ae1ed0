"""Preallocated KV cache indexed by position.

Every slot (a row of the running batch) owns `capacity` positions per layer. A forward
writes each token's key/value at its absolute position; attention reads keys at
positions <= the query's position. Rolling back rejected tokens is therefore nothing
but the engine lowering its per-row length: stale entries beyond it are never read
(the position mask hides them) and are overwritten by the next write. Rows of one batch
can hold different lengths and accept different numbers of tokens in the same step.

Padding tokens (position -1) are written to one extra "trash" column past the
capacity, which no query ever attends to; this keeps writes branch-free and shapes
static for later CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_device(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list/tensor on `device` without a stream synchronisation: on CUDA the data is
    staged in pinned memory and copied asynchronously (a copy from pageable memory would
    wait for the GPU's queue to drain). Elsewhere a plain copy."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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
    def __init__(self, num_layers: int, max_slots: int, num_kv_heads: int, capacity: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.capacity = capacity  # positions per slot
        self.max_slots = max_slots
        shape = (max_slots, num_kv_heads, capacity + 1, head_dim)  # +1: the trash column
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        if torch.device(device).type == "cuda":
            # Compiled steps write the cache in place; CUDA graphs allow that only for inputs
            # whose address never changes, which these are (allocated once).
            for t in self.k + self.v:
                try:
                    torch._dynamo.mark_static_address(t)
                except (AttributeError, RuntimeError):  # an older torch: CUDA graphs may be skipped
                    break

    @classmethod
    def for_model(cls, model, max_slots: int, capacity: int) -> KVCache:
        make = getattr(model, "new_kv_cache", None)  # a tensor-parallel target: its shard's heads, on every rank
        if make is not None:
            return make(max_slots, capacity)
        cfg = model.config
        p = model.model.embed_tokens.weight
        return cls(cfg.num_hidden_layers, max_slots, cfg.num_key_value_heads, capacity,
                   cfg.head_dim, p.dtype, p.device)

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

    def grow(self, capacity: int) -> None:
        """Make room for `capacity` positions per slot, keeping what is cached."""
        if capacity <= self.capacity:
            return
        for layers in (self.k, self.v):
            for i, t in enumerate(layers):
                bigger = t.new_zeros(t.shape[0], t.shape[1], capacity + 1, t.shape[3])
                bigger[:, :, : self.capacity] = t[:, :, : self.capacity]
                layers[i] = bigger
        self.capacity = capacity

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
