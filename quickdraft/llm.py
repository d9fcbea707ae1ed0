"""The offline Python API: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from . import aot
from .config import (DEFAULT_MAX_NUM_SEQS, DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_POLICY, EngineConfig, SpecConfig,
                     check_max_num_seqs, check_num_speculative_tokens)
from .errors import QuickdraftError
from .engine import Engine, RequestOutput
from .metrics import SpecStats
from .model.loader import checkpoint_dir, load_model, resolve_device, resolve_dtype
from .model.quant import blocked_supported, prepare
from .model.eagle3 import is_eagle3_head
from .model.sources import CATALOGUE, default_draft, resolve_model
from .model.tokenizer import Tokenizer, eos_token_ids
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


def _named_default_draft(target: str | Path) -> Path | None:
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
                 method: str | None = None, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                 dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_model_len: int | None = None,
                 spec_options: Mapping[str, Any] | None = None, policy: str = DEFAULT_POLICY,
                 profile: str | Path | None = None, compile: bool | str | None = None,
                 quantization: str | None = None, draft_quantization: str | None = None,
                 preallocate: bool = False, draft_dtype: str | torch.dtype | None = None,
                 tensor_parallel_size: int = 1, tensor_parallel_options: Mapping[str, Any] | None = None):
        """compile: True: torch.compile the decode / verify / draft steps; "aot": on CPU,
        ahead-of-time compiled steps (quickdraft.aot; built once per model shape, about a minute,
        then cached on disk) before the first token; False: eager. None (default): CUDA graphs on
        CUDA/ROCm; on CPU the cached ahead-of-time steps, and where they are missing eager steps
        at once while a low-priority process builds them (`self.aot_build`; the engine switches
        to them when they are ready; QUICKDRAFT_AOT_BUILD=0: no such build). quantization / draft_quantization: "int8" or "int4" weight-only for the target
        / the draft (output follows the target as loaded, quantised or not; "none": as loaded);
        an EAGLE-3 head on a CPU with quickdraft's kernels is int8 unless draft_quantization says
        otherwise, since its draft step streams its weights and int8 halves that at the same
        acceptance (README, "EAGLE-3"). draft_dtype: the
        draft's precision when it should differ from the target's (`dtype`); it changes
        acceptance and speed only, never the output's distribution. preallocate: KV
        caches for max_num_seqs requests of max_model_len tokens at once, so requests can join
        a running batch whenever a row is free (what a server wants); else they are sized for
        each batch of generate(). tensor_parallel_size: the target split over this many ranks
        (quickdraft.parallel; processes spawned here, or joined under torchrun);
        tensor_parallel_options: lm_head ("rank0" | "vocab"), timeout_s (collectives)."""
        check_num_speculative_tokens(num_speculative_tokens)  # before anything is fetched or loaded
        check_max_num_seqs(max_num_seqs)
        if target is None:
            target, default_draft = default_model_dirs()
            if not target.exists():
                raise QuickdraftError("no target given and no bundled default model is installed; pass target=PATH")
            if draft is None:  # the bundled pair; with method="eagle3" the bundled target's head
                draft = resolve_model("target-eagle3") if method == "eagle3" else default_draft
        else:  # a folder, a .gguf, a named model (fetched on first use) or a Hub id
            if draft is None and method in (None, "draft", "eagle3"):
                # the named model's own draft model (used by default), or its EAGLE-3 head (used when
                # method="eagle3" asks for it: a head that does not pay is not made the default)
                named = _named_default_draft(target)
                if named is not None and (method == "eagle3") == is_eagle3_head(named):
                    draft = named
            target = resolve_model(target)
        if draft is not None:
            draft = resolve_model(draft)
        if method is None:  # a head folder speculates with eagle3, any other draft as a draft model
            method = "none" if draft is None else "eagle3" if is_eagle3_head(draft) else "draft"
        spec = SpecConfig(method=method, num_speculative_tokens=num_speculative_tokens,
                          options=dict(spec_options or {}), policy=policy,
                          profile=None if profile is None else str(profile))
        cls = get_proposer(method)
        if cls is not None and cls.needs_draft_model and draft is None:
            raise QuickdraftError(f"method {method!r} needs a draft model folder")
        dev = resolve_device(device)
        target_dir = checkpoint_dir(target)
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
            self.target = prepare(load_model(target_dir, dtype=dtype, device=dev, quantization=quantization),
                                  quantization)
        self.tokenizer = Tokenizer.from_dir(target_dir)
        proposer = None
        self.draft = None
        if cls is not None:
            if cls.needs_draft_model and cls.draft_is_head:
                from .model.eagle3 import load_eagle3

                self.draft = prepare(load_eagle3(draft, self.target, resolve_dtype(draft_dtype, self.target.config, dev)
                                                 if draft_dtype else None), _head_quantization(draft_quantization, dev))
            elif cls.needs_draft_model:
                draft_dir = checkpoint_dir(draft)
                self.draft = prepare(load_model(draft_dir, dtype=draft_dtype or dtype, device=dev,
                                                      quantization=draft_quantization), draft_quantization)
                check_same_vocabulary(self.target, self.draft, self.tokenizer, Tokenizer.from_dir(draft_dir))
            proposer = cls.build(target=self.target, draft=self.draft, **spec.options)
        if compile is None:
            compile = True if dev.type == "cuda" else "auto"
        config = EngineConfig(spec=spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len, compile=compile,
                              preallocate=preallocate)
        self.engine = Engine(self.target, proposer, config, self.tokenizer, eos_token_ids(target_dir, self.tokenizer))
        self.stats = SpecStats()  # aggregated over every generate() call
        self.aot_build = None  # the background build of missing AOT packages, if this LLM started one
        if compile is True:
            self._warm_up()
        elif compile == "auto" and self.engine.aot_missing and aot.background_builds_enabled():
            # the same models in another process, built there (compile="aot"); this one decodes now
            self._build_in_background(dict(
                target=str(target), draft=None if draft is None else str(draft), method=method,
                num_speculative_tokens=num_speculative_tokens, dtype=_dtype_name(dtype), device=str(dev),
                spec_options=dict(spec_options or {}), quantization=quantization,
                draft_quantization=draft_quantization, draft_dtype=_dtype_name(draft_dtype)))

    def _build_in_background(self, recipe: dict) -> None:
        """Start building this engine's missing AOT packages in a low-priority process (aot.
        BackgroundBuild); the engine switches to them when it is done."""
        import hashlib
        import json

        try:
            payload = json.dumps(recipe, sort_keys=True)
        except (TypeError, ValueError) as exc:  # a spec option JSON cannot carry: stay eager, say so
            log.warning("quickdraft: no background AOT build (%s); running eagerly (compile='aot' builds first)", exc)
            return
        name = hashlib.sha256(payload.encode()).hexdigest()[:12]
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

    def encode_chat(self, messages: Conversation) -> list[int]:
        """One conversation rendered with the model's chat template (with the assistant's
        generation prompt) and encoded: what `chat`, `generate --chat` and the server send."""
        if self.tokenizer is None:
            raise QuickdraftError("this model folder has no tokenizer.json: chat needs a tokenizer")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise QuickdraftError("a conversation must be a non-empty list of {\"role\", \"content\"} messages")
        for m in messages:
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or \
                    not isinstance(m.get("content"), str):
                raise QuickdraftError(f"each message must have a string \"role\" and \"content\", got {m!r}")
        return self.tokenizer.encode_chat([dict(m) for m in messages])

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
        """Yield outputs for one prompt as tokens are accepted (deltas in new_text / new_token_ids)."""
        ids = self.encode(prompt, chat=chat)
        start = time.perf_counter()
        rid = self.engine.add_request(ids, params or SamplingParams())
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id == rid:
                        if out.finished:
                            self._record([out], time.perf_counter() - start)
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


def _head_quantization(asked: str | None, device: torch.device) -> str | None:
    """An EAGLE-3 head's weight format: as asked, else int8 on a CPU where quickdraft's int8
    kernel runs (a head's draft step is bound by reading its weights: the bundled head's step
    was 15% of a target step in float32, 9.5% in int8, with the same acceptance on both shipped
    heads: benchmarks/results/eagle3_aot_head_cpu.md), else as loaded. On quickdraft's kernel
    the head's matmuls are row-invariant, like the target's (`quant.row_invariant`)."""
    if asked is not None:
        return asked
    return "int8" if device.type == "cpu" and blocked_supported() else None
