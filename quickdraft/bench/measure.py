"""The timing harness behind `quickdraft tune` and `quickdraft bench`: target forwards
T(B, q), proposer calls T_propose(B, k) and acceptance per draft position, measured on this
machine. What the numbers mean (and the `Profile` they fill) is the cost model in
`quickdraft.policy.costs`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..cache import KVCache
from ..errors import QuickdraftError
from ..metrics import SpecStats
from ..model.transformer import forward_chunks
from ..policy.costs import solve_alpha
from ..proposers.base import ProposeBatch, Proposer
from ..sampling import BatchSampling, SamplingParams, StepRandom

Progress = Callable[[float], None] | None  # called with the share of one measurement just done


# ---- measuring -----------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _time_once(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _interleaved_medians(fns: Sequence[Callable[[], Any]], iters: int, warmup: int, device: torch.device,
                         progress: Progress) -> list[float]:
    """Median seconds of each fn, timed in rounds (every fn once per round), so that a slow
    spell of the machine (another process, clock changes) spreads over all of them instead
    of skewing the few timed while it lasted."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    rounds = max(1, iters)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            times[i].append(_time_once(fn, device))
            if progress:
                progress(1 / rounds)
    return [statistics.median(t) for t in times]


def _blocked_median(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device,
                    progress: Progress) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, iters)):
        times.append(_time_once(fn, device))
        if progress:
            progress(1 / max(1, iters))
    return statistics.median(times)


def _grid(values: list[float], cols: int) -> list[list[float]]:
    return [values[i:i + cols] for i in range(0, len(values), cols)]


@torch.inference_mode()
def measure_target_steps(model, batch_sizes: Sequence[int], query_lengths: Sequence[int], context: int,
                         iters: int, warmup: int = 2, seed: int = 0, progress: Progress = None) -> list[list[float]]:
    """[per batch size][per query length] median seconds of one target forward over q query
    tokens per row for B rows, each row with `context` tokens already cached."""
    device, vocab = model.device, model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache.for_model(model, max(batch_sizes), context + max(query_lengths) + 1)
    if context > 0:  # real keys and values for row 0, copied to every row
        forward_chunks(model, [torch.randint(3, vocab, (context,), generator=gen).tolist()], [0], cache.rows(0, 1))
        for b in range(1, max(batch_sizes)):
            cache.move_row(0, b, context)
    fns = []
    for B in batch_sizes:
        for q in query_lengths:
            ids = torch.randint(3, vocab, (B, q), generator=gen).to(device)
            positions = (context + torch.arange(q)).expand(B, q).to(device)
            fns.append(lambda ids=ids, positions=positions, view=cache.rows(0, B), kv_len=context + q:
                       model(ids, positions, view, kv_len=kv_len))
    return _grid(_interleaved_medians(fns, iters, warmup, device, progress), len(query_lengths))


def _proposer_of(source, device) -> tuple[Proposer, torch.device, int]:
    """A fresh proposer for an LLM (its own engine's stays untouched), or the proposer given."""
    if hasattr(source, "engine") and hasattr(source, "target"):  # an LLM
        proposer = source.engine.proposer
        if proposer is None:
            raise QuickdraftError("this LLM decodes without speculation: there is no proposer to time")
        spec = source.engine.config.spec
        fresh = type(proposer).build(target=source.target, draft=source.draft, **dict(spec.options))
        return fresh, source.target.device, source.target.config.vocab_size
    if not isinstance(source, Proposer):
        raise QuickdraftError("measure_propose needs an LLM or a Proposer")
    model = getattr(source, "model", None)
    dev = torch.device(device) if device is not None else model.device if model is not None else \
        torch.device(getattr(source, "device", "cpu"))
    vocab = model.config.vocab_size if model is not None else 1000
    return source, dev, vocab


