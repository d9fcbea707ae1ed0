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

A whole function compiled as one graph (the draft's k-token chain) specialises on more than
shapes (the batch's sampling mix, k); `CompiledVariants` runs it only for the variants
warm-up registered and the same function one compiled forward at a time otherwise, so a
request never waits for a compile.

Prefill is not compiled (its shapes change with every prompt). Where compilation is
unavailable or fails, the step logs one line and runs eagerly from then on; results are
the same either way (checked by tests: greedy tokens equal, distribution tests pass). Except
a tensor-parallel rank's step (`collective`): a failure there is raised, and the whole group
stops (an eager re-run on one rank would issue all-reduces the other ranks do not).
Inductor's on-disk cache (FX graph cache) makes later start-ups faster where PyTorch
supports it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from .cache import CacheView
from .errors import QuickdraftError
from .sampling import BatchSampling, SamplingParams

log = logging.getLogger("quickdraft")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def default_compile_mode(device: torch.device) -> tuple[bool, str | None]:
    """(static shapes, torch.compile mode) for a device."""
    if device.type == "cuda":  # NVIDIA and AMD (ROCm builds use the cuda device)
        return True, "reduce-overhead"
    return False, None


def _no_duck_sizing() -> None:
    """By default dynamo gives input sizes that happen to be equal one symbol (a warm-up
    batch of 2 rows and a query of 2 tokens would then compile a graph that only serves
    batch == query length, and every other batch size would recompile in the middle of a
    request). Every dimension gets its own symbol instead."""
    try:
        import torch.fx.experimental._config as fx_config
    except ImportError:  # pragma: no cover - very old torch
        return
    if hasattr(fx_config, "use_duck_shape"):
        fx_config.use_duck_shape = False


def _raise_recompile_limits(n: int) -> None:
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


class StepFunction:
    """A compiled hot-path function: by default the model's forward,
    `model(input_ids, positions, cache, kv_len=..., slots=..., attn_mask=..., logits_at=...)`,
    a drop-in for calling the model in the decode / verify / draft paths; or `fn(model, *args,
    **kwargs)` compiled as one graph (the draft's whole k-token chain, quickdraft.proposers.
    draft_model.draft_chain), with `pad` making its static-shape arguments."""

    def __init__(self, model, *, name: str = "model", static: bool | None = None, mode: str | None = None,
                 backend: str | Callable = "inductor", fn: Callable | None = None, pad: Callable | None = None,
                 collective: bool = False):
        self.model = model
        self.name = name
        # one rank's part of a tensor-parallel step: the other ranks run the same step, joined by
        # the all-reduces inside it, so a failure here is raised (the group then stops on every
        # rank), never answered by an eager re-run on this rank alone, whose all-reduces the
        # other ranks would not match (wrong sums or a hang until the timeout)
        self.collective = collective
        dev_static, dev_mode = default_compile_mode(model.device)
        self.static = dev_static if static is None else static
        self.mode = dev_mode if mode is None and backend == "inductor" else mode
        self.failed: str | None = None
        if fn is None:
            self._eager, self._pad = model, _pad_static
            target = model.forward
        else:
            def target(*args, **kwargs):
                return fn(model, *args, **kwargs)

            self._eager, self._pad = target, pad
        _raise_recompile_limits(256)
        _no_duck_sizing()
        if not torch._dynamo.is_dynamo_supported():
            self._fail("torch.compile is not supported with this Python / PyTorch")
            self._compiled = None
        else:
            self._compiled = torch.compile(target, dynamic=not self.static, mode=self.mode, backend=backend)

    def _fail(self, reason: str) -> None:
        self.failed = reason
        log.warning("quickdraft: compiling the %s step failed (%s); running it eagerly", self.name, reason)

    def __call__(self, *args, **kwargs):
        if self.failed is not None:
            return self._eager(*args, **kwargs)
        B = args[0].shape[0]
        cargs, ckwargs = self._pad(*args, **kwargs) if self.static else (args, kwargs)
        try:
            out = self._compiled(*cargs, **ckwargs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back, once, loudly
            # dynamo wraps a backend's error; the wrapped one says what went wrong
            root = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
            first = (str(root).strip().splitlines() or [""])[0]
            if self.collective:
                raise QuickdraftError(f"the compiled {self.name} step failed on this tensor-parallel rank "
                                      f"({type(root).__name__}: {first}); not re-run eagerly on one rank, whose "
                                      "all-reduces the other ranks would not match: the group stops") from exc
            self._fail(f"{type(root).__name__}: {first}")
            return self._eager(*args, **kwargs)
        if self.static:
            # CUDA graphs write their outputs into one memory pool: the next graph that runs (the
            # target's verify after the draft's chain) overwrites them, so keep copies of the rows.
            if isinstance(out, tuple):
                return tuple(o[:B].clone() for o in out)
            return out[:B].clone()
        if isinstance(out, tuple):
            return tuple(o[:B] if o.shape[0] != B else o for o in out)
        return out[:B] if out.shape[0] != B else out


def warm_up(step, model, query_lengths, gather: bool = False, tree_lengths=()) -> None:
    """Compile `step` (a StepFunction over `model`) for each query length now, on a scratch
    cache, rather than on the first request that needs the shape. Batch sizes 1 and 2: a
    dynamic graph specialises on size 1, so 2 settles the symbolic one every larger batch
    uses. `gather`: also the variant that keeps only the last position's logits
    (forward_chunks, a draft's catch-up); `tree_lengths`: query lengths also run with token-tree
    attention (explicit slots and mask)."""
    from .cache import KVCache

    if not warms_up(step):
        return
    device = model.device
    with torch.inference_mode():  # the engine's caches are inference tensors: guards check it
        cache = KVCache.for_model(model, 2, 64)
        for B in (1, 2):
            for T, tree in [(T, False) for T in sorted(set(query_lengths))] + [(T, True) for T in sorted(set(tree_lengths))]:
                for start in (8, 9):  # two context lengths: a dynamic graph settles on symbolic sizes
                    ids = torch.zeros(B, T, dtype=torch.long, device=device)
                    pos = torch.arange(start, start + T, device=device).repeat(B, 1)  # contiguous, as the engine passes
                    kw = dict(kv_len=start + T)
                    if tree:
                        kw.update(slots=pos.clone(), attn_mask=torch.ones(B, T, start + T, dtype=torch.bool, device=device))
                    for last in ([None, torch.full((B, 1), T - 1, device=device)] if gather and not tree else [None]):
                        step(ids, pos, cache.rows(0, B), logits_at=last, **kw)


def warms_up(step) -> bool:
    """Whether `step` is compiled ahead of use: dynamic-shape steps are; static (CUDA-graph)
    steps depend on the real cache's shape and are compiled on first use."""
    return isinstance(step, StepFunction) and step.failed is None and not step.static


def static_rows(cache: CacheView, B: int) -> tuple[int, CacheView]:
    """The padded batch size (a bucket within the cache's rows) and the cache view a
    static-shape step reads: the cache's own tensors where the batch starts at row 0 (their
    addresses never change, which is what lets a CUDA graph write them; KVCache marks them
    static; rows past the batch are sliced off inside the step), else the padded rows."""
    rows = cache.parent.max_slots - cache.start if cache.parent is not None else B
    Bp = next((b for b in BUCKETS if b >= B), B)
    Bp = B if Bp > rows else Bp
    if cache.parent is not None and cache.start == 0:
        parent = cache.parent
        cache = CacheView(parent.k, parent.v, parent.capacity, parent, 0)
    elif Bp > B:
        cache = cache.parent.rows(cache.start, cache.start + Bp)
    return Bp, cache


def pad_rows(t: torch.Tensor | None, rows: int, value) -> torch.Tensor | None:
    """`t` with rows appended up to `rows`, filled with `value`."""
    if t is None or t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0],) + tuple(t.shape[1:]), value)])


