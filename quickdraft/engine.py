"""The step loop: propose -> verify -> commit -> stats.

Rows 0..n-1 of the KV caches hold the n running requests. Invariant after a request's
prefill: the target's cache holds every committed token but the last, which is fed at
the start of the next step together with the k draft tokens:

    input  [t_{L-1}, d_1 .. d_k]  at positions L-1 .. L-1+k   (one target forward)
    output p after each prefix     -> verifier -> accepted d_1..d_n + recovered/bonus

Rejected entries are left in the cache and overwritten later (rollback is free). When a
request finishes, the last row moves into its place, so the batch stays dense.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from . import kernels
from .cache import KVBudget, KVCache, available_memory, return_freed_memory, row_bytes, to_device
from .config import (AUTO_ATTENTION_COST, AUTO_QUANTISED_KV_CACHE_DTYPE, AUTO_BATCHED_TOKENS, AUTO_BATCHED_TOKENS_GPU, DEFAULT_KV_CACHE_MEMORY_CPU, DEFAULT_KV_CACHE_MEMORY_GPU, EngineConfig,
                     format_bytes)
from .constraints import GrammarVocabulary, Vocabularies, batch_masks
from .errors import ContextLengthError, PrefixCacheMismatch, QuickdraftError
from .metrics import SpecStats
from .prefix_cache import PrefixCache
from .model.quant import quantised_layers, row_invariant
from .model.tokenizer import Detokenizer, Tokenizer
from .model.transformer import Block, Transformer, forward_chunks, pad_chunks
from .proposers import get as get_proposer
from .proposers.base import Draft, ProposeBatch, Proposer, VerifyResult
from .sampling import (BatchSampling, PenaltyState, SamplingParams, StepRandom, Stream, chain_ancestors,
                       draft_context, draw, process_logits, seed_key, token_logprobs)
from .tree import tree_mask, tree_structure
from .policy import RowState, check_policy, load_profile, make_policy
from .verify import greedy_verify_host, rejection_sample, tree_greedy_verify, tree_rejection_sample

log = logging.getLogger("quickdraft")


@dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """What one verify step decided, per row, read back from the device in one sync."""
    tokens: list[list[int]]  # the tokens to commit: accepted drafts, then the recovered or bonus token
    num_accepted: list[int]  # draft tokens the verifier kept
    num_drafted: list[int]  # draft tokens (nodes) the row proposed
    accepted_nodes: list[list[int]] | None  # trees: the accepted path's node indices (root's child first)
    target_tokens: list[list[int]] | None  # for proposers that want them: the target's argmax at every position
    hidden: torch.Tensor | None = None  # for proposers with hidden_layers: the verify forward's states (B, 1+N, ...)
    logprobs: list[list[list[float]] | None] | None = None  # per row asking: token_logprobs' packed rows, per token


def _read_back(**fields: torch.Tensor | None) -> dict[str, list[list[int]]]:
    """Copy named (B, n_i) integer tensors to the host in ONE transfer (the step's only host
    sync) and split each row back by name; None fields stay None."""
    named = [(name, t) for name, t in fields.items() if t is not None]
    packed = torch.cat([t for _, t in named], 1).tolist()
    out: dict[str, list[list[int]] | None] = dict.fromkeys(fields)
    start = 0
    for name, t in named:
        width = t.shape[1]
        out[name] = [row[start:start + width] for row in packed]
        start += width
    return out


@dataclass(frozen=True)
class TokenLogprob:
    """A token's raw log-probability under the target (log_softmax of its logits, before
    logit_bias, penalties, temperature and truncation: see SamplingParams.logprobs), taken from
    the forward that produced the token (prefill or verify; no extra forward)."""
    token_id: int
    logprob: float
    rank: int  # 1 = the target's most likely token there
    top: tuple[tuple[int, float], ...] = ()  # the n most likely tokens (n = SamplingParams.logprobs), best first


def _token_logprob(packed: list[float], token: int, n: int) -> TokenLogprob:
    """A TokenLogprob from one position of sampling.token_logprobs' packed output (whose top
    has width (len - 2) / 2 >= n)."""
    width = (len(packed) - 2) // 2
    return TokenLogprob(token, packed[0], int(packed[1]),
                        tuple((int(i), v) for v, i in zip(packed[2:2 + n], packed[2 + width:2 + width + n])))


@dataclass(kw_only=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str
    finished: bool
    finish_reason: str | None  # "stop" (eos or stop string), "length" (max_tokens), "abort"
    stats: SpecStats
    new_token_ids: list[int] = field(default_factory=list)  # since this request's previous output
    new_text: str = ""
    logprobs: list[TokenLogprob] | None = None  # per generated token (SamplingParams.logprobs)
    new_logprobs: list[TokenLogprob] | None = None  # since the previous output (new_token_ids')
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, None for the first
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)
    token_origins: list[str] = field(default_factory=list)  # per generated token: an ORIGINS word
    new_token_origins: list[str] = field(default_factory=list)  # since the previous output (new_token_ids')


# Where each generated token came from (RequestOutput.token_origins): the prefill's first token;
# a draft token the verifier accepted; the token a step samples from the target itself (the
# recovered token at a rejection, the bonus token after full acceptance, or a step that drafted
# nothing); a token a constraint forced (proposed in the proposer's place, then accepted by the
# verifier like any draft). Counted per request, PREFILL + TARGET tokens = prefills + steps and
# DRAFT + FORCED tokens = accepted drafts (SpecStats; FORCED alone = its forced_tokens), unless an
# eos or stop string cut the last step short.
PREFILL, DRAFT, TARGET, FORCED = "prefill", "draft", "target", "forced"
ORIGINS = (PREFILL, DRAFT, TARGET, FORCED)


class _Request:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, device: torch.device,
                 tokenizer: Tokenizer | None, max_k: int | None = None, vocab: GrammarVocabulary | None = None):
        self.id = request_id
        self.vocab = vocab  # the grammar vocabulary, for a request with a constraint
        self.max_k = max_k  # this request's own cap on num_speculative_tokens (None = the engine's)
        self.prompt = prompt
        self.params = params
        self.key = seed_key(params.seed)  # every random draw of this request is keyed by it (StepRandom)
        self.start_over(device, tokenizer)
        self.finish_reason: str | None = None
        self.spec_state: RowState | None = None  # the speculation policy's view of this request
        self.stats = SpecStats()
        self.started = time.perf_counter()

    def start_over(self, device: torch.device, tokenizer: Tokenizer | None) -> None:
        """Nothing generated yet (a new request, or one whose prefill is retried)."""
        self.tokens = list(self.prompt)  # prompt + generated, committed
        self.num_computed = 0  # prompt positions whose KV the target's cache holds (chunked prefill)
        self.num_cached = 0  # of them, copied from the prefix cache
        # positions whose KV has the bits a prefill gives them (None: every committed one). A token
        # tree's verify computes its nodes' keys among their siblings' slots, whose sums differ in
        # the last bits: the prefix cache keeps only what a prefill of the same tokens would compute.
        self.kv_exact: int | None = None
        self.output: list[int] = []
        self.origins: list[str] = []  # per output token (ORIGINS)
        self.logprobs: list[TokenLogprob] | None = [] if self.params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.detok = Detokenizer(tokenizer, self.prompt) if tokenizer is not None else None
        self.text = ""
        self.sent_ids = 0  # how much of output/text earlier outputs carried
        self.sent_text = 0
        # the constraint's grammar state over the committed output (constraints.Matcher)
        self.matcher = None if self.params.constraint is None else self.vocab.matcher(self.params.constraint)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)

    def snapshot(self) -> RequestOutput:
        # Hold back text that could be the start of a stop string until we know it is not.
        hold = 0 if self.finished else max((len(s) - 1 for s in self.params.stop), default=0)
        visible = max(self.sent_text, len(self.text) - hold)
        lps = self.logprobs
        out = RequestOutput(request_id=self.id, prompt_token_ids=self.prompt, token_ids=list(self.output),
                            text=self.text, finished=self.finished, finish_reason=self.finish_reason,
                            stats=self.stats, new_token_ids=self.output[self.sent_ids:],
                            new_text=self.text[self.sent_text:visible],
                            logprobs=None if lps is None else list(lps),
                            new_logprobs=None if lps is None else lps[self.sent_ids:],
                            prompt_logprobs=self.prompt_logprobs, token_origins=list(self.origins),
                            new_token_origins=self.origins[self.sent_ids:], num_cached_tokens=self.num_cached)
        self.sent_ids, self.sent_text = len(self.output), visible
        return out


class Engine:
    def __init__(self, target: Transformer, proposer: Proposer | None = None,
                 config: EngineConfig = EngineConfig(), tokenizer: Tokenizer | None = None,
                 eos_token_ids: tuple[int, ...] = ()):
        get_proposer(config.spec.method)  # a known method name (the registry says which)
        check_policy(config.spec.policy, config.spec.profile)
        if config.spec.k > 0 and proposer is None:
            raise QuickdraftError(f"method {config.spec.method!r} needs a proposer")
        self.target = target
        _set_kv_cache_dtype(target, config.kv_cache_dtype)  # (before any cache or compiled step is made)
        self.proposer = proposer
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._grammar = Vocabularies(tokenizer, target.config.vocab_size, sorted(self.eos_token_ids))
        self.k = config.spec.k
        self._wants_target_tokens = proposer is not None and proposer.wants_target_tokens
        self._hidden_layers = None if proposer is None else proposer.hidden_layers
        self.policy = None
        self._forward = target  # the decode / verify forward: the model, or its compiled step
        if config.compile is True:
            from .compile import StepFunction

            self._forward = StepFunction(target, name="target")
            if proposer is not None:
                proposer.compile(lambda model, name, **kw: StepFunction(model, name=name, **kw))
        # the models whose AOT packages are missing (compile "auto": decoding runs them eagerly)
        self.aot_missing: list[str] = []
        # Mixed steps: a prefill chunk rides in the running batch's verify forward (Transformer.forward_packed),
        # so the weights are read once for both. Only where a row's bits cannot depend on the rows beside it
        # (row-invariant linear layers), and on the eager model or the AOT steps with their packed package
        # (aot._PackedStep: then every chunk, mixed or not, runs that package, and a running row's bits are
        # its decode package's); a torch.compile'd step or a tensor-parallel target alternate.
        self._packs = isinstance(target, Transformer) and row_invariant(target)
        self._attention_position = attention_position(target.config)  # (the "auto" budget's weights)
        self._pending_build = None  # an aot.BackgroundBuild whose packages the next step switches to
        self._loading: threading.Thread | None = None  # loading them, once the build has ended
        self._ready_at: float | None = None  # when they were loaded, while requests in flight delay the switch
        self._draining = False  # admitting nothing until the requests in flight finish, then switching
        if config.compile in ("aot", "auto"):  # ahead-of-time compiled packages (CPU)
            from . import aot

            self.aot_missing = self._use_packages(aot.load_or_build if config.compile == "aot" else aot.load)
        if self.k > 0:  # (after the forwards are chosen: the auto policy's costs are keyed by them)
            profile = None if config.spec.profile is None else load_profile(config.spec.profile)
            self.policy = make_policy(config.spec.policy, self.k, profile, config.spec.method,
                                      cost_key=self.cost_key() if config.spec.policy == "auto" else None)
        if proposer is not None and self.k > 0:  # a proposer's own measured costs are cached under the same key
            proposer.set_cost_key(self.cost_key())
        # cache room past a request's last token for one step's draft nodes
        self._draft_room = proposer.max_draft_tokens(self.k) if proposer is not None and self.k > 0 else 0
        self.device = target.device
        self.budget = self._make_budget(config)
        self.max_model_len = self._max_model_len(config)
        # On a GPU a server's caches are allocated once, at their largest (static shapes and addresses
        # for CUDA graphs: config.preallocate); else they grow and shrink as requests need them.
        self.fixed_size = config.preallocate and self.device.type != "cpu"
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # decoding, in rows 0..len - 1
        # admitted, prompt not fully computed yet (chunked prefill), in the rows after the running ones, in order
        self.prefilling: list[_Request] = []
        self._prefilled_last = False  # the last step prefilled: the next one decodes (streams keep flowing)
        self._mixing: _Mixing | None = None  # the current step's prefill part, while it mixes
        self._mix_declined = False  # the last step could not take a chunk: the next one prefills alone
        self.cache: KVCache | None = None
        self.prefix_cache: PrefixCache | None = None
        if config.enable_prefix_caching:
            if getattr(target, "new_kv_cache", None) is not None:
                raise QuickdraftError("prefix caching does not support a tensor-parallel target yet: "
                                      "turn it off (enable_prefix_caching=False, --no-enable-prefix-caching)")
            # its blocks are claimed from the budget ("prefix") and evicted when requests need the memory
            self.prefix_cache = PrefixCache(config.prefix_cache_bytes, budget=self.budget)
        # the debug check compares bits where a prefill's bits do not depend on its row count
        self._check_exact = bool(config.prefix_cache_check) and row_invariant(target)
        self._batch_sampling: BatchSampling | None = None  # rebuilt when the batch changes
        self._batch_penalties: PenaltyState | None = None  # with it: None when no row has penalties
        self.stats = SpecStats()  # every request's steps since the engine started (the server exports it)
        self._admit_singly = 0  # admissions still to make one request per step (after a failed prefill)
        self._stepping: list[_Request] = []  # the requests the current step is prefilling

    # ---- the KV memory budget ----------------------------------------------------------

    def _make_budget(self, config: EngineConfig) -> KVBudget:
        """The KV budget: config.kv_cache_memory bytes, or that fraction of the memory available
        now (after the weights loaded); by default a fraction (DEFAULT_KV_CACHE_MEMORY_*) of it,
        but never more than max_num_seqs rows of the longest request could use."""
        token_bytes = KVCache.token_bytes(self.target)
        if self.proposer is not None and self.k > 0:
            token_bytes += self.proposer.kv_token_bytes()
        asked = config.kv_cache_memory
        if isinstance(asked, int):
            return KVBudget(asked, token_bytes)
        cpu = self.device.type == "cpu"
        fraction = asked if asked is not None else DEFAULT_KV_CACHE_MEMORY_CPU if cpu else DEFAULT_KV_CACHE_MEMORY_GPU
        total = int(fraction * available_memory(self.device))
        if asked is None:
            ctx = min(config.max_model_len or self.target.config.max_position_embeddings,
                      self.target.config.max_position_embeddings)
            total = min(total, config.max_num_seqs * row_bytes(token_bytes, ctx + self._draft_room + 1))
        return KVBudget(total, token_bytes)

    def _max_model_len(self, config: EngineConfig) -> int:
        """Tokens per request (prompt + max_tokens): the model's context, what one request can
        hold within the budget, and config.max_model_len, whichever is least."""
        ctx = self.target.config.max_position_embeddings
        self.budget_len = self.budget.row_tokens() - self._draft_room - 1  # one request with the whole budget
        if self.budget_len < 2:
            raise QuickdraftError(
                f"the KV cache budget ({format_bytes(self.budget.total)}) holds {max(0, self.budget.row_tokens())} "
                f"positions at {format_bytes(self.budget.token_bytes)} per token: too few for one request "
                f"({self._draft_room + 3} at least); give kv_cache_memory more", field="kv_cache_memory")
        if config.max_model_len is not None and config.max_model_len > self.budget_len:
            raise QuickdraftError(
                f"max_model_len {config.max_model_len} does not fit the KV cache budget "
                f"({format_bytes(self.budget.total)} holds {self.budget_len} tokens for one request at "
                f"{format_bytes(self.budget.token_bytes)} per token): lower max_model_len or raise kv_cache_memory",
                field="max_model_len")
        return min(config.max_model_len or ctx, ctx, self.budget_len)

    def memory_summary(self) -> str:
        """One line for a server's log: the budget, bytes per token, max_model_len, and the
        requests of that length the budget holds at once."""
        b = self.budget
        full = min(self.config.max_num_seqs, b.total // row_bytes(b.token_bytes, self._full_capacity()))
        how = "allocated once" if self.fixed_size else "taken as requests need it"
        return (f"KV cache budget {format_bytes(b.total)} ({how}), {b.token_bytes:,} bytes per token, "
                f"max_model_len {self.max_model_len} (the model's context "
                f"{self.target.config.max_position_embeddings}), {full} requests of that length at once")

    def context_text(self) -> str:
        """What bounds max_model_len, for errors: the model's context, or the KV budget."""
        ctx = self.target.config.max_position_embeddings
        if self.max_model_len == self.budget_len and self.budget_len < ctx:
            return (f"the longest request the KV cache budget holds ({self.max_model_len} tokens: "
                    f"{format_bytes(self.budget.total)} at {format_bytes(self.budget.token_bytes)} per token; "
                    f"the model's context is {ctx})")
        return f"the model's context length ({self.max_model_len})"

    def kv_cache_bytes(self) -> int:
        """Bytes the KV caches hold now (the target's and the proposer's rows; the prefix cache's
        blocks are its own claim in the budget)."""
        return self.budget.claims.get("rows", 0)

    def release_caches(self) -> None:
        """With no request running: free the caches (the next request allocates what it needs).
        A no-op while requests run, and for caches allocated once (config.preallocate on a GPU).
        The prefix cache's blocks are tensors of their own and stay (the budget evicts them when
        requests need the memory)."""
        if self.running or self.prefilling or self.cache is None or self.fixed_size:
            return
        self.cache = None
        if self.proposer is not None:
            self.proposer.resize(0, 0, 0)
        self.budget.claim("rows", 0)
        if self.device.type == "cpu":
            return_freed_memory()

    def cost_key(self) -> dict:
        """What this engine's step costs depend on, for the auto policy's cached calibration: the
        target's and the proposer's models (shapes, parameter and buffer formats), the method and
        its options, k, the forward that runs (eager, compiled, AOT), the machine (CPU, kernel
        ISA, threads) and torch."""
        import os
        import platform

        def model(m: torch.nn.Module) -> dict:
            formats = sorted({f"{type(x).__name__}:{t.dtype}" for x in m.modules()
                              for t in list(x.parameters(recurse=False)) + list(x.buffers(recurse=False))})
            return {"class": type(m).__name__, "config": repr(getattr(m, "config", None)), "formats": formats,
                    "parameters": sum(p.numel() for p in m.parameters())}

        drafts = {} if self.proposer is None else {
            name: model(m) for name, m in sorted(vars(self.proposer).items()) if isinstance(m, torch.nn.Module)}
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
        except OSError:
            pass
        device = self.target.device
        return {"target": model(self.target), "method": self.config.spec.method,
                "proposer": type(self.proposer).__name__, "drafts": drafts,
                "options": {k: repr(v) for k, v in sorted(self.config.spec.options.items())}, "k": self.k,
                "forward": f"{type(self._forward).__name__}:{self.config.compile}",
                "device": str(device), "machine": cpu if device.type == "cpu" else torch.cuda.get_device_name(device)
                if device.type == "cuda" else device.type,
                # the kernels' path follows the CPU unless forced (asking kernels.isa() could build them)
                "isa": os.environ.get("QUICKDRAFT_ISA") if device.type == "cpu" else None,
                "vnni": os.environ.get("QUICKDRAFT_VNNI") if device.type == "cpu" else None,
                "kernels": kernels.source_digest() if device.type == "cpu" else None,  # (their speed changes with them)
                "aten": torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else None,
                "threads": torch.get_num_threads(), "torch": torch.__version__}

    def _use_packages(self, make) -> list[str]:
        """Run the target's and the proposer's forwards through the AOT packages `make(model,
        **kw)` returns (aot.load, or aot.load_or_build); the models still without theirs (a
        package missing where one could run) stay as they are and are returned ("the target",
        "the draft")."""
        from . import aot

        missing: list[str] = []

        def tracked(model, **kw):
            step = make(model, **kw)
            if aot.unsupported(model) is None and (step is None or (kw.get("trees") and step.tree_runner is None)
                                                   or (kw.get("packed") and step.packed_runner is None)):
                missing.append("the target" if model is self.target else "the draft")
            return step

        # a proposer reading hidden states gets the package that returns them with the logits; a
        # row-invariant target the packed one too (mixed steps)
        trees = self.proposer is not None and self.k > 0 and self.proposer.may_draft_trees(self.k)
        step = tracked(self.target, hidden_at=self._hidden_layers, trees=trees,
                       packed=self._packs and aot.mixed_packages_enabled())
        if step is not None:
            if step.packed_runner is not None and not step.packed_agrees():
                log.warning("quickdraft: the AOT mixed-step package gives running rows other bits than the decode "
                            "package (%s); prefill chunks and decode steps alternate", step.packed_path)
                step.packed_runner = None
            self._forward = step
        if self.proposer is not None:
            self.proposer.use_forward(tracked)
        return missing

    def switch_when_built(self, build) -> None:
        """Switch to the AOT packages `build` (an aot.BackgroundBuild of this engine's missing
        ones) makes, at the first step boundary after it ends with no request in flight. The
        packages compute the eager forwards' steps to float rounding, not bit for bit (Inductor
        fuses the elementwise ops), so a request whose steps ran partly eagerly and partly
        compiled could get greedy tokens that neither kind of step alone gives, and its speculative
        output could differ from its plain decoding's (seen: two SmolLM2 engines, plain and suffix
        decoding, that switched at different steps of the same greedy request after a
        2,800-token prompt gave different tokens; on one kind of step throughout, the same).
        Under constant load, AOT_SWITCH_DRAIN_S after the packages are loaded the engine admits
        nothing new until the requests in flight finish (a one-time pause), then switches."""
        self._pending_build = build
        self._ready_at, self._draining = None, False

    def _switch_if_built(self, wait: bool = False) -> None:
        """Once the build has ended: load its packages in a thread while steps go on (loading
        imports Inductor and maps the libraries: seconds), then switch to them here, between
        two steps. `wait`: block until switched (or the build failed)."""
        build = self._pending_build
        if build is None or not (build.done() or (wait and build.wait())):
            return
        if self._loading is None:
            failure = build.failure()
            if failure is not None:
                self._pending_build = None
                log.warning("quickdraft: the background AOT build failed (%s); running eagerly", failure)
                return
            self._loaded: dict = {}
            self._loading = threading.Thread(target=self._preload, daemon=True, name="quickdraft-aot-load")
            self._loading.start()
        if wait:
            self._loading.join()
        if self._loading.is_alive():
            return
        if not wait and (self.running or self.prefilling):  # never between two steps of a request
            if self._ready_at is None:
                self._ready_at = time.perf_counter()
            self._draining = time.perf_counter() - self._ready_at >= AOT_SWITCH_DRAIN_S
            return
        self._ready_at, self._draining = None, False
        self._pending_build, self._loading = None, None
        loaded, self._loaded = self._loaded, {}
        if isinstance(loaded, BaseException):
            log.warning("quickdraft: loading the AOT steps built in the background failed (%s: %s); running eagerly",
                        type(loaded).__name__, loaded)
            return
        self.aot_missing = self._use_packages(lambda model, **kw: loaded.get((id(model), tuple(sorted(kw.items())))))
        if hasattr(self.policy, "set_key"):  # other steps, other costs (cached, or calibrated anew)
            self.policy.set_key(self.cost_key())
        if self.proposer is not None and self.k > 0:
            self.proposer.set_cost_key(self.cost_key())
        if self.aot_missing:
            log.warning("quickdraft: the background AOT build ended but no package loaded for %s; running those "
                        "eagerly", " and ".join(self.aot_missing))
        else:
            log.info("quickdraft: switched to the AOT steps built in the background (%.0f s after the build started)",
                     time.perf_counter() - build.started)

    def _preload(self) -> None:
        """The packages _use_packages(aot.load) would take, loaded without switching to any (a
        proposer keeps its model where `make` gives None), into self._loaded by (model, kwargs)."""
        from . import aot

        loaded = self._loaded

        def load(model, **kw):
            loaded[(id(model), tuple(sorted(kw.items())))] = aot.load(model, **kw)
            return None

        try:
            with torch.inference_mode():
                self._use_packages(load)  # switches nothing: every `make` gives None
        except Exception as exc:  # noqa: BLE001 - reported (once) by the step that would switch
            self._loaded = exc

    def warm_up(self) -> None:
        """Compile the decode and verify steps for the query lengths this engine uses (1 and
        2..k+1, or 1 + the tree's nodes), and the proposer's; a no-op without compile."""
        from .compile import warm_up

        room = self._draft_room
        trees = (room + 1,) if self.k and self.proposer.may_draft_trees(self.k) else ()
        warm_up(self._forward, self.target, (1, 2, self.k + 1, room + 1) if self.k else (1,), tree_lengths=trees)
        if self.proposer is not None and self.k:
            self.proposer.warm_up(self.k)

    # ---- requests -------------------------------------------------------------------

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """llguidance's view of the model's vocabulary for constraints (built on the first call, then
        shared; the server builds it while loading)."""
        return self._grammar.get()

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      num_speculative_tokens: int | None = None) -> list[int]:
        """Validate a request without touching engine state (safe from any thread);
        returns the prompt as a list. Raises QuickdraftError with a message for the user."""
        prompt = list(prompt_token_ids)
        vocab = self.target.config.vocab_size
        if not prompt:
            raise QuickdraftError("prompt is empty", field="prompt")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
            raise QuickdraftError(f"prompt token ids must be integers in [0, {vocab})", field="prompt")
        if len(prompt) + params.max_tokens > self.max_model_len:  # the prompt's fault if no max_tokens fits
            raise ContextLengthError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(prompt) + params.max_tokens} exceeds {self.context_text()}",
                field="prompt" if len(prompt) >= self.max_model_len else "max_tokens")
        if params.prompt_logprobs is not None and getattr(self.target, "split_head", False):
            raise QuickdraftError("prompt_logprobs need the whole lm_head on rank 0; this tensor-parallel target splits "
                                  "it by vocabulary (tensor_parallel_options lm_head='vocab'): use lm_head='rank0'",
                                  field="prompt_logprobs")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise QuickdraftError(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}",
                                  field="logit_bias")
        if params.constraint is not None:  # the vocabulary (once, about a second), then the constraint's compile
            # (on a worker thread, time-limited): here, so a failure is this request's, before the step loop sees it
            params.constraint.compiled(self._grammar.get(), self.config.constraint_compile_timeout)
        if params.stop and self.tokenizer is None:
            raise QuickdraftError("stop strings need a tokenizer; this model folder has none", field="stop")
        if num_speculative_tokens is not None and (
                isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int)
                or not 0 <= num_speculative_tokens <= self.k):
            raise QuickdraftError(f"num_speculative_tokens must be an integer in [0, {self.k}] "
                                  f"(the engine's k), got {num_speculative_tokens!r}", field="num_speculative_tokens")
        return prompt

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, num_speculative_tokens: int | None = None) -> str:
        """Queue a request; `num_speculative_tokens` caps its own speculation (0 = none)."""
        prompt = self.check_request(prompt_token_ids, params, num_speculative_tokens)
        request = _Request(request_id or uuid.uuid4().hex, prompt, params, self.device, self.tokenizer,
                           num_speculative_tokens, None if params.constraint is None else self._grammar.get())
        self.waiting.append(request)
        return request.id

    def generate(self, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        """Add the requests, step until they finish, and return their final outputs in order.
        On an error (or interrupt) they are aborted, so the engine stays usable."""
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for prompt, params in requests:
                ids.append(self.add_request(prompt, params))
            while self.has_unfinished():
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.abort_request(rid)
            raise
        return [final[i] for i in ids]

    def abort_request(self, request_id: str) -> None:
        for r in list(self.waiting):
            if r.id == request_id:
                self.waiting.remove(r)
        for r in self.running + self.prefilling:
            if r.id == request_id and not r.finished:
                r.finish_reason = "abort"
        self._release_finished()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.prefilling)  # admitted but no token yet: still waiting for a user

    # ---- the step ----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests that fit; then run one speculative step for the running batch
        with a chunk of the admitted prompts in the same forward (a mixed step: the budget
        max_num_batched_tokens counts both), or, where steps cannot mix (mixes_prefill) or the
        running rows leave the chunk under half the budget, prefill up to max_num_batched_tokens
        prompt tokens or run the speculative step alone, the two alternating while both have
        work: running streams keep flowing while a long prompt is computed. Returns an output
        (with deltas) per request touched."""
        if self._pending_build is not None:  # between steps: the only place the forwards may change
            self._switch_if_built()
        admitted = self._admit()
        if admitted:
            self._stepping = self.prefilling + admitted
            self._start_prefill(admitted)
            self._stepping = []
        mix = bool(self.running and self.prefilling) and self.mixes_prefill() and not self._mix_declined
        if self.prefilling and not (self.running and (self._prefilled_last or mix)):
            self._stepping = list(self.prefilling)
            touched = self._prefill()
            self._prefilled_last, self._mix_declined = True, False
        elif mix:
            self._stepping = list(self.prefilling)  # a failure is blamed on them (recover_failed_step)
            self._mixing = _Mixing()
            try:
                touched = self._decode()
                done = self._mixing.done
                mixed = done is not None
                if mixed:
                    touched += self._finish_prefill(done.requests, done.chunks, done.starts, done.logits,
                                                    done.hidden_rows)
            finally:
                self._mixing = None
            self._prefilled_last, self._mix_declined = mixed, not mixed
        else:
            touched = self._decode() if self.running else []
            self._prefilled_last = False
        self._stepping = []
        outputs = [r.snapshot() for r in touched]
        if any(r.finished for r in self.running + self.prefilling):
            self._release_finished()
        return outputs

    def _token_budget(self, idle: bool = False) -> int | None:
        """Tokens this step may compute (max_num_batched_tokens; "auto": on a CPU AUTO_BATCHED_TOKENS'
        first while requests are decoding, its second when none is or `idle`; AUTO_BATCHED_TOKENS_GPU
        elsewhere)."""
        budget = self.config.max_num_batched_tokens
        if budget != "auto":
            return budget
        if self.target.device.type != "cpu":
            return AUTO_BATCHED_TOKENS_GPU
        return AUTO_BATCHED_TOKENS[0 if self.running and not idle else 1]

    def _weighs_positions(self) -> bool:
        """Whether the step's budget weighs prompt tokens by their position ("auto" on a CPU while
        requests decode: AUTO_ATTENTION_COST; a number given is a plain count of tokens)."""
        return (self.config.max_num_batched_tokens == "auto" and self.target.device.type == "cpu"
                and bool(self.running))

    def runs_eagerly(self) -> bool:
        """Whether the target's steps are its eager forward (not a compiled or AOT step)."""
        return self._forward is self.target

    def mixes_prefill(self) -> bool:
        """Whether a prefill chunk rides in the running batch's step now (else the two alternate)."""
        return self._packs and (self.runs_eagerly() or self._packed_step() is not None)

    def _packed_step(self):
        """The AOT step whose packed package computes every prompt chunk (alone or in a mixed step)
        and the running rows of a mixed step, or None (chunks run on the eager model)."""
        step = self._forward
        return step if self._packs and getattr(step, "packed_runner", None) is not None else None

    def _prefill_forward(self, chunks: list[list[int]], starts: list[int], view, hidden_at):
        """A prefill forward over `chunks` (row i from position starts[i], on the rows of `view`):
        the logits after each chunk (P, V) and, with `hidden_at`, each chunk's states (T_i, ...);
        on the packed AOT package where one runs the chunks (its states: the proposer's layers),
        else the eager model."""
        packed = self._packed_step()
        if packed is not None and hidden_at == self._hidden_layers:
            ids, positions, last, kv_len = pad_chunks(chunks, starts, self.device)
            _, (logits, hidden) = packed.packed(None, (ids, positions, last, view, kv_len))
            logits = logits[:, 0]
        elif hidden_at is not None:
            logits, hidden = forward_chunks(self.target, chunks, starts, view, hidden_at=hidden_at)
        else:
            logits, hidden = forward_chunks(self.target, chunks, starts, view), None
        return logits, None if hidden is None else [hidden[i, :len(c)] for i, c in enumerate(chunks)]

    def _capacity_needed(self, r: _Request) -> int:
        return len(r.prompt) + r.params.max_tokens + self._draft_room + 1  # + room for drafts past the end

    def _admit(self) -> list[_Request]:
        """Take waiting requests, in order, while the batch has a row for the next one, the
        caches can hold it (within the KV budget) and the next prefill's token budget reaches it
        (the prompts already admitted leave some); the caches then grow to hold them. A request
        that does not fit yet waits (the budget frees up as running requests finish)."""
        if not self.waiting or self._draining:  # (draining: the AOT switch waits for no request in flight)
            return []
        if self._admit_singly and self.prefilling:  # after a failed prefill: one request per prefill step
            return []
        admitted: list[_Request] = []
        # the prefilling rows follow the running ones: both hold rows and positions
        rows = len(self.running) + len(self.prefilling)
        capacity = max((self._capacity_needed(r) for r in self.running + self.prefilling), default=0)
        # no more prompts than the next prefill can start on: a request whose first chunk would not
        # run this step waits without holding a row (nor KV, nor a place in every row move)
        budget = self._prefill_cap(self._token_budget())
        pending = sum(len(r.prompt) - r.num_computed for r in self.prefilling)
        while self.waiting and rows < self.config.max_num_seqs and (budget is None or pending < budget):
            need = max(capacity, self._capacity_needed(self.waiting[0]))
            if not self._fits(rows + 1, need):
                break
            admitted.append(self.waiting.popleft())
            rows, capacity, pending = rows + 1, need, pending + len(admitted[-1].prompt)
            if self._admit_singly:
                self._admit_singly -= 1
                break
        if admitted:
            self._size_cache(rows, capacity)
        return admitted

    def recover_failed_step(self) -> tuple[list[_Request], bool]:
        """After step() raised: if it was prefilling, take those requests out of the batch,
        reset, and return them with True; else return the running batch with False (whose
        rows the caller should abort: which one broke the step cannot be told)."""
        admitted, self._stepping = self._stepping, []
        self._mix_declined = True  # a mixed step may have failed: the retry prefills alone
        if not admitted:
            return list(self.running), False
        ids = {r.id for r in admitted}
        # every request prefilling when the step failed (they sit in the last rows, so none moves)
        self.running = [r for r in self.running if r.id not in ids]
        self.prefilling = [r for r in self.prefilling if r.id not in ids]
        self._batch_sampling = None
        for r in admitted:  # back to the state add_request left it in
            r.start_over(self.device, self.tokenizer)
        return admitted, True

    def retry_singly(self, requests: list[_Request]) -> None:
        """Put requests taken out by recover_failed_step back at the head of the queue, to be
        admitted one per step, so that the one that fails again fails alone."""
        self.waiting.extendleft(reversed(requests))
        self._admit_singly = len(requests)

    def _full_capacity(self) -> int:
        return self.max_model_len + self._draft_room + 1

    def _fixed_rows(self) -> int:
        """Rows of max_model_len the caches allocated once hold: what the budget affords, up to max_num_seqs."""
        afford = self.budget.free_for("rows") // row_bytes(self.budget.token_bytes, self._full_capacity())
        return max(1, min(self.config.max_num_seqs, afford))

    def _fits(self, rows: int, capacity: int) -> bool:
        """Whether caches of `rows` x `capacity` positions fit (the budget, or the fixed caches)."""
        if self.fixed_size:
            return rows <= (self.cache.max_slots if self.cache is not None else self._fixed_rows())
        return self.budget.make_room("rows", rows * row_bytes(self.budget.token_bytes, capacity))

    def _size_cache(self, rows: int, capacity: int) -> None:
        """Make the caches hold `rows` rows of `capacity` positions, keeping the running and
        prefilling rows' entries exactly. Growth is geometric (rows and positions to the next power of two, at
        least doubling) so that it copies rarely; where that exceeds the budget, the least that
        fits (_fits checked that rows x capacity does)."""
        c = self.cache
        if c is not None and c.max_slots >= rows and c.capacity >= capacity:
            return
        if self.fixed_size:
            shape = (self._fixed_rows(), self._full_capacity())
        else:
            r0, c0 = (0, 0) if c is None else (c.max_slots, c.capacity)
            grown_rows = r0 if rows <= r0 else min(self.config.max_num_seqs, max(_pow2(rows), 2 * r0))
            grown_cap = c0 if capacity <= c0 else min(self._full_capacity(), max(_pow2(capacity), 2 * c0))
            free = self.budget.free_for("rows")
            token_bytes = self.budget.token_bytes
            shape = next(((r, p) for r, p in ((grown_rows, grown_cap), (max(r0, rows), max(c0, capacity)),
                                               (rows, max(c0, capacity)), (max(r0, rows), capacity))
                          if r * row_bytes(token_bytes, p) <= free), (rows, capacity))
        keep = len(self.running) + len(self.prefilling)  # the prefilling rows' computed positions too
        # the address space of as many rows as the budget could ever hold at this capacity (KVCache):
        # at a new capacity too, so that the rows admitted next are views of it, not another copy
        # of every cached position under the running rows (before, the reservation kept its bytes
        # and shrank with each growth in capacity: after one from 64 to 1,024 positions, the step
        # admitting a fifth request beside four streams took 78.2 ms against 29.0 ms now, a steady
        # step 15 ms; benchmarks/results/kv_growth_capacity_zen3_cpu.md)
        afford = self.budget.free_for("rows") // row_bytes(self.budget.token_bytes, shape[1])
        reserve = min(self.config.max_num_seqs, afford)
        if self.proposer is not None and (c is None or shape[1] != c.capacity):
            self.proposer.reserve_rows(reserve)  # (the budget's token bytes count the proposer's caches too)
        if c is None:
            self.cache = KVCache.for_model(self.target, *shape, reserve_rows=reserve)
        else:  # (only the positions the kept rows have cached are copied)
            length = max([len(r.tokens) - 1 for r in self.running] + [r.num_computed for r in self.prefilling] + [0])
            c.resize(*shape, keep, length, reserve_rows=reserve if shape[1] != c.capacity else None)
        if self.proposer is not None:
            self.proposer.resize(*shape, keep)
        self.budget.claim("rows", shape[0] * row_bytes(self.budget.token_bytes, shape[1]))
        log.debug("quickdraft: KV caches now %d rows x %d positions (%s)", shape[0], shape[1],
                  format_bytes(self.kv_cache_bytes()))

    def _start_prefill(self, requests: list[_Request]) -> None:
        """The admitted requests take the rows after the prefilling ones; a prompt's longest cached
        prefix (prefix caching) is copied into its row, with the proposer's state of it."""
        for r in requests:
            row = len(self.running) + len(self.prefilling)
            self.prefilling.append(r)
            r.started = time.perf_counter()
            r.num_computed = r.num_cached = 0
            if self.policy is not None:
                r.spec_state = self.policy.new_state()
            if self.proposer is not None:
                self.proposer.start(row, r.prompt)
            if r.params.prompt_logprobs is not None:
                r.prompt_logprobs = [None]
            elif self.prefix_cache is not None:  # (prompt logprobs need every position's states: no lookup)
                self._load_prefix(r, row)

    def _load_prefix(self, r: _Request, row: int) -> None:
        pc, proposer = self.prefix_cache, self.proposer
        kind = "none" if proposer is None else proposer.prefix_state
        blocks = pc.match(r.prompt, need_extra=kind == "required")
        r.num_computed, with_state = pc.load(blocks, self.cache, row, None if kind == "none" else proposer.state_cache())
        r.num_cached = r.num_computed
        if with_state:
            proposer.loaded_state(row, with_state)
        if r.num_cached and self.config.prefix_cache_check:  # debug: recompute the prefix and compare
            bad = pc.check(self.target, self.cache, row, r.prompt, r.num_cached,
                           self._prefill_cap(self._token_budget(idle=True)), self._check_exact,
                           lambda part, start, view: self._prefill_forward([part], [start], view, None))
            if bad is not None and self.config.prefix_cache_check == "raise":
                raise PrefixCacheMismatch(f"request {r.id}: {bad}")

    def _store_prefix(self, r: _Request, row: int, length: int) -> None:
        """Keep positions [0, length) of `row` (committed tokens of r) in the prefix cache."""
        proposer = self.proposer
        if proposer is None or proposer.prefix_state == "none":
            self.prefix_cache.store(r.tokens, length, self.cache, row)
        else:
            self.prefix_cache.store(r.tokens, length, self.cache, row, proposer.state_cache(), proposer.state_length(row))

    def _prefill(self) -> list[_Request]:
        """Compute up to max_num_batched_tokens prompt tokens of the prefilling requests, in row
        order, each from its first position without KV (after a cached prefix or an earlier
        chunk); the requests whose prompt is complete sample their first token and join the
        running batch. A row's bits do not depend on how its prompt is cut (row-invariant
        kernels), so chunks and cache hits give the tokens a whole prefill gives."""
        requests, chunks, starts = self._plan_prefill(self._token_budget())
        start = len(self.running)
        view = self.cache.rows(start, start + len(requests))
        logits, hidden_rows = self._prefill_forward(chunks, starts, view, self._prefill_hidden_at(requests))
        return self._finish_prefill(requests, chunks, starts, logits, hidden_rows)

    def _prefill_cap(self, budget: int | None) -> int | None:
        """The budget, within the most tokens the packed AOT package takes in one call where it runs the chunks."""
        if self._packed_step() is None:
            return budget
        from .aot import MAX_CHUNK_TOKENS

        return MAX_CHUNK_TOKENS if budget is None else min(budget, MAX_CHUNK_TOKENS)

    def _plan_prefill(self, budget: int | None) -> tuple[list[_Request], list[list[int]], list[int]]:
        """The prefilling requests a step computes prompt tokens of, in row order, their chunks
        (at most `budget` tokens in all; None: whole prompts) and where each chunk starts. Where the
        packed AOT package runs the chunks, the requests that want prompt logprobs (whose states it
        does not return: the eager model's) are never in one step with those that do not, so that
        a prompt's bits never depend on the requests beside it."""
        requests, chunks = [], []
        budget = self._prefill_cap(budget)
        eager = (self.prefilling[0].params.prompt_logprobs is not None
                 if self.prefilling and self._packed_step() is not None else None)
        weigh = self._weighs_positions()
        for r in self.prefilling:
            if eager is not None and (r.params.prompt_logprobs is not None) != eager:
                break
            n = len(r.prompt) - r.num_computed
            if budget is not None:
                if budget <= 0:
                    break
                if weigh:  # "auto" while requests decode: a token at position p counts 1 + p / P
                    n, cost = _weighted_chunk(r.num_computed, n, budget, self._attention_position)
                    budget -= cost
                else:
                    n = min(n, budget)
                    budget -= n
            requests.append(r)
            chunks.append(r.prompt[r.num_computed:r.num_computed + n])
        return requests, chunks, [r.num_computed for r in requests]

    def _prefill_hidden_at(self, requests: list[_Request]) -> tuple[int, ...] | None:
        """The target layers whose states a prefill returns: the proposer's, and the final ones
        (the layer count's index) when a request wants prompt logprobs."""
        hidden_at = self._hidden_layers
        if any(r.params.prompt_logprobs is not None for r in requests):
            hidden_at = (hidden_at or ()) + (self.target.config.num_hidden_layers,)
        return hidden_at

    def _finish_prefill(self, requests: list[_Request], chunks: list[list[int]], starts: list[int],
                        logits: torch.Tensor, hidden_rows: list[torch.Tensor] | None) -> list[_Request]:
        """After a forward over the chunks (rows from len(self.running) on): the proposer's states and
        prompt logprobs from the states (T_i, ...) of each chunk, and the requests whose prompt is
        complete sample their first token from logits (P, V) and join the running batch."""
        start = len(self.running)
        if hidden_rows is not None:
            H = self.target.config.hidden_size
            if self._hidden_layers is not None:
                width = len(self._hidden_layers) * H
                for i, h in enumerate(hidden_rows):
                    self.proposer.add_hidden(start + i, h[None, :, :width], [list(range(h.shape[0]))])
            for i, r in enumerate(requests):
                if r.params.prompt_logprobs is not None:
                    self._prompt_logprobs(r, hidden_rows[i][:, -H:], starts[i])
        for r, c in zip(requests, chunks):
            r.num_computed += len(c)
        done = [r for r in requests if r.num_computed == len(r.prompt)]  # the first rows (the budget went in order)
        if self.prefix_cache is not None:  # the prompts' KV, for requests that arrive while these run: a long
            bs = self.prefix_cache.block_size  # prompt's blocks as its chunks complete them, a few a step
            for i, (r, c) in enumerate(zip(requests, chunks)):
                if r.num_computed == len(r.prompt) or r.num_computed // bs > (r.num_computed - len(c)) // bs:
                    self._store_prefix(r, start + i, r.num_computed)
        if done:
            self._first_tokens(done, logits[:len(done)])
            self.running.extend(done)
            del self.prefilling[:len(done)]
            self._batch_sampling = None
        return done

    def _first_tokens(self, requests: list[_Request], logits: torch.Tensor) -> None:
        """Sample each request's first token from the logits after its prompt (B, V)."""
        raw = logits
        params = [r.params for r in requests]
        sampling = BatchSampling.build(params, self.device)
        penalties = PenaltyState.build(params, [r.prompt for r in requests], self.target.config.vocab_size, self.device)
        if penalties is not None:
            logits = penalties.apply(logits, [r.output for r in requests])
        logits = self._constrain(requests, logits[:, None], None, None)[:, 0]
        probs = process_logits(logits, sampling)
        if sampling.all_greedy:
            tokens = probs.argmax(-1)
        else:
            rnd = StepRandom([r.key for r in requests], [len(r.tokens) for r in requests], self.device)
            tokens = draw(probs, rnd.draws(Stream.SAMPLE)[:, 0])
        lps = self._logprobs(requests, raw[:, None], tokens[:, None])
        for i, (r, t) in enumerate(zip(requests, tokens.tolist())):
            self._append(r, [t], None if lps is None else lps[i], origins=(PREFILL,))

    def _logprobs(self, rows: list[_Request], logits: torch.Tensor, tokens: torch.Tensor) -> list | None:
        """For the rows asking for logprobs: token_logprobs of `tokens` (B, T) under the raw
        logits (B, T, V), read back (a second host sync, only when some row asks); else None."""
        want = [b for b, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return None
        top = max(rows[b].params.logprobs for b in want)
        if len(want) < len(rows):
            idx = to_device(want, logits.device)
            logits, tokens = logits.index_select(0, idx), tokens.index_select(0, idx)
        out: list = [None] * len(rows)
        for b, packed in zip(want, token_logprobs(logits, tokens, top).tolist()):
            out[b] = packed
        return out

    def _prompt_logprobs(self, r: _Request, hidden: torch.Tensor, first: int, chunk: int = 256) -> None:
        """Extend r.prompt_logprobs from the prefill's final hidden states (T, H) (before the final
        norm) of prompt positions first .. first + T - 1 (position p scores token p + 1): the
        lm_head runs over `chunk` positions at a time, so a long prompt never holds its whole
        (T, V) logits."""
        top = r.params.prompt_logprobs
        n = min(hidden.shape[0], len(r.prompt) - 1 - first)  # the prompt's last position scores no prompt token
        targets = r.prompt[first + 1:first + 1 + n]
        ids = to_device(targets, hidden.device)
        packed: list[list[float]] = []
        for s in range(0, n, chunk):
            logits = self.target.lm_head(self.target.model.norm(hidden[s:min(s + chunk, n)]))
            packed += token_logprobs(logits[None], ids[None, s:s + chunk], top)[0].tolist()
        r.prompt_logprobs += [_token_logprob(p, t, top) for p, t in zip(packed, targets)]

    def _decode(self) -> list[_Request]:
        started = time.perf_counter()
        rows = self.running
        if self._batch_sampling is None:
            self._batch_sampling = BatchSampling.build([r.params for r in rows], self.device)
            self._batch_penalties = PenaltyState.build([r.params for r in rows], [r.prompt for r in rows],
                                                       self.target.config.vocab_size, self.device)
        sampling = self._batch_sampling
        lengths = [len(r.tokens) for r in rows]
        # each row's draws keyed by its own request and position: the batch cannot change them
        rnd = StepRandom([r.key for r in rows], lengths, self.device)
        # No row can use more than remaining - 1 drafts (the step adds one token of its own).
        k_bound = min(self.k, max(r.remaining for r in rows) - 1)
        ks = self.policy.choose([r.spec_state for r in rows], k_bound) if k_bound > 0 else [0] * len(rows)
        # each row's own bounds, so that how far a row drafts does not depend on the others
        ks = [max(0, min(k, r.remaining - 1, self.k if r.max_k is None else r.max_k)) for r, k in zip(rows, ks)]
        k = max(ks)
        last = to_device([r.tokens[-1] for r in rows], self.device)[:, None]
        draft = None
        if k > 0:
            penalties = self._batch_penalties
            draft = self.proposer.propose(ProposeBatch([r.tokens for r in rows], k, sampling, rnd, penalties,
                                                       None if penalties is None else [r.output for r in rows], ks))
            if min(ks) < k:
                draft = _limit_depth(draft, ks)
            if draft.tokens.shape[1] == 0:  # nothing proposed for any row
                draft = None
        forced = self._forced(rows, ks) if k > 0 else None
        if forced is not None:
            draft = _force(draft, forced, self.device)
        if draft is None or draft.parents is None:
            result = self._verify_chain(draft, last, lengths, sampling, rnd)
        else:
            result = self._verify_tree(draft, last, lengths, sampling, rnd)
            for r, n in zip(rows, lengths):  # the root (the last committed token, position n - 1) was a chain query
                r.kv_exact = n if r.kv_exact is None else r.kv_exact
        if result.hidden is not None:  # every committed token but the new last one now has its state
            nodes = result.accepted_nodes
            self.proposer.add_hidden(0, result.hidden, [list(range(n + 1)) if nodes is None else [0] + [1 + i for i in nodes[b]]
                                                        for b, n in enumerate(result.num_accepted)])
        if draft is not None:
            # rows that verified forced tokens instead of the proposer's: the proposer hears that none
            # of its drafts were kept, so that it catches up on the committed tokens (its own cache
            # holds its drafts, not the forced ones)
            mine = [not (forced and forced[b]) for b in range(len(rows))]
            nodes = result.accepted_nodes
            self.proposer.observe(VerifyResult([n if m else 0 for n, m in zip(result.num_accepted, mine)], lengths, k,
                                               None if nodes is None else [a if m else [] for a, m in zip(nodes, mine)],
                                               result.target_tokens, draft=draft))
        for b, (r, toks, n, d) in enumerate(zip(rows, result.tokens, result.num_accepted, result.num_drafted)):
            per_pos = None if result.accepted_nodes is None else [1] * n + [0] * (k - n)
            r.stats.observe(d, n, per_pos)
            self.stats.observe(d, n, per_pos)
            if forced and forced[b]:
                r.stats.num_forced_tokens += n
                self.stats.num_forced_tokens += n
            elif self.policy is not None:  # the policy learns the proposer's acceptance, not the grammar's
                self.policy.observe(r.spec_state, d, n)
            kind = FORCED if forced and forced[b] else DRAFT
            self._append(r, toks[: n + 1], None if result.logprobs is None else result.logprobs[b],
                         origins=(kind,) * n + (TARGET,))
        if self.policy is not None and (self._mixing is None or self._mixing.done is None):
            self.policy.observe_step(len(rows), k, time.perf_counter() - started)  # (a mixed step is no decode step's cost)
        return list(rows)

    def _verify_forward(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The verify forward: (logits, None), or with the proposer's hidden_layers (logits,
        states): from the AOT package that returns them, else the eager model (torch.compile'd
        steps return logits only). In a mixed step, with a prefill chunk (_mixed_forward)."""
        if self._mixing is not None:
            mixed = self._mixed_forward(*args, **kwargs)
            if mixed is not None:
                return mixed
        if self._hidden_layers is None:
            return self._forward(*args, **kwargs), None
        forward = self.target if self.config.compile is True else self._forward  # an AOT step or the model
        return forward.forward_hidden(*args, **kwargs, hidden_at=self._hidden_layers)

    def _mixed_forward(self, tokens: torch.Tensor, positions: torch.Tensor, view, *, kv_len: int, slots=None,
                       attn_mask=None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The verify forward (same arguments and results) of a mixed step: with the prefill chunk
        the token budget has room for, in one forward (Transformer.forward_packed: the weights are read
        once for both, and each row keeps the bits its own forward gives it). The budget
        (max_num_batched_tokens) counts the verify positions (rows x (1 + drafts)) and the chunk's;
        when it leaves less than half of itself for the chunk (what a step of the alternation
        prefilled on average), None: the step verifies alone and the next one prefills."""
        B, T = tokens.shape
        budget = self._token_budget()
        left = None if budget is None else budget - B * T
        if left is not None and 2 * left < budget:
            return None
        requests, chunks, starts = self._plan_prefill(left)
        first = len(self.running)
        hidden_at = self._prefill_hidden_at(requests)
        packed = self._packed_step()
        if packed is not None:  # the packed package: chains only, and the states it returns
            if slots is not None or attn_mask is not None or hidden_at != self._hidden_layers:
                return None
            ids, pos, last, chunk_len = pad_chunks(chunks, starts, self.device)
            (logits, hidden), (chunk_logits, states) = packed.packed(
                (tokens, positions, view, kv_len), (ids, pos, last, self.cache.rows(first, first + len(requests)),
                                                     chunk_len))
            self._mixing.done = _Chunks(requests, chunks, starts, chunk_logits[:, 0],
                                        None if states is None else [states[i, :len(c)] for i, c in enumerate(chunks)])
            return logits, hidden
        blocks = [Block(tokens, positions, 0, kv_len, slots, attn_mask)]
        for i, (c, s0) in enumerate(zip(chunks, starts)):
            ids = to_device([c], self.device)
            blocks.append(Block(ids, to_device([list(range(s0, s0 + len(c)))], self.device), first + i,
                                s0 + len(c), logits_at=to_device([[len(c) - 1]], self.device)))
        out = self.target.forward_packed(blocks, self.cache.rows(0, first + len(requests)), hidden_at)
        (logits, hidden), rest = out[0], out[1:]
        if self._hidden_layers is None:
            hidden = None  # (states taken for prompt logprobs only)
        elif hidden is not None:
            hidden = hidden[..., :len(self._hidden_layers) * self.target.config.hidden_size]
        self._mixing.done = _Chunks(requests, chunks, starts, torch.cat([lg[:, 0] for lg, _ in rest]),
                                    None if hidden_at is None else [h[0] for _, h in rest])
        return logits, hidden

    def _verify_chain(self, draft, last, lengths, sampling, rnd: StepRandom) -> StepOutcome:
        """Target forward over [last, d_1..d_k] at positions L-1..L-1+k, then verify."""
        B = len(lengths)
        draft_tokens = last[:, :0] if draft is None else draft.tokens
        k = draft_tokens.shape[1]
        if k:
            positions = to_device(lengths, self.device)[:, None] - 1 + torch.arange(k + 1, device=self.device)
            tokens = torch.cat([last, draft_tokens.clamp(min=0)], 1)
        else:  # plain decoding: one token per row
            positions, tokens = to_device([[n - 1] for n in lengths], self.device), last
        logits, hidden = self._verify_forward(tokens, positions, self.cache.rows(0, B),
                                              kv_len=max(lengths) + k)  # (B, k+1, V)
        raw = logits
        if self._batch_penalties is not None:  # position i also follows d_1..d_i
            drafts = draft_context(draft_tokens, chain_ancestors(draft_tokens)) if k else None
            logits = self._batch_penalties.apply(logits, [r.output for r in self.running], drafts)
        logits = self._constrain(self.running, logits, draft_tokens if k else None, None)
        argmax = logits.argmax(-1) if sampling.all_greedy or self._wants_target_tokens else None
        if sampling.all_greedy:
            return self._greedy_chain(draft_tokens, argmax, raw, hidden)
        p = process_logits(logits, sampling)
        out, num_accepted = rejection_sample(draft_tokens, p, None if draft is None else draft.probs,
                                             rnd.uniform(Stream.ACCEPT, k), rnd.draws(Stream.FINAL)[:, 0])
        drafted = (draft_tokens >= 0).sum(1)
        lps = self._logprobs(self.running, raw, out)  # emitted token j came from position j
        host = _read_back(tokens=out, num_accepted=num_accepted[:, None], num_drafted=drafted[:, None],
                          target_tokens=argmax if self._wants_target_tokens else None)
        return StepOutcome(tokens=host["tokens"], num_accepted=[n for n, in host["num_accepted"]],
                           num_drafted=[d for d, in host["num_drafted"]], accepted_nodes=None,
                           target_tokens=host["target_tokens"], hidden=hidden, logprobs=lps)

    def _greedy_chain(self, draft_tokens: torch.Tensor, argmax: torch.Tensor, raw: torch.Tensor,
                      hidden: torch.Tensor | None) -> StepOutcome:
        """Temperature 0 for every row: the greedy decision made on the host (greedy_verify_host) from one read
        of the argmax and the drafts (a few integers per row), instead of a dozen tiny device
        ops and then the read (~100 us a step on a 2 GHz core)."""
        k = draft_tokens.shape[1]
        both = (torch.cat([argmax, draft_tokens], 1) if k else argmax).tolist()
        target, drafts = [row[:k + 1] for row in both], [row[k + 1:] for row in both]
        tokens, num_accepted = greedy_verify_host(drafts, target)
        num_drafted = [sum(1 for d in row if d >= 0) for row in drafts]
        lps = None
        if any(r.params.logprobs is not None for r in self.running):
            out = torch.tensor([t + [-1] * (k + 1 - len(t)) for t in tokens], device=argmax.device)
            lps = self._logprobs(self.running, raw, out)  # emitted token j came from position j
        return StepOutcome(tokens=tokens, num_accepted=num_accepted, num_drafted=num_drafted, accepted_nodes=None,
                           target_tokens=target if self._wants_target_tokens else None, hidden=hidden, logprobs=lps)

    def _verify_tree(self, draft, last, lengths, sampling, rnd: StepRandom) -> StepOutcome:
        """Target forward over [last, nodes...] with tree attention, verify, then move the
        accepted path's cache entries to their chain slots (quickdraft.tree has the layout)."""
        B, N = draft.tokens.shape
        device = self.device
        valid = draft.tokens >= 0
        anc, depth = tree_structure(draft.parents, valid)
        L = to_device(lengths, device)
        kv_len = max(lengths) + N
        nodes = torch.arange(N, device=device)
        positions = torch.cat([L[:, None] - 1, torch.where(valid, L[:, None] - 1 + depth, -1)], 1)  # (B, 1+N)
        slots = torch.cat([L[:, None] - 1, torch.where(valid, L[:, None] + nodes, -1)], 1)
        queries = torch.cat([nodes.new_full((B, 1), -1), nodes.expand(B, N)], 1)
        mask = tree_mask(L, queries, anc, kv_len)
        logits, hidden = self._verify_forward(torch.cat([last, draft.tokens.clamp(min=0)], 1), positions,
                                              self.cache.rows(0, B), kv_len=kv_len, slots=slots,
                                              attn_mask=mask)  # (B, 1+N, V)
        raw = logits
        if self._batch_penalties is not None:  # node n's position also follows its ancestors and itself
            logits = self._batch_penalties.apply(logits, [r.output for r in self.running],
                                                 draft_context(draft.tokens, anc))
        logits = self._constrain(self.running, logits, draft.tokens, draft.parents)
        argmax = logits.argmax(-1) if sampling.all_greedy or self._wants_target_tokens else None
        if sampling.all_greedy:
            out, num_accepted, path = tree_greedy_verify(draft.tokens, draft.parents, argmax, (anc, depth))
        else:
            p = process_logits(logits, sampling)
            out, num_accepted, path = tree_rejection_sample(
                draft.tokens, draft.parents, p, draft.probs, rnd.uniform(Stream.ACCEPT, N),
                rnd.draws(Stream.FINAL)[:, 0], (anc, depth))
        D = path.shape[1]
        steps = torch.arange(D, device=device)
        host = _read_back(tokens=out, path=path, num_accepted=num_accepted[:, None], num_drafted=valid.sum(1)[:, None],
                          target_tokens=argmax if self._wants_target_tokens else None)
        # the accepted path's entries to their chain slots; where every accepted node already sits at
        # its chain slot (node j at depth j + 1: a draft's first branch, the common case), nothing moves
        if any(0 <= node != j for row in host["path"] for j, node in enumerate(row)):
            self.cache.compact(torch.where(path >= 0, L[:, None] + path, -1), L[:, None] + steps)
        lps = None
        if any(r.params.logprobs is not None for r in self.running):  # emitted token j came from the root or path[j-1]
            at = torch.cat([path.new_zeros(B, 1), (path + 1).clamp(min=0)], 1)  # (B, D + 1)
            lps = self._logprobs(self.running, raw.gather(1, at[..., None].expand(-1, -1, raw.shape[-1])), out)
        return StepOutcome(tokens=host["tokens"], num_accepted=[n for n, in host["num_accepted"]],
                           num_drafted=[d for d, in host["num_drafted"]],
                           accepted_nodes=[[i for i in row if i >= 0] for row in host["path"]],
                           target_tokens=host["target_tokens"], hidden=hidden, logprobs=lps)

    def _forced(self, rows: list[_Request], ks: list[int]) -> list[list[int]] | None:
        """Per row, the tokens its constraint forces next (up to the row's k: they are verified in
        the proposer's place, free to propose and accepted unless the target's tokenization
        differs), or None when no row has any."""
        if all(r.matcher is None for r in rows):
            return None
        forced = [r.matcher.forced()[:k] if r.matcher is not None and k > 0 else [] for r, k in zip(rows, ks)]
        return forced if any(forced) else None

    def _constrain(self, rows: list[_Request], logits: torch.Tensor, drafts: torch.Tensor | None,
                   parents: torch.Tensor | None) -> torch.Tensor:
        """logits (B, 1 + N, V) with what each constrained row's grammar forbids at each verify
        position set to -inf: position 0 follows the committed tokens, position 1 + n draft node
        n's path (constraints.batch_masks); unchanged when no row has a constraint."""
        matchers = [r.matcher for r in rows]
        if all(m is None for m in matchers):
            return logits
        nodes = None if drafts is None else drafts.tolist()
        allowed = batch_masks(self._grammar.get(), matchers, nodes, None if parents is None else parents.tolist())
        return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))

    def _append(self, r: _Request, tokens: list[int], logprobs: list[list[float]] | None = None, *,
                origins: tuple[str, ...]) -> None:
        """Commit emitted tokens (with their packed logprobs when asked, and each one's origin),
        cutting at eos, a stop string or max_tokens."""
        stops = r.params.stop
        for i, t in enumerate(tokens):
            if r.matcher is not None and not r.matcher.commit(t):  # a bug if ever: every token was masked
                log.error("quickdraft: request %s: token %d breaks its constraint; aborted", r.id, t)
                r.finish_reason = "abort"
                break
            r.tokens.append(t)
            r.output.append(t)
            r.origins.append(origins[i])
            if r.logprobs is not None and logprobs is not None:
                r.logprobs.append(_token_logprob(logprobs[i], t, r.params.logprobs))
            if r.detok is not None:
                before = len(r.text)
                r.text += r.detok.add(t)
                if stops and len(r.text) > before:
                    window = max(len(s) for s in stops)
                    from_ = max(0, before - window + 1)
                    hits = [i for i in (r.text.find(s, from_) for s in stops) if i >= 0]
                    if hits:
                        r.text = r.text[: min(hits)]
                        r.finish_reason = "stop"
                        break
            if t in self.eos_token_ids and not r.params.ignore_eos:
                r.finish_reason = "stop"
                break
            if r.remaining <= 0:
                r.finish_reason = "length"
                break
        if r.finished:
            r.stats.num_output_tokens = len(r.output)
            self.stats.num_output_tokens += len(r.output)
            r.stats.elapsed_s = time.perf_counter() - r.started

    @torch.inference_mode()
    def _release_finished(self) -> None:
        """Drop finished rows (keeping their KV in the prefix cache), moving the last running row
        into each freed one; the prefilling rows then move down after the running ones, in order."""
        changed = False
        first_prefilling = len(self.running)
        for i in reversed(range(len(self.running))):
            if not self.running[i].finished:
                continue
            changed = True
            last = len(self.running) - 1
            done = self.running[i]
            if self.prefix_cache is not None:  # every committed token but the last has its KV
                self._store_prefix(done, i, min(len(done.tokens) - 1, done.kv_exact or len(done.tokens)))
            if self.proposer is not None:
                self.proposer.finish(i, done.tokens, len(done.prompt))
            if i != last:
                moved = self.running[last]
                self.cache.move_row(last, i, len(moved.tokens) - 1)
                if self.proposer is not None:
                    self.proposer.move_row(last, i)
                self.running[i] = moved
            self.running.pop()
        if changed:
            self._batch_sampling = None
        kept = []
        for j, r in enumerate(self.prefilling):  # aborted while prefilling: leave; the others move down
            row = first_prefilling + j
            if r.finished:
                if self.prefix_cache is not None:  # its computed chunks (the target's KV), for a retry
                    self.prefix_cache.store(r.prompt, r.num_computed, self.cache, row)
                if self.proposer is not None:
                    self.proposer.finish(row, r.tokens, len(r.prompt))
                continue
            dst = len(self.running) + len(kept)
            if row != dst:
                self.cache.move_row(row, dst, r.num_computed)
                if self.proposer is not None:
                    self.proposer.move_row(row, dst)
            kept.append(r)
        self.prefilling = kept