@torch.inference_mode()
def measure_propose(source, batch_sizes: Sequence[int], ks: Sequence[int], context: int, iters: int,
                    temperature: float = 0.0, tokens: Sequence[int] | None = None, warmup: int = 2,
                    device: str | torch.device | None = None, seed: int = 0,
                    progress: Progress = None) -> list[list[float]]:
    """[per batch size][per k] median seconds of one propose() for B rows of `context` tokens.

    source: an LLM (a fresh proposer of its method and options is built) or a Proposer.
    tokens: a token stream the rows' contexts are cut from (real text matters to n-gram and
    suffix lookups); random ids when None. A proposer with a draft-model cache (`cached`,
    per row) is timed as in a step: one pending token to catch up, then k drafts (all
    (B, k) interleaved, like the target's steps). Others see their contexts grow by one
    token per call, as in decoding, one (B, k) after another."""
    proposer, dev, vocab = _proposer_of(source, device)
    if tokens is None or len(tokens) == 0:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(3, vocab, (max(4096, context + 1),), generator=gen).tolist()
    stream = list(tokens)
    max_b, calls = max(batch_sizes), warmup + max(1, iters)
    stride = max(1, len(stream) // max_b)

    def text(b: int, n: int) -> list[int]:
        return [stream[(b * stride + i) % len(stream)] for i in range(n)]

    proposer.reserve(max_b, context + calls + proposer.max_draft_tokens(max(ks)) + 2)
    samplings = {B: BatchSampling.build([SamplingParams(temperature=temperature)] * B, dev) for B in batch_sizes}
    gens = StepRandom([seed + b for b in range(max_b)], [context] * max_b, dev)
    width = proposer.hidden_width if proposer.hidden_layers is not None else 0
    if isinstance(getattr(proposer, "cached", None), list):
        rows = [text(b, context + 1) for b in range(max_b)]
        for b in range(max_b):
            proposer.start(b, rows[b])
        if width:  # a head reading target states: random ones cost what real ones do
            proposer.add_hidden(0, torch.randn(max_b, context, width, device=dev), [list(range(context))] * max_b)
        proposer.propose(ProposeBatch(rows, ks[0], samplings[max_b], gens))  # prefill the draft's cache
        pending = 2 if width else 1  # a head's cache holds every token's pair but the last two

        def step(B: int, k: int) -> None:
            for b in range(B):
                proposer.cached[b] = len(rows[b]) - pending  # as after a step: one token pending
            if width:
                proposer.add_hidden(0, torch.randn(B, 1, width, device=dev), [[0]] * B)
            proposer.propose(ProposeBatch(rows[:B], k, samplings[B], gens.rows(B)))
        fns = [lambda B=B, k=k: step(B, k) for B in batch_sizes for k in ks]
        return _grid(_interleaved_medians(fns, iters, warmup, dev, progress), len(ks))
    out = []
    for B in batch_sizes:
        row = []
        for k in ks:
            full = [text(b, context + calls) for b in range(B)]
            grown = [r[:context] for r in full]
            for b in range(B):
                proposer.start(b, list(grown[b]))

            def grow_and_propose(B=B, k=k, grown=grown, full=full) -> None:
                for b in range(B):
                    grown[b].append(full[b][len(grown[b])])
                proposer.propose(ProposeBatch(grown, k, samplings[B], gens.rows(B)))
            row.append(_blocked_median(grow_and_propose, iters, warmup, dev, progress))
            for b in range(B):
                proposer.finish(b, grown[b], context)
        out.append(row)
    return out


class Acceptance(NamedTuple):
    per_pos: list[float]  # P(accepted run reaches draft position i+1 | the step drafted), i < k
    alpha: float  # i.i.d. acceptance with the same mean acceptance length per drafting step
    draft_rate: float  # drafting steps / steps
    stats: SpecStats  # the run's counters, merged over requests
    outputs: list  # the RequestOutputs


def measure_acceptance(llm, prompts: Sequence, k: int, params: SamplingParams) -> Acceptance:
    """Generate the workload with speculation at k (the LLM's num_speculative_tokens) and
    read acceptance per draft position from SpecStats."""
    spec = llm.engine.config.spec
    if spec.k != k:
        raise QuickdraftError(f"measure_acceptance: the LLM speculates {spec.k} tokens, not k={k}; "
                              f"build it with num_speculative_tokens={k}")
    outputs = llm.generate(list(prompts), params)
    stats = SpecStats()
    for o in outputs:
        stats.merge(o.stats)
    n = stats.num_drafts
    per_pos = [(stats.accepted_per_pos[i] / n if n and i < len(stats.accepted_per_pos) else 0.0) for i in range(k)]
    for i in range(1, k):  # a tree may count a deeper position without a shallower one: keep it monotone
        per_pos[i] = min(per_pos[i], per_pos[i - 1])
    rate = n / stats.num_steps if stats.num_steps else 0.0
    return Acceptance(per_pos, solve_alpha(1.0 + sum(per_pos), k), rate, stats, outputs)