def _pad_static(input_ids, positions, cache: CacheView, *, kv_len=None, slots=None, attn_mask=None, logits_at=None):
    """Pad the batch to a bucket (within the cache's rows) and read keys over the whole cache.
    Padding rows have position -1: their k/v go to the trash column."""
    B, T = input_ids.shape
    Bp, cache = static_rows(cache, B)
    S = cache.capacity
    input_ids, positions = pad_rows(input_ids, Bp, 0), pad_rows(positions, Bp, -1)
    slots, logits_at = pad_rows(slots, Bp, -1), pad_rows(logits_at, Bp, 0)
    if attn_mask is not None:
        full = attn_mask.new_zeros(Bp, T, S)
        full[:B, :, : attn_mask.shape[-1]] = attn_mask
        full[B:, :, 0] = True  # a padding row must see one key (softmax over nothing is NaN)
        attn_mask = full
    return (input_ids, positions, cache), dict(kv_len=S, slots=slots, attn_mask=attn_mask, logits_at=logits_at)


class CompiledVariants:
    """A whole-function compiled step (StepFunction(fn=...)) run only for the variants
    registered ahead of use; any other variant runs `fallback`, the same function over the
    one-token steps (the same results, and no graph compiled in the middle of a request).

    A variant is a hashable key (chain_key); `ready` holds the registered ones."""

    def __init__(self, step: StepFunction, fallback: Callable):
        self.step = step
        self.fallback = fallback
        self.ready: set[tuple] = set()

    @property
    def usable(self) -> bool:
        return self.step.failed is None

    def register(self, key: tuple) -> None:
        """Run `key` as the compiled graph from now on (while compiling has not failed)."""
        if self.usable:
            self.ready.add(key)

    def __call__(self, key: tuple, *args, **kwargs):
        if self.usable and key in self.ready:
            return self.step(*args, **kwargs)
        return self.fallback(*args, **kwargs)