@dataclass(frozen=True)
class _Chunks:
    """Prompt chunks a forward computed, for _finish_prefill."""
    requests: list[_Request]
    chunks: list[list[int]]  # each request's tokens computed
    starts: list[int]  # each chunk's first position
    logits: torch.Tensor  # (P, V) after each chunk's last token
    hidden_rows: list[torch.Tensor] | None  # per chunk (T_i, ...): the states _prefill_hidden_at asked for


@dataclass
class _Mixing:
    """A mixed step's prefill part: what _mixed_forward computed (None: the budget had no room
    for a chunk this step)."""
    done: _Chunks | None = None


def attention_position(cfg) -> float:
    """The prompt position P at which a token's attention (over P keys) costs what its linear
    layers do: their multiply-adds per token over AUTO_ATTENTION_COST x attention's per key."""
    d, H, H_kv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    linear = d * (H + 2 * H_kv) * D + H * D * d + 3 * d * cfg.intermediate_size
    return linear / (AUTO_ATTENTION_COST * 2 * H * D)


# Seconds the switch to AOT packages built in the background waits for a step boundary with no request in
# flight before the engine stops admitting new requests until those finish (Engine.switch_when_built)
AOT_SWITCH_DRAIN_S = 30.0


def _set_kv_cache_dtype(target: Transformer, name: str) -> None:
    """The target's KV cache element type (config.check_kv_cache_dtype's name; "auto": its dtype, or
    AUTO_QUANTISED_KV_CACHE_DTYPE for int8 / int4 layers on a CPU): the caches, the KV budget's bytes
    per token and the AOT packages' keys follow it."""
    tensor_parallel = getattr(target, "new_kv_cache", None) is not None  # (it allocates its own shards)
    if name == "auto":
        quantised = not tensor_parallel and target.device.type == "cpu" and quantised_layers(target)
        name = AUTO_QUANTISED_KV_CACHE_DTYPE if quantised else None
        if name is None:
            target.kv_cache_dtype = None
            return
    elif tensor_parallel:
        raise QuickdraftError("kv_cache_dtype is not available with tensor parallelism yet: leave it 'auto'",
                              field="kv_cache_dtype")
    dtype = getattr(torch, name)
    target.kv_cache_dtype = None if dtype == target.dtype else dtype


