"""SamplingParams and the pure functions logits -> processed probabilities -> tokens.

Processing order (the same for target p and draft q, so rejection sampling compares
like with like): temperature, then top-k, then top-p, then min-p, each on the
distribution left by the previous one. Temperature 0 means greedy: the processed
distribution is one-hot on the argmax, which makes greedy decoding a special case of
the same sampling and verification code rather than a separate path. Temperatures
below GREEDY_BELOW are greedy too: dividing float32 logits by them overflows (NaN, or
token 0 repeated) or rounds the temperature to 0.0, and the distribution they ask for
is the argmax's up to ties anyway.

Penalties and logit bias (PenaltyState) change the target's raw logits before all of that, in
vLLM's order: logit_bias is added, then the repetition penalty (HF / CTRL semantics: over every
token of the prompt and the output so far, a positive logit is divided by it and a negative one
multiplied), then frequency and presence penalties (OpenAI semantics: over output tokens only,
logit -= frequency_penalty * count + presence_penalty * [count > 0]). Under speculation the
output so far at verify position i includes the draft tokens before it (its context if they
are accepted). The draft's q ignores penalties: q is exactly the distribution it sampled from,
so rejection sampling stays exact (penalties cost acceptance only).

Randomness is counter-based (StepRandom): every draw of a request is keyed by its seed
(all 64 bits, hashed: seed_key), the position it is generating at (its committed tokens)
and what the draw is for (a stream: the draft's tokens, the accept tests, the final token)
and index (draft depth, tree node). Nothing a row draws depends on how many numbers any row
drew before, so a seeded request gives the same tokens whatever else shares its batch,
however many tokens the other rows draft. A token is drawn by inverting the running sum of
its weights at one uniform (`draw`): no normalisation, no host sync, one random number a token.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from . import kernels
from .constraints import Constraint
from .errors import QuickdraftError


GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM's _SAMPLING_EPS)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's and vLLM's default: the library, every command and the server use it
MAX_TEMPERATURE = 100.0  # any higher is as flat as uniform over what top-k / top-p / min-p keep
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_REPETITION_PENALTY = 100.0  # repetition_penalty lies in (0, 100]
MAX_TOP_K = 2**31 - 1  # a larger top_k keeps every token of any vocabulary: the same as off
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's top_logprobs bound)
MAX_LOGIT_BIAS = 100.0  # logit_bias values are clamped to [-100, 100] (OpenAI's range)
SEED_RANGE = (-(2**63), 2**64)  # seeds are any signed or unsigned 64-bit integer: [low, high)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number_in(low: float, high: float, low_open: bool = False, note: str = ""):
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]{note}"

    def problem(value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            return "must be a finite number"
        if value < low or (low_open and value == low) or value > high:
            return f"must be in {interval}"
        return None
    return problem


def _integer_in(low: int, high: int | None, note: str = ""):
    def problem(value) -> str | None:
        if not _is_int(value) or value < low or (high is not None and value > high):
            return f"must be an integer {'>= ' + str(low) if high is None else f'in [{low}, {high}]'}{note}"
        return None
    return problem


def _seed(value) -> str | None:
    if not _is_int(value) or not SEED_RANGE[0] <= value < SEED_RANGE[1]:
        return "must be an integer in [-2**63, 2**64)"
    return None


# The one range check of each numeric sampling field: SamplingParams runs it, and so do the CLI's
# flags and the server's request bodies (so a bad value gets the same message wherever it comes from).
# None (where a field allows it) is never passed here.
FIELD_CHECKS = {
    "temperature": _number_in(0, MAX_TEMPERATURE, note=" (0 = greedy)"),
    "top_p": _number_in(0, 1, low_open=True, note=" (1 = off)"),
    "top_k": _integer_in(-1, None, note=" (0 or -1 = off)"),
    "min_p": _number_in(0, 1, note=" (0 = off)"),
    "max_tokens": _integer_in(1, None),
    "seed": _seed,
    "logprobs": _integer_in(0, MAX_LOGPROBS),
    "prompt_logprobs": _integer_in(0, MAX_LOGPROBS),
    "presence_penalty": _number_in(-MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": _number_in(-MAX_PENALTY, MAX_PENALTY),
    "repetition_penalty": _number_in(0, MAX_REPETITION_PENALTY, low_open=True, note=" (1 = off)"),
}


def field_problem(name: str, value) -> str | None:
    """What is wrong with `value` for the sampling field `name` ("must be in [0, 100] (0 = greedy)"),
    or None when it is valid."""
    return FIELD_CHECKS[name](value)


def check_field(name: str, value):
    """`value` if valid for the sampling field `name`, else QuickdraftError("invalid NAME: ...", field=NAME)."""
    problem = field_problem(name, value)
    if problem is not None:
        raise QuickdraftError(f"invalid {name}: {problem}, got {value!r}", field=name)
    return value


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = DEFAULT_TEMPERATURE  # in [0, 100]; 0 (or anything below GREEDY_BELOW = 1e-5) = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # drop tokens below min_p * max probability; 0 = off
    max_tokens: int = 16  # generated tokens, never exceeded
    seed: int | None = None  # per-request seed; None = fresh randomness
    stop: tuple[str, ...] = ()  # stop strings (excluded from the text)
    ignore_eos: bool = False  # keep generating past eos (benchmarks)
    # log-probabilities (see engine.TokenLogprob): None = off; n = each token's own and the n most
    # likely alternatives (0: its own only). Raw model log-probabilities: log_softmax of the
    # target's logits, before logit_bias, penalties, temperature and truncation (vLLM's default).
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none)
    presence_penalty: float = 0.0  # [-2, 2]: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # > 0; 1 = off: prompt and generated tokens' logits / or * it
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    # structured output (constraints.Constraint, or a one-entry mapping such as {"json_schema": {...}},
    # {"regex": "..."}, {"choice": [...]}, {"grammar": "..."}, {"json_object": True}): the target's
    # logits are masked to what the grammar allows, after penalties and before temperature / truncation
    constraint: Constraint | Mapping | None = None

    def __post_init__(self) -> None:
        def bad(field: str, msg: str) -> QuickdraftError:
            return QuickdraftError(f"invalid {field}: {msg}", field=field)

        object.__setattr__(self, "constraint", Constraint.of(self.constraint))
        for name in FIELD_CHECKS:
            value = getattr(self, name)
            if value is not None or name not in ("seed", "logprobs", "prompt_logprobs"):
                check_field(name, value)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            raise bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise bad("stop", "stop strings must not be empty")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                raise bad("logit_bias", f"must be a mapping of token id to bias, got {type(bias).__name__}")
            clean = {}
            for t, b in bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise bad("logit_bias", f"keys must be token ids (integers >= 0), got {t!r}")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not _finite(b):
                    raise bad("logit_bias", f"values must be finite numbers, got {b!r} for token {t}")
                clean[t] = min(max(float(b), -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)
            # a read-only copy: the params stay immutable and hashable by identity of content
            object.__setattr__(self, "logit_bias", _FrozenDict(clean) if clean else None)

    @property
    def penalized(self) -> bool:
        """Whether the target's logits are changed before sampling (penalties or logit_bias)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.logit_bias is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class _FrozenDict(dict):
    """A dict that refuses changes (logit_bias inside frozen SamplingParams) and hashes by content."""

    def _readonly(self, *args, **kwargs):
        raise TypeError("SamplingParams.logit_bias is read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self):  # pickles (torch.distributed, Ray) without calling __setitem__
        return (_FrozenDict, (dict(self),))


class PenaltyState:
    """The penalties and logit bias of a batch's rows as tensors, built once per batch
    composition (None when no row has any: the step then does nothing extra).

    apply(logits, outputs, drafts) penalises raw logits (B, T, V) at T positions: position 0
    follows each row's committed output, position t also follows the draft tokens in its
    context (`drafts`: draft_context's tokens and mask). Only the tokens a penalty can touch
    are computed (gathered, changed, scattered back): those of the prompt (repetition), of the
    output and of the drafts, not the whole vocabulary at every position."""

    def __init__(self, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]], vocab: int,
                 device: torch.device):
        B = len(params)
        self.vocab = vocab
        self.device = device
        self.repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
        self.frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)
        self.presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
        self.any_repetition = any(p.repetition_penalty != 1 for p in params)
        self.any_counts = any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params)
        self.bias = None
        if any(p.logit_bias for p in params):
            bias = torch.zeros(B, vocab, dtype=torch.float32)
            for b, p in enumerate(params):
                for t, v in (p.logit_bias or {}).items():
                    bias[b, t] = v
            self.bias = bias.to(device)
        # the repetition penalty's prompt tokens: a (B, V) mask, and each row's distinct ones as ids
        rep_prompts = [sorted(set(pr)) if p.repetition_penalty != 1 else [] for p, pr in zip(params, prompts)]
        self.prompt_ids = _padded(rep_prompts, device)
        self.prompt_mask = _occurrences(rep_prompts, vocab, device) > 0

    @classmethod
    def build(cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]], vocab: int,
              device: torch.device) -> PenaltyState | None:
        return cls(params, prompts, vocab, device) if any(p.penalized for p in params) else None

    def output_counts(self, outputs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's view of each row's generated tokens: (B, V) counts and (B, n) distinct ids
        (apply takes it instead of the lists when one step applies the penalties more than once:
        a draft's chain)."""
        return _occurrences(outputs, self.vocab, self.device), _padded([sorted(set(o)) for o in outputs], self.device)

    def apply(self, logits: torch.Tensor, outputs: Sequence[Sequence[int]] | tuple[torch.Tensor, torch.Tensor],
              drafts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Penalised float32 logits (a new tensor), the shape of `logits` ((B, V) or (B, T, V)).
        outputs: each row's generated tokens so far, or their output_counts; drafts: None, or
        (tokens (B, N) with -1 = absent, in_context (B, T, N) bool: which of them precede
        position t), as draft_context gives."""
        squeeze = logits.dim() == 2
        x = logits.float()[:, None] if squeeze else logits.float()
        x = x + self.bias[:, None] if self.bias is not None else x.clone()
        if self.any_repetition or self.any_counts:
            counts, out_ids = outputs if isinstance(outputs, tuple) else self.output_counts(outputs)
            B, T, _ = x.shape
            ids = torch.cat([self.prompt_ids, out_ids], 1)  # (B, M): every token a penalty may touch
            if drafts is not None:
                tokens, in_context = drafts
                ids = torch.cat([ids, tokens.clamp(min=0)], 1)
            n = counts.gather(1, ids)[:, None].expand(B, T, ids.shape[1])  # occurrences in the output
            if drafts is not None:  # plus the draft tokens before each position
                same = (tokens[:, :, None] == ids[:, None, :]) & (tokens >= 0)[:, :, None]  # (B, N, M)
                n = n + in_context.float() @ same.float()
            where = ids[:, None].expand(B, T, ids.shape[1])
            xs = x.gather(2, where)
            if self.any_repetition:
                seen = (n > 0) | self.prompt_mask.gather(1, ids)[:, None]
                rp = self.repetition.view(-1, 1, 1)
                xs = torch.where(seen, torch.where(xs > 0, xs / rp, xs * rp), xs)
            if self.any_counts:
                xs = xs - self.frequency.view(-1, 1, 1) * n - self.presence.view(-1, 1, 1) * (n > 0)
            x.scatter_(2, where, xs)  # an id listed twice gets the same value twice
        return x[:, 0] if squeeze else x


def _padded(seqs: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """(B, n) int64 ids, each row right-padded with its first id (or 0): a repeated id is
    harmless to PenaltyState.apply, which computes every listed id exactly."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            out[b, :len(s)] = torch.as_tensor(s, dtype=torch.long)
            out[b, len(s):] = s[0]
    return out.to(device)


def _occurrences(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(B, V) float32 counts of each token in each row's sequence: one scatter_add."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32)
    if width:
        ids = torch.full((len(seqs), width), vocab, dtype=torch.long)  # padding counts in column V
        for b, s in enumerate(seqs):
            if s:
                ids[b, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        out.scatter_add_(1, ids, torch.ones(ids.shape))
    return out[:, :vocab].to(device)


def draft_context(tokens: torch.Tensor, anc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PenaltyState.apply's `drafts` for a verify forward over [last, nodes...]: position 0
    (after the committed tokens) has no draft token in its context; position 1 + n (after node n)
    has node n and its ancestors. tokens (B, N) (-1 = absent), anc (B, N, N)
    (tree.tree_structure's; a chain's is chain_ancestors')."""
    B, N = tokens.shape
    return tokens, torch.cat([anc.new_zeros(B, 1, N), anc & (tokens >= 0)[:, None, :]], 1)


def chain_ancestors(tokens: torch.Tensor) -> torch.Tensor:
    """(B, k, k) anc of a chain: token j is in the context after token i when j <= i."""
    B, k = tokens.shape
    tril = torch.ones(k, k, dtype=torch.bool, device=tokens.device).tril()
    present = tokens >= 0
    return tril[None] & present[:, :, None] & present[:, None, :]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """Raw log-probabilities of `tokens` (B, T) under logits (B, T, V), their ranks (1 = the
    most likely) and the `top` most likely alternatives, packed as float64 (B, T, 2 + 2 * top):
    [logprob, rank, top logprobs..., top ids...] (float64 holds every id exactly), so that
    the caller reads everything back in one transfer."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(-1, tokens.clamp(min=0)[..., None])  # (B, T, 1)
    rank = (lp > chosen).sum(-1, keepdim=True) + 1
    parts = [chosen.double(), rank.double()]
    if top:
        vals, ids = lp.topk(top, dim=-1)
        parts += [vals.double(), ids.double()]
    return torch.cat(parts, -1)


@dataclass(frozen=True)
class BatchSampling:
    """Per-row sampling parameters as tensors, built once per batch composition."""

    temperature: torch.Tensor  # (B,) float32; 0 rows are greedy
    top_k: torch.Tensor  # (B,) int64; 0 = off
    top_p: torch.Tensor  # (B,) float32
    min_p: torch.Tensor  # (B,) float32
    any_greedy: bool
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device) -> BatchSampling:
        temps = [0.0 if p.greedy else float(p.temperature) for p in params]
        top_k = [min(max(p.top_k, 0), MAX_TOP_K) for p in params]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            any_greedy=any(t == 0 for t in temps),
            all_greedy=all(t == 0 for t in temps),
            any_top_k=any(k > 0 for p, k in zip(params, top_k) if not p.greedy),
            any_top_p=any(p.top_p < 1 for p in params if not p.greedy),
            any_min_p=any(p.min_p > 0 for p in params if not p.greedy),
        )


def process_logits(logits: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """logits (B, ..., V) -> probabilities (B, ..., V) in float32 after temperature,
    top-k, top-p and min-p; greedy rows become one-hot on the argmax."""
    logits = logits.float()
    shape = (-1,) + (1,) * (logits.dim() - 1)  # broadcast per-row values over (..., V)
    if s.all_greedy:
        return _one_hot_argmax(logits)
    temp = s.temperature.view(shape)
    logits = logits / torch.where(temp > 0, temp, 1.0)
    if s.any_top_k or s.any_top_p:
        sorted_logits, _ = logits.sort(dim=-1, descending=True)
        if s.any_top_k:
            V = logits.shape[-1]
            k = torch.where(s.top_k > 0, s.top_k.clamp(max=V), V).view(shape)
            kth = sorted_logits.gather(-1, (k - 1).expand(*logits.shape[:-1], 1))
            logits = logits.masked_fill(logits < kth, -math.inf)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
        if s.any_top_p:
            sorted_probs = sorted_logits.softmax(-1)
            mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
            top_p = s.top_p.view(shape)
            # The cut-off is the smallest kept probability; rows with top_p = 1 keep all.
            keep = (mass_before < top_p) | (top_p >= 1)
            keep[..., 0] = True
            cutoff = sorted_logits.masked_fill(~keep, math.inf).amin(-1, keepdim=True)
            logits = logits.masked_fill(logits < cutoff, -math.inf)
    probs = logits.softmax(-1)
    if s.any_min_p:
        min_p = s.min_p.view(shape)
        threshold = min_p * probs.amax(-1, keepdim=True)
        kept = probs.masked_fill(probs < threshold, 0.0)
        # only the rows that use min_p are renormalised: a row's bits never depend on its neighbours
        probs = torch.where(min_p > 0, kept / kept.sum(-1, keepdim=True), probs)
    if s.any_greedy:
        greedy = (s.temperature == 0).view(shape)
        probs = torch.where(greedy, _one_hot_argmax(logits), probs)
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that mixes every input bit."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _hash(*parts: int) -> int:
    """A 64-bit hash of a tuple of integers (each taken modulo 2**64)."""
    h = 0x6A09E667F3BCC908
    for p in parts:
        h = _mix64(h ^ _mix64((p & _M64) + 0x9E3779B97F4A7C15))
    return h


def seed_key(seed: int | None) -> int:
    """A request's 64-bit random key: a hash of all 64 bits of its seed (PyTorch's CPU generator
    keeps only the low 32 bits of a seed: s and s + 2**32 would be the same stream), or 64 fresh
    random bits for an unseeded request."""
    if seed is None:
        return secrets.randbits(64)
    return _hash(0x5EED, seed)


class Stream:
    """What a draw is for: each has its own numbers (StepRandom)."""
    SAMPLE = 1  # a token sampled from p alone (prefill, plain decoding without a verifier)
    DRAFT = 2  # a draft's tokens: one uniform per depth (index) and sibling
    ACCEPT = 3  # the verifier's accept tests: one U[0, 1) per draft node
    FINAL = 4  # the verifier's recovered or bonus token: one uniform


class StepRandom:
    """The random numbers of one step for a batch of requests, counter-based: row b's draws
    are a function of (its request's key, its position, the stream, the index) only.

    keys: seed_key per row; positions: per row, the committed tokens at the step's start
    (every step commits at least one, so no two steps of a request share a position).
    Every number is a hash of that tuple, computed on the host per element, so a row's i-th
    number is the same however many the batch needs: one per token drawn (`draws`, 53 bits)
    and one per accept test (`uniform`, 24 bits)."""

    def __init__(self, keys: Sequence[int], positions: Sequence[int], device: torch.device | str):
        self.keys = list(keys)
        self.positions = list(positions)
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.keys)

    def rows(self, n: int) -> StepRandom:
        """The first n rows' randomness."""
        return StepRandom(self.keys[:n], self.positions[:n], self.device)

    def draws(self, stream: int, n: int = 1, index: int = 0) -> torch.Tensor:
        """(B, n) float64 U[0, 1) with 53 random bits, one per token to draw (`draw`); element
        j of row b is a hash of (key_b, position_b, stream, index, j)."""
        rows = [[(_hash(key, pos, stream, index, j) >> 11) * 2.0**-53 for j in range(n)]
                for key, pos in zip(self.keys, self.positions)]
        return torch.tensor(rows, dtype=torch.float64).reshape(len(self.keys), n).to(self.device)

    def draft_draws(self, k: int, width: int = 1) -> torch.Tensor:
        """(B, k, width) draws for a draft k deep with `width` siblings per depth: depth i's
        are the same whatever k is."""
        return torch.stack([self.draws(Stream.DRAFT, width, i) for i in range(k)], 1)

    def uniform(self, stream: int, n: int) -> torch.Tensor:
        """(B, n) U[0, 1) draws (24-bit, exact in float32); element i of row b is a hash of
        (key_b, position_b, stream, i)."""
        rows = [[(_hash(key, pos, stream, i) >> 40) * 2.0**-24 for i in range(n)]
                for key, pos in zip(self.keys, self.positions)]
        return torch.tensor(rows, dtype=torch.float32).reshape(len(self.keys), n).to(self.device)


DRAW_BLOCK = 256  # draw's first level: float64 sums of this many weights


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index ~ weights / sum(weights) along the last dim (weights >= 0, not necessarily
    normalised; u (...) U[0, 1) float64, StepRandom.draws) by inverting the running sum at
    u x total, in float64 and in two levels: the running sum of DRAW_BLOCK-weight block sums
    picks a block, the block's own running sum the index. One uniform per token drawn, where an
    exponential race (argmax w / E) needs one Exp(1) draw per vocabulary entry (~0.5 ms a row of
    49,152 on a CPU); no full-size float64 buffers. The threshold is held below the total, so
    the index lands on a positive weight; all-zero weights give index 0. On a CPU with
    quickdraft's kernels, one call (kernels.draw: its block sums in an order of its own)."""
    if kernels.runs_sampling((weights,), (u,)):
        return kernels.draw(weights, u.expand(weights.shape[:-1]))
    V = weights.shape[-1]
    n = min(V, DRAW_BLOCK)
    w = weights if V % n == 0 else torch.nn.functional.pad(weights, (0, -V % n))
    blocks = w.unflatten(-1, (-1, n))  # (..., nb, n)
    ends = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # (..., nb) running sum at each block's end
    total = ends[..., -1:]
    x = torch.minimum(u.to(ends.dtype).unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    b = torch.searchsorted(ends, x, right=True).clamp_max(ends.shape[-1] - 1)  # (..., 1) x < ends[b]
    start = torch.where(b > 0, ends.gather(-1, (b - 1).clamp_min(0)), 0.0)
    inside = blocks.gather(-2, b.unsqueeze(-1).expand(*b.shape, n)).squeeze(-2)  # (..., n)
    c = inside.double().cumsum(-1)
    j = torch.searchsorted(c, x - start, right=True)
    # the block's own sum and its block sum round apart by ~1e-16: past its end, its last positive weight
    last = torch.where(inside > 0, torch.arange(n, device=w.device), -1).amax(-1, keepdim=True)
    j = torch.minimum(j, last).clamp_min(0)
    i = (b * n + j).squeeze(-1)
    return torch.where(total.squeeze(-1) > 0, i, 0)
