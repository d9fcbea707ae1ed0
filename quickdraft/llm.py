"""The offline Python API: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from . import aot
from .config import (DEFAULT_CONSTRAINT_COMPILE_TIMEOUT, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS,
                     DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_POLICY, DEFAULT_SELF_DRAFT_NUM_SPECULATIVE_TOKENS,
                     DEFAULT_SELF_DRAFT_QUANTIZATION,
                     PREFIX_CACHE_CHECK_ENV, SELF_DRAFT, EngineConfig, SpecConfig, check_constraint_compile_timeout,
                     DEFAULT_KV_CACHE_DTYPE, check_kv_cache_dtype, check_kv_cache_memory, check_max_num_batched_tokens,
                     check_max_num_seqs, check_num_speculative_tokens, check_prefix_cache_bytes,
                     check_prefix_cache_check)
from .errors import QuickdraftError
from .engine import Engine, RequestOutput
from .metrics import SpecStats
from .model.loader import checkpoint_dir, load_model, resolve_device, resolve_dtype
from .model.quant import blocked_supported, prepare, quantized_copy
from .model.eagle3 import is_eagle3_head
from .model.sources import BUNDLED_TARGET, CATALOGUE, default_draft, resolve_model
from .model.tokenizer import Tokenizer, eos_token_ids
from .proposers import AUTO_FREE, method_name
from .proposers import get as get_proposer
from .sampling import SamplingParams

Prompt = str | list[int]
Message = Mapping[str, Any]  # {"role": "system" | "user" | "assistant", "content": str}
Conversation = Sequence[Message]

log = logging.getLogger("quickdraft")


def default_model_dirs() -> tuple[Path, Path]:
    """The bundled target and draft (shipped by the default-model work)."""
    root = Path(__file__).parent / "default_models"
    return root / "target", root / "draft"


def check_same_vocabulary(target, draft, target_tok: Tokenizer | None, draft_tok: Tokenizer | None) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise QuickdraftError(f"vocabulary mismatch: target has {tv} tokens, draft has {dv}; "
                              "a draft must share the target's tokenizer")
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise QuickdraftError("vocabulary mismatch: the target's and the draft's tokenizers differ")


def named_default_draft(target: str | Path) -> Path | None:
    """A named model's own draft, when quickdraft ships it; None otherwise (then a target
    given without draft or method decodes plainly, as any target without a draft does)."""
    if not isinstance(target, str) or target not in CATALOGUE:
        return None
    try:
        return default_draft(target)
    except QuickdraftError:  # the entry names a draft this installation does not bundle
        return None


class LLM:
    def __init__(self, target: str | Path | None = None, draft: str | Path | None = None,
                 method: str | None = None, num_speculative_tokens: int | None = None,
                 dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_model_len: int | None = None,
                 spec_options: Mapping[str, Any] | None = None, policy: str = DEFAULT_POLICY,
                 profile: str | Path | None = None, compile: bool | str | None = None,
                 quantization: str | None = None, draft_quantization: str | None = None,
                 preallocate: bool = False, draft_dtype: str | torch.dtype | None = None,
                 tensor_parallel_size: int = 1, tensor_parallel_options: Mapping[str, Any] | None = None,
                 kv_cache_memory: int | float | str | None = None, kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE,
                 enable_prefix_caching: bool = False, prefix_cache_bytes: int | None = None,
                 max_num_batched_tokens: int | str | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 prefix_cache_check: bool | str | None = None,
                 constraint_compile_timeout: float = DEFAULT_CONSTRAINT_COMPILE_TIMEOUT):
        """compile: True: torch.compile the decode / verify / draft steps; "aot": on CPU,
        ahead-of-time compiled steps (quickdraft.aot; built once per model shape, about a minute,
        then cached on disk) before the first token; False: eager. None (default): CUDA graphs on
        CUDA/ROCm; on CPU the cached ahead-of-time steps, and where they are missing eager steps
        at once while a low-priority process builds them (`self.aot_build`; the engine switches
        to them when they are ready; QUICKDRAFT_AOT_BUILD=0: no such build). quantization / draft_quantization: "int8" or "int4" weight-only for the target
        / the draft (output follows the target as loaded, quantised or not; "none": as loaded;
        None: a GGUF stored in 4 bits runs int4 on a CPU, anything else as loaded: `stored_quantization`);
        on a CPU with quickdraft's kernels a draft model is int8 and an EAGLE-3 head int8 (int4 where
        the integer kernels lack VNNI) unless draft_quantization says otherwise, since a draft step
        streams its weights and fewer bits cut that at the same acceptance
        (`_draft_model_quantization`, `_head_quantization`). draft_dtype: the
        draft's precision when it should differ from the target's (`dtype`); it changes
        acceptance and speed only, never the output's distribution. kv_cache_memory: the
        KV memory budget of every request's caches (the target's and the proposer's): bytes (an
        int, or "4GiB", "512MB") or a fraction of the memory available after loading ("0.5", 0.5);
        default a fraction of it (config.DEFAULT_KV_CACHE_MEMORY_CPU / _GPU). The caches grow as
        requests need them within it, and max_model_len defaults to what the model and the budget
        allow (docs/server.md, "KV memory"). kv_cache_dtype: the target's KV cache element type,
        "auto" (its dtype; float16 where its layers run int8 / int4 on a CPU:
        config.AUTO_QUANTISED_KV_CACHE_DTYPE), "float32", "float16" or "bfloat16": a 16-bit cache reads half the bytes per
        cached token each step and holds twice the tokens in a budget, attending over keys and
        values rounded to 16 bits (config.KV_CACHE_DTYPES; docs/cpu.md). preallocate: on a GPU, allocate the caches once at
        their largest (as many rows of max_model_len as the budget holds, up to max_num_seqs:
        static shapes for CUDA graphs; a server); on a CPU the caches grow as needed whatever it
        says. tensor_parallel_size: the target split over this many ranks
        (quickdraft.parallel; processes spawned here, or joined under torchrun);
        tensor_parallel_options: lm_head ("rank0" | "vocab"), timeout_s (collectives).
        draft="self" (SELF_DRAFT): self-speculation, the target's own weights as its draft model
        in draft_quantization ("int4" by default, or "int8"), quantised from the loaded target
        (the checkpoint is read once; embeddings and norms are shared).
        profile: a JSON profile from `quickdraft tune` (the goodput policy's costs) or `quickdraft
        select`, whose choice (method, draft, k, spec options) is used when neither method nor
        draft is given (num_speculative_tokens, when given, still wins). num_speculative_tokens:
        default DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_SELF_DRAFT_NUM_SPECULATIVE_TOKENS with
        draft="self" (or the profile's choice).
        enable_prefix_caching: keep the KV of computed tokens and reuse it for later prompts with
        the same prefix (quickdraft.prefix_cache; the server's default); its blocks take what the KV
        budget has free and are evicted when requests need it; prefix_cache_bytes (None: no cap of
        its own) caps them further. prefix_cache_check (debug): on every hit, prefill the cached
        prefix from scratch too and compare the KV (bit for bit with row-invariant kernels); a
        mismatch is logged, counted and repaired (True) or raises ("raise"); None (default): the
        environment variable QUICKDRAFT_PREFIX_CACHE_CHECK where prefix caching is on, else off.
        max_num_batched_tokens: tokens one step computes at most: the running requests' verify
        positions and a chunk of the prompts being prefilled (chunked prefill; "auto", the default:
        on a CPU 28 position-weighted tokens while requests decode (config.AUTO_BATCHED_TOKENS) and
        512 when none does; 2048 on a GPU; None: whole prompts).
        constraint_compile_timeout: seconds a request's constraint (SamplingParams.constraint) may
        take to compile for the model's vocabulary (off the step loop); past it the request is a
        QuickdraftError naming the constraint."""
        if method is not None:  # one name, "auto", or a list of names ("suffix,draft" / ["suffix", "draft"])
            method = method_name(method)
        choice = _profile_choice(profile, target) if method is None and draft is None else None
        if choice is not None:
            method, draft = choice.method, choice.draft
            spec_options = choice.options if spec_options is None else spec_options
            if num_speculative_tokens is None and choice.k > 0:
                num_speculative_tokens = choice.k
        self_draft = isinstance(draft, str) and draft == SELF_DRAFT
        if num_speculative_tokens is None:
            num_speculative_tokens = DEFAULT_SELF_DRAFT_NUM_SPECULATIVE_TOKENS if self_draft else DEFAULT_NUM_SPECULATIVE_TOKENS
        check_num_speculative_tokens(num_speculative_tokens)  # before anything is fetched or loaded
        check_max_num_seqs(max_num_seqs)
        check_kv_cache_memory(kv_cache_memory)
        kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        check_max_num_batched_tokens(max_num_batched_tokens)
        check_prefix_cache_bytes(prefix_cache_bytes)
        if prefix_cache_check is None:  # the environment's, where there is a cache to check
            prefix_cache_check = os.environ.get(PREFIX_CACHE_CHECK_ENV, "") if enable_prefix_caching else False
        prefix_cache_check = check_prefix_cache_check(prefix_cache_check)
        check_constraint_compile_timeout(constraint_compile_timeout)
        if self_draft:
            draft = None
            method = _check_self_draft_method(method)
            draft_quantization = _check_self_draft_options(quantization, draft_quantization, draft_dtype,
                                                           tensor_parallel_size)
        if target is None or (isinstance(target, str) and target == BUNDLED_TARGET):  # the bundled pair
            target, default_draft = default_model_dirs()
            if not target.exists():
                raise QuickdraftError("no target given and no bundled default model is installed; pass target=PATH")
            if draft is None and not self_draft:  # the bundled pair; with method="eagle3" (or a list with it) the target's head
                draft = resolve_model("target-eagle3") if _model_member(method) == "eagle3" else default_draft
        else:  # a folder, a .gguf, a named model (fetched on first use) or a Hub id
            wanted = None if method is None else "auto" if method == "auto" else _model_member(method)
            if draft is None and not self_draft and (method is None or wanted is not None):
                # the named model's own draft model (used by default), or its EAGLE-3 head (used when
                # method="eagle3" or a list with eagle3 asks for it: a head that does not pay is not made
                # the default); method="auto" takes either (the hybrid drafts with it only where it pays)
                named = named_default_draft(target)
                if named is not None and (wanted == "auto" or (wanted == "eagle3") == is_eagle3_head(named)):
                    draft = named
            target = resolve_model(target)
        if draft is not None:
            draft = resolve_model(draft)
        if method == "auto":  # the free proposers, and the draft or head when there is one
            model = () if draft is None and not self_draft else \
                ("eagle3",) if draft is not None and is_eagle3_head(draft) else ("draft",)
            method = ",".join(AUTO_FREE + model)
        if method is None:  # a head folder speculates with eagle3, any other draft as a draft model
            method = "none" if draft is None else "eagle3" if is_eagle3_head(draft) else "draft"
        spec = SpecConfig(method=method, num_speculative_tokens=num_speculative_tokens,
                          options=dict(spec_options or {}), policy=policy,
                          profile=None if profile is None else str(profile))
        cls = get_proposer(method)
        if cls is not None and cls.needs_draft_model and draft is None and not self_draft:
            raise QuickdraftError(f"method {method!r} needs a draft model folder")
        dev = resolve_device(device)
        target_dir = checkpoint_dir(target)
        if tensor_parallel_size == 1:  # ranks keep a GGUF's blocks only when asked (their cuts must fall on groups)
            quantization = stored_quantization(quantization, target_dir, dev)
        self_copy = None  # a self-draft, made from the loaded target
        if tensor_parallel_size != 1:
            from .parallel import load_tensor_parallel

            if compile == "aot":
                raise QuickdraftError("ahead-of-time compiled steps (aot) are not supported with "
                                      "tensor_parallel_size > 1: use compile=True (torch.compile on each rank)")
            # compiled: each rank compiles its own shard's step (CUDA graphs on CUDA), the engine drives it as is
            per_rank = compile is True or (compile is None and dev.type == "cuda")
            compile = False
            self.target = load_tensor_parallel(target_dir, tensor_parallel_size, dtype=dtype, device=dev,
                                               quantization=quantization, compile=per_rank,
                                               **dict(tensor_parallel_options or {}))
        else:
            if self_draft:
                _check_self_draft_source(target_dir)  # before the weights are read
            loaded = load_model(target_dir, dtype=dtype, device=dev, quantization=quantization)
            if self_draft:  # before prepare, which replaces the float linears it quantises from
                if next(loaded.parameters()).dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise QuickdraftError("a self-draft needs a float32, bfloat16 or float16 target")
                self_copy = quantized_copy(loaded, draft_quantization)
            self.target = prepare(loaded, quantization)
        self.tokenizer = Tokenizer.from_dir(target_dir)
        proposer = None
        self.draft = self_copy
        if cls is not None:
            if cls.needs_draft_model and cls.draft_is_head:
                from .model.eagle3 import load_eagle3

                self.draft = prepare(load_eagle3(draft, self.target, resolve_dtype(draft_dtype, self.target.config, dev)
                                                 if draft_dtype else None), _head_quantization(draft_quantization, dev))
            elif cls.needs_draft_model and not self_draft:
                draft_dir = checkpoint_dir(draft)
                draft_quantization = _draft_model_quantization(draft_quantization, draft_dir, dev, draft_dtype)
                self.draft = prepare(load_model(draft_dir, dtype=draft_dtype or dtype, device=dev,
                                                      quantization=draft_quantization), draft_quantization)
                check_same_vocabulary(self.target, self.draft, self.tokenizer, Tokenizer.from_dir(draft_dir))
            proposer = cls.build(target=self.target, draft=self.draft, **spec.options)
        if compile is None:
            compile = True if dev.type == "cuda" else "auto"
        config = EngineConfig(spec=spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len, compile=compile,
                              preallocate=preallocate, kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                              enable_prefix_caching=enable_prefix_caching, prefix_cache_bytes=prefix_cache_bytes,
                              max_num_batched_tokens=max_num_batched_tokens, prefix_cache_check=prefix_cache_check,
                              constraint_compile_timeout=constraint_compile_timeout)
        self.engine = Engine(self.target, proposer, config, self.tokenizer, eos_token_ids(target_dir, self.tokenizer))
        self.stats = SpecStats()  # aggregated over every generate() call
        self.aot_build = None  # the background build of missing AOT packages, if this LLM started one
        if compile is True:
            self._warm_up()
        elif compile == "auto" and self.engine.aot_missing and aot.background_builds_enabled():
            # the same models in another process, built there (compile="aot"); this one decodes now
            self._build_in_background(dict(
                target=str(target), draft=SELF_DRAFT if self_draft else None if draft is None else str(draft),
                method=method,
                num_speculative_tokens=num_speculative_tokens, dtype=_dtype_name(dtype), device=str(dev),
                spec_options=dict(spec_options or {}), quantization=quantization,
                draft_quantization=draft_quantization, draft_dtype=_dtype_name(draft_dtype),
                kv_cache_dtype=kv_cache_dtype))

    def _build_in_background(self, recipe: dict) -> None:
        """Start building this engine's missing AOT packages in a low-priority process (aot.
        BackgroundBuild); the engine switches to them when it is done, between two requests
        (Engine.switch_when_built)."""
        import hashlib
        import json

        try:
            payload = json.dumps(recipe, sort_keys=True)
        except (TypeError, ValueError) as exc:  # a spec option JSON cannot carry: stay eager, say so
            log.warning("quickdraft: no background AOT build (%s); running eagerly (compile='aot' builds first)", exc)
            return
        name = hashlib.sha256(payload.encode()).hexdigest()[:12]
        running = aot.running_build(name, payload)
        if running is not None:  # another process builds the same packages: wait for that one
            self.aot_build = running
            log.warning("quickdraft: the CPU steps of %s are being compiled by another process (pid %d, log %s); "
                        "decoding eagerly until they are ready", " and ".join(self.engine.aot_missing), running.pid,
                        running.log_path)
            self.engine.switch_when_built(running)
            return
        try:
            self.aot_build = aot.BackgroundBuild("quickdraft.llm.build_aot", payload, name)
        except OSError as exc:
            log.warning("quickdraft: could not start the background AOT build (%s); running eagerly", exc)
            return
        log.warning("quickdraft: compiling the CPU steps of %s in the background (once per model shape; pid %d, log "
                    "%s); decoding eagerly until they are ready (QUICKDRAFT_AOT_BUILD=0: no background build)",
                    " and ".join(self.engine.aot_missing), self.aot_build.pid, self.aot_build.log_path)
        self.engine.switch_when_built(self.aot_build)

    def wait_for_aot(self, timeout: float | None = None) -> bool:
        """Block until the background AOT build (if any) ends, then switch to its packages now
        (benchmarks that must measure one kind of step); whether no build is still running."""
        if self.aot_build is None:
            return True
        if not self.aot_build.wait(timeout):
            return False
        with torch.inference_mode():
            self.engine._switch_if_built(wait=True)
        return True

    def keep_current_steps(self) -> None:
        """Stay on the steps this LLM runs now: a background AOT build goes on (its packages are
        on disk for the next process) but this engine does not switch to them. For comparisons
        that must time two LLMs on the same kind of steps without waiting for the build."""
        self.engine.switch_when_built(None)

    def _warm_up(self) -> None:
        """Compile the steps now (one short greedy request), not inside the first real one."""
        import sys

        start = time.perf_counter()
        print("quickdraft: compiling the decode / verify / draft steps (once; PyTorch caches the result on disk)...",
              file=sys.stderr, flush=True)
        k = self.engine.k
        self.engine.warm_up()  # every query length the steps use
        self.engine.generate([([0] * 8, SamplingParams(temperature=0, max_tokens=k + 4, ignore_eos=True))])
        self.engine.stats = SpecStats()
        print(f"quickdraft: compiled in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Release what outlives this object: a tensor-parallel target's other ranks (once no
        other LLM of this process shares them)."""
        release = getattr(self.target, "release", None)
        if release is not None and not getattr(self, "_closed", False):
            self._closed = True
            release()

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise QuickdraftError("this model folder has no tokenizer.json: give prompts as token ids")
            if chat:
                return self.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise QuickdraftError("a prompt must be a string or a list of token ids")

    def encode_chat(self, messages: Conversation, tools: Sequence[Mapping] | None = None) -> list[int]:
        """One conversation rendered with the model's chat template (with the assistant's
        generation prompt and, if given, OpenAI-style `tools` for templates that render them) and
        encoded: what `chat`, `generate --chat` and the server send."""
        if self.tokenizer is None:
            raise QuickdraftError("this model folder has no tokenizer.json: chat needs a tokenizer")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise QuickdraftError("a conversation must be a non-empty list of {\"role\", \"content\"} messages")
        for m in messages:
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or \
                    not isinstance(m.get("content"), str):
                raise QuickdraftError(f"each message must have a string \"role\" and \"content\", got {m!r}")
        return self.tokenizer.encode_chat([dict(m) for m in messages], None if tools is None else [dict(t) for t in tools])

    def chat(self, messages: Conversation | Sequence[Conversation],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} messages) or a list of them,
        like vLLM's LLM.chat; outputs come back in order."""
        one = isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if one else list(messages)
        if not conversations:
            raise QuickdraftError("chat needs at least one conversation")
        return self.generate([self.encode_chat(c) for c in conversations], params)

    def _params_list(self, n: int, params) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise QuickdraftError(f"params must be one SamplingParams or a list of {n} (one per prompt)")
        return params

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        plist = self._params_list(len(prompts), params)
        encoded = [self.encode(p) for p in prompts]  # validate everything before starting
        start = time.perf_counter()
        outputs = self.engine.generate(list(zip(encoded, plist)))
        self._record(outputs, time.perf_counter() - start)
        return outputs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False) -> Iterator[RequestOutput]:
        """Yield outputs for one prompt as tokens are accepted (deltas in new_text / new_token_ids).
        Its figures (self.stats) count the engine's time only, not the caller's between outputs
        (printing them, say), so a streamed run's tokens per second compare with generate's."""
        ids = self.encode(prompt, chat=chat)
        start = time.perf_counter()
        rid = self.engine.add_request(ids, params or SamplingParams())
        busy = time.perf_counter() - start  # the engine's seconds so far
        try:
            while self.engine.has_unfinished():
                t0 = time.perf_counter()
                outs = self.engine.step()
                busy += time.perf_counter() - t0
                for out in outs:
                    if out.request_id == rid:
                        if out.finished:
                            self._record([out], busy)
                        yield out
        finally:
            self.engine.abort_request(rid)

    def _record(self, outputs: list[RequestOutput], wall: float) -> None:
        agg = SpecStats()
        for o in outputs:
            agg.merge(o.stats)
        agg.elapsed_s = wall  # throughput of the whole call, not the sum over requests
        self.stats.merge(agg)


def _dtype_name(dtype: str | torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def build_aot(payload: str) -> None:
    """A background build's process (aot.BackgroundBuild): the models an LLM was made with
    (`payload`: its arguments as JSON), loaded the same way, their missing packages built."""
    import json
    import sys

    aot.lower_priority()
    start = time.perf_counter()
    llm = LLM(**json.loads(payload), compile="aot")
    if llm.engine.aot_missing:
        sys.exit(f"built, but no package loads for {', '.join(llm.engine.aot_missing)}")
    print(f"quickdraft: AOT steps ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def stored_quantization(asked: str | None, model_dir: Path, device: torch.device) -> str | None:
    """A target's or draft model's weight format: as asked ("none": dequantised as loaded); by
    default, a GGUF stored in 4 bits (most layer matrices Q4_0 / Q4_1 / Q4_K) keeps its blocks on
    quickdraft's int4 kernel where that runs (a CPU with AVX-512 or AVX2 + FMA, or NEON), as
    llama.cpp runs such a file (SmolLM2's Q4_1 file: plain decoding 3.1x as fast as dequantised
    to float32, docs/cpu.md); matrices the file keeps wider run int8 (`quant.make_linear`).
    Anything else: as loaded."""
    if asked is not None or device.type != "cpu" or not blocked_supported():
        return asked
    from .model.gguf import four_bit_type, gguf_source

    source = gguf_source(model_dir)
    return "int4" if source is not None and four_bit_type(source) is not None else None


def _draft_model_quantization(asked: str | None, model_dir: Path, device: torch.device, draft_dtype=None) -> str | None:
    """A draft model's weight format: as asked, a GGUF stored in 4 bits as `stored_quantization`
    says, as loaded where a draft_dtype was asked for (that precision, not another), else int8 on
    a CPU where quickdraft's kernels run (its steps, like a head's, are bound
    by reading weights the target's step has evicted: the bundled pair on an AMD EPYC Zen 3, k = 5,
    ran 2.14x plain decoding with an int8 draft against 1.88x in float32, int4 2.03x at a lower
    acceptance, benchmarks/results/eagle3_bundled_zen3_cpu.md; an int8 draft had the float32
    draft's acceptance there and on an Intel Xeon, docs/cpu.md), else as loaded."""
    stored = stored_quantization(asked, model_dir, device)  # (`asked` itself whenever given)
    if stored is not None or draft_dtype is not None:
        return stored
    return "int8" if device.type == "cpu" and blocked_supported() else None


def _head_quantization(asked: str | None, device: torch.device) -> str | None:
    """An EAGLE-3 head's weight format: as asked, else on a CPU where quickdraft's kernels run
    int8 where its integer kernels have VNNI, int4 where they have not, else as loaded. A head's
    draft step is bound by reading its weights, which the target's step evicts from the caches
    between two catch-ups: the bundled head's step was 15% of a target step in float32, 9.5% in
    int8, with the same acceptance on both shipped heads (Intel Xeon, AVX-512 VNNI:
    benchmarks/results/eagle3_aot_head_cpu.md). Without VNNI int8 weights cost the same integer
    operations as int4 and twice the bytes: on an AMD EPYC Zen 3 (AVX2 only) the bundled pair
    with an int4 head ran 1.05-1.10x as fast as with an int8 one (five blocks), acceptance 0.51
    against 0.50
    (benchmarks/results/eagle3_bundled_zen3_cpu.md). On quickdraft's kernels the head's matmuls
    are row-invariant, like the target's (`quant.row_invariant`)."""
    if asked is not None:
        return asked
    if device.type != "cpu" or not blocked_supported():
        return None
    from . import kernels

    return "int8" if kernels.int8_uses_vnni() else "int4"


def _check_self_draft_method(method: str | None) -> str:
    """A self-draft is a draft model: method "draft" (the default with it), "auto" or a list
    whose model proposer is "draft"."""
    if method is None:
        return "draft"
    if method != "auto" and _model_member(method) != "draft":
        raise QuickdraftError(f"draft='self' drafts with a quantised copy of the target, a draft model: use "
                              f"method 'draft' (the default), 'auto' or a list with 'draft', not {method!r}")
    return method


def _model_member(method: str | None) -> str | None:
    """The model proposer (one needing a draft model or head) a method names, itself or in its
    list; None for none, auto and the free proposers."""
    if method is None or method == "auto":
        return None
    cls = get_proposer(method)
    if cls is None or not cls.needs_draft_model:
        return None
    return getattr(cls, "MODEL", None) or method


_BITS = {"int8": 8, "int4": 4}


def _check_self_draft_options(quantization: str | None, draft_quantization: str | None, draft_dtype,
                              tensor_parallel_size: int) -> str:
    """The self-draft's weight format (int4 unless int8 is asked); a clear error where it cannot
    pay: a draft as wide as the target streams as many bytes as the target's own step."""
    fmt = DEFAULT_SELF_DRAFT_QUANTIZATION if draft_quantization is None else draft_quantization
    if fmt not in _BITS:
        raise QuickdraftError(f"a self-draft (draft='self') is the target in int4 or int8: draft_quantization "
                              f"must be 'int4' or 'int8', got {draft_quantization!r}")
    if quantization in _BITS and _BITS[quantization] <= _BITS[fmt]:
        raise QuickdraftError(f"the target runs in {quantization}: a self-draft in {fmt} reads as many bytes per "
                              "token as the target itself, so it cannot pay"
                              + ("" if fmt == "int4" else "; draft_quantization='int4' can"))
    if draft_dtype is not None:
        raise QuickdraftError("a self-draft shares the target's embeddings and precision: draft_dtype cannot be set")
    if tensor_parallel_size != 1:
        raise QuickdraftError("a self-draft is not supported with tensor_parallel_size > 1 (it would need every "
                              "rank's weights on rank 0)")
    return fmt


def _check_self_draft_source(target_dir: Path) -> None:
    """A target stored in 4 bits (a GGUF of Q4_0 / Q4_1 / Q4_K layers) gets no self-draft: its
    4-bit copy would be the target itself, which already runs on the int4 kernel by default."""
    from .model.gguf import four_bit_type, gguf_source

    source = gguf_source(target_dir)
    kind = four_bit_type(source) if source is not None else None
    if kind is not None:
        raise QuickdraftError(f"the target's weights are stored in 4 bits ({kind} in {source.name}): a self-draft "
                              "cannot pay there (its copy would be the target itself, which runs in 4 bits by "
                              "default); give a smaller draft model, or a method that needs none")


def _profile_choice(profile: str | Path | None, target):
    """The `quickdraft select` choice a profile carries, or None (no profile, or one from `tune`)."""
    if profile is None:
        return None
    from .policy.costs import load_profile

    p = load_profile(profile)
    if p.choice is not None and target is not None and str(target) != p.target:
        log.warning("quickdraft: profile %s was measured on %s, not on %s; its choice (%s) may not pay here",
                    profile, p.target, target, p.choice.method)
    return p.choice
