"""Compiled model steps: torch.compile of the decode, verify and draft forwards.

Per-operator overhead dominates small models on CPU and every model on a GPU at batch 1;
compiling the step removes it. Two shapes of compiled step:

- dynamic (CPU, MPS): inductor with symbolic batch size and key length, so one compiled
  graph serves every batch size and context length, one per query length in practice;
- static (CUDA / ROCm, `mode="reduce-overhead"`, i.e. CUDA graphs, which replay one
  recorded shape): the batch is padded to a bucket (1, 2, 4, 8, ... up to the cache's
  rows), keys are read over the whole static cache (the mask hides what is not there),
  the query length is whatever the step uses. Padding rows have position -1: their k/v go
  to the cache's trash column and their outputs are dropped.

Prefill is not compiled (its shapes change with every prompt). Where compilation is
unavailable or fails, the step logs one line and runs eagerly from then on; results are
the same either way (checked by tests: greedy tokens equal, distribution tests pass).
Inductor's on-disk cache (FX graph cache) makes later start-ups faster where PyTorch
supports it.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .cache import CacheView

log = logging.getLogger("quickdraft")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def default_compile_mode(device: torch.device) -> tuple[bool, str | None]:
    """(static shapes, torch.compile mode) for a device."""
    if device.type == "cuda":  # NVIDIA and AMD (ROCm builds use the cuda device)
        return True, "reduce-overhead"
    return False, None


def _raise_recompile_limits(n: int) -> None:
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


class StepFunction:
    """`model(input_ids, positions, cache, kv_len=..., slots=..., attn_mask=..., logits_at=...)`,
    compiled; a drop-in for calling the model in the decode / verify / draft hot paths."""

    def __init__(self, model, *, name: str = "model", static: bool | None = None, mode: str | None = None,
                 backend: str | Callable = "inductor"):
        self.model = model
        self.name = name
        dev_static, dev_mode = default_compile_mode(model.device)
        self.static = dev_static if static is None else static
        self.mode = dev_mode if mode is None and backend == "inductor" else mode
        self.failed: str | None = None
        _raise_recompile_limits(256)
        if not torch._dynamo.is_dynamo_supported():
            self._fail("torch.compile is not supported with this Python / PyTorch")
            self._compiled = None
        else:
            self._compiled = torch.compile(model.forward, dynamic=not self.static, mode=self.mode, backend=backend)

    def _fail(self, reason: str) -> None:
        self.failed = reason
        log.warning("quickdraft: compiling the %s step failed (%s); running it eagerly", self.name, reason)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: CacheView, *,
                 kv_len: int | None = None, slots: torch.Tensor | None = None,
                 attn_mask: torch.Tensor | None = None, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        kw = dict(kv_len=kv_len, slots=slots, attn_mask=attn_mask, logits_at=logits_at)
        if self.failed is not None:
            return self.model(input_ids, positions, cache, **kw)
        B = input_ids.shape[0]
        ids, pos, view, ckw = _pad_static(input_ids, positions, cache, **kw) if self.static else \
            (input_ids, positions, cache, kw)
        try:
            out = self._compiled(ids, pos, view, **ckw)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back, once, loudly
            # dynamo wraps a backend's error; the wrapped one says what went wrong
            root = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
            first = (str(root).strip().splitlines() or [""])[0]
            self._fail(f"{type(root).__name__}: {first}")
            return self.model(input_ids, positions, cache, **kw)
        return out[:B] if out.shape[0] != B else out


def warm_up(step, model, query_lengths, gather: bool = False) -> None:
    """Compile `step` (a StepFunction over `model`) for each query length now, on a scratch
    one-row cache, rather than on the first request that needs the shape. `gather`: also the
    variant that keeps only the last position's logits (forward_chunks, a draft's catch-up)."""
    from .cache import KVCache

    if not isinstance(step, StepFunction) or step.failed is not None or step.static:
        return  # static (CUDA-graph) steps depend on the real cache's shape: compiled on first use
    device = model.device
    with torch.inference_mode():  # the engine's caches are inference tensors: guards check it
        cache = KVCache.for_model(model, 1, 64)
        for T in sorted(set(query_lengths)):
            for start in (8, 9):  # two context lengths: a dynamic graph settles on symbolic sizes
                ids = torch.zeros(1, T, dtype=torch.long, device=device)
                pos = torch.arange(start, start + T, device=device)[None]
                for last in ([None, torch.full((1, 1), T - 1, device=device)] if gather else [None]):
                    step(ids, pos, cache.rows(0, 1), kv_len=start + T, logits_at=last)


def _pad_static(input_ids, positions, cache: CacheView, *, kv_len, slots, attn_mask, logits_at):
    """Pad the batch to a bucket (within the cache's rows) and read keys over the whole cache."""
    B, T = input_ids.shape
    rows = cache.parent.max_slots - cache.start if cache.parent is not None else B
    Bp = next((b for b in BUCKETS if b >= B), B)
    Bp = B if Bp > rows else Bp
    S = cache.capacity
    if cache.parent is not None and cache.start == 0:
        # the cache's own tensors, not views of them: their addresses never change, which is
        # what lets a CUDA graph write them (KVCache marks them static); rows past the batch
        # are sliced off inside the compiled step
        parent = cache.parent
        cache = CacheView(parent.k, parent.v, parent.capacity, parent, 0)
    elif Bp > B:
        cache = cache.parent.rows(cache.start, cache.start + Bp)
    if Bp > B:
        pad = Bp - B
        input_ids = torch.cat([input_ids, input_ids.new_zeros(pad, T)])
        positions = torch.cat([positions, positions.new_full((pad, T), -1)])
        if slots is not None:
            slots = torch.cat([slots, slots.new_full((pad, T), -1)])
        if logits_at is not None:
            logits_at = torch.cat([logits_at, logits_at.new_zeros(pad, logits_at.shape[1])])
    if attn_mask is not None:
        full = attn_mask.new_zeros(Bp, T, S)
        full[:B, :, : attn_mask.shape[-1]] = attn_mask
        full[B:, :, 0] = True  # a padding row must see one key (softmax over nothing is NaN)
        attn_mask = full
    return input_ids, positions, cache, dict(kv_len=S, slots=slots, attn_mask=attn_mask, logits_at=logits_at)