def warm_samplings(device: torch.device) -> list[tuple[int, BatchSampling]]:
    """(batch size, sampling) of the variants compiled at start-up: batch sizes 1 and 2 (a
    dynamic graph specialises on 1, so 2 settles the symbolic one), greedy and plain
    temperature. Other mixes (top-k/top-p/min-p) run one compiled forward at a time."""
    with torch.inference_mode():  # the engine's sampling tensors are inference tensors: guards check it
        return [(B, BatchSampling.build([SamplingParams(temperature=t)] * B, device))
                for B in (1, 2) for t in (0.0, 1.0)]


def chain_key(B: int, k: int, width: int, s: BatchSampling) -> tuple:
    """What a compiled draft chain specialises on: batch size 1 or more, k, width, the sampling mix."""
    return B > 1, k, width, s.all_greedy, s.any_greedy, s.any_top_k, s.any_top_p, s.any_min_p


def pad_chain(ids, positions, cache, *, last, kv_len, k, sampling, draws, width, grow=True):
    """Static shapes for the draft chain (quickdraft.proposers.draft_model.draft_chain, CUDA
    graphs): the batch padded to a bucket, keys over the whole cache."""
    Bp, cache = static_rows(cache, ids.shape[0])
    if Bp > ids.shape[0]:
        sampling = dataclasses.replace(sampling, temperature=pad_rows(sampling.temperature, Bp, 1.0),
                                       top_k=pad_rows(sampling.top_k, Bp, 0), top_p=pad_rows(sampling.top_p, Bp, 1.0),
                                       min_p=pad_rows(sampling.min_p, Bp, 0.0))
    return (pad_rows(ids, Bp, 0), pad_rows(positions, Bp, -1), cache), \
        dict(last=pad_rows(last, Bp, 0), kv_len=cache.capacity, k=k, sampling=sampling,
             draws=pad_rows(draws, Bp, 0.5), width=width, grow=False)