def _weighted_chunk(start: int, most: int, budget: float, position: float) -> tuple[int, float]:
    """The longest chunk of at most `most` tokens from position `start` whose cost, a token at
    position p counting 1 + p / `position`, is within `budget` (at least one token), and its cost."""
    n, cost = 0, 0.0
    while n < most:
        step = 1 + (start + n) / position
        if n and cost + step > budget:
            break
        n, cost = n + 1, cost + step
    return n, cost


def _pow2(n: int) -> int:
    """The least power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


def _force(draft: Draft | None, forced: list[list[int]], device: torch.device) -> Draft:
    """`draft` with each row that has forced tokens replaced by them, as a chain (in a tree: each
    node's parent the one before; a draft with q: one-hot q, the distribution they were "drawn"
    from, so rejection sampling stays exact). The other rows keep the proposer's draft."""
    if draft is None:
        return Draft.chain(forced, device)
    tokens, probs, parents = draft.tokens.clone(), draft.probs, draft.parents
    width = max(len(f) for f in forced)
    if width > tokens.shape[1]:  # a chain narrower than a forced run: room for it (k bounds both)
        pad = width - tokens.shape[1]
        tokens = torch.cat([tokens, tokens.new_full((tokens.shape[0], pad), -1)], 1)
        if probs is not None:
            probs = torch.cat([probs, probs.new_zeros(probs.shape[0], pad, probs.shape[2])], 1)
        if parents is not None:
            parents = torch.cat([parents, parents.new_full((parents.shape[0], pad), -1)], 1)
    probs = None if probs is None else probs.clone()
    parents = None if parents is None else parents.clone()
    for b, f in enumerate(forced):
        if not f:
            continue
        n = len(f)
        tokens[b] = -1
        tokens[b, :n] = torch.tensor(f, device=tokens.device)
        if parents is not None:
            parents[b] = -1
            parents[b, :n] = torch.arange(-1, n - 1, device=parents.device)
        if probs is not None:
            probs[b] = 0
            probs[b, torch.arange(n, device=probs.device), tokens[b, :n]] = 1
    return Draft(tokens, probs, parents)


def _limit_depth(draft: Draft, ks: list[int]) -> Draft:
    """Cut row b's draft to ks[b] tokens deep (the policy chose fewer for it)."""
    limit = to_device(ks, draft.tokens.device)[:, None]
    if draft.parents is None:
        cols = torch.arange(draft.tokens.shape[1], device=draft.tokens.device)
        depth = cols + 1
    else:
        depth = tree_structure(draft.parents, draft.tokens >= 0)[1]
    return Draft(torch.where(depth <= limit, draft.tokens, -1), draft.probs, draft.parents)
