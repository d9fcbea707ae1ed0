"""Typed, frozen configuration objects, validated at the edge.

`ModelConfig` is built from a Hugging Face `config.json`. It accepts both the
transformers 4.x spelling (`rope_theta` + `rope_scaling`) and the 5.x spelling
(`rope_parameters`). Anything we do not implement is a clear error that names the
option: a silently wrong model is the worst possible failure for this engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import QuickdraftError, UnsupportedModelError


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0  # base of the rotary frequencies
    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0  # linear / llama3 scaling factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads means grouped-query attention
    head_dim: int  # usually hidden_size // num_attention_heads, may be overridden (Qwen3)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048  # context length the model was trained for
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2, Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama mlp_bias)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral: attend to the last `sliding_window` keys only
    torch_dtype: str | None = None  # the dtype the checkpoint was saved in
    eos_token_ids: tuple[int, ...] = ()  # from config.json; generation_config.json adds more
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}: quickdraft supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise QuickdraftError(f"config.json: {key} must be a positive integer, got {cfg.get(key)!r}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}: only silu is implemented")
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError("unsupported pretraining_tp != 1")
        n_heads = cfg["num_attention_heads"]
        n_kv = cfg.get("num_key_value_heads") or n_heads
        if n_heads % n_kv:
            raise QuickdraftError(
                f"config.json: num_attention_heads ({n_heads}) must be a multiple of "
                f"num_key_value_heads ({n_kv})")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        if model_type == "qwen3" and not cfg.get("head_dim"):
            head_dim = 128  # transformers' Qwen3Config default
        if head_dim % 2:
            raise QuickdraftError(f"config.json: head_dim must be even for rotary embeddings, got {head_dim}")

        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = attention_bias or model_type == "qwen2"
        o_bias = attention_bias and model_type in ("llama", "mistral")
        if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"{model_type} with use_sliding_window=true (per-layer windows) is not supported")
        sliding_window = cfg.get("sliding_window") if model_type == "mistral" else None
        layer_types = cfg.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types) and model_type != "mistral":
            raise UnsupportedModelError(f"unsupported layer_types {sorted(set(layer_types))}")

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(sliding_window) if sliding_window else None,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    def kv_token_bytes(self, element_size: int) -> int:
        """KV-cache bytes of one token (one position of one row): keys and values of every layer,
        2 x layers x kv_heads x head_dim x element_size (4 for float32, 2 for bfloat16)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_size

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise QuickdraftError(f"no config.json in {path.parent}") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise QuickdraftError(f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise QuickdraftError(f"{path}: expected a JSON object")
        return cls.from_hf(data)


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 stores everything in rope_parameters; 4.x uses rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


# ---- one default and one check per shared setting (the library, the CLI, the server and deploy use these) --

DEFAULT_NUM_SPECULATIVE_TOKENS = 5  # k: draft tokens proposed per step (per request, at most)
MAX_NUM_SPECULATIVE_TOKENS = 64  # the longest speculation any configuration may ask for
DEFAULT_MAX_NUM_SEQS = 32  # rows of the running batch (KV-cache slots, allocated as requests need them)
# The KV memory budget (kv_cache_memory) when none is given: a fraction of the memory available
# when the engine starts (after the weights are loaded). On a CPU the memory is shared with the OS
# and everything else, and the caches are only taken as requests need them: half of what is
# available leaves the rest for activations, logits and the other processes. On a GPU the device
# is ours: most of what is free, less room for activations, logits and CUDA graphs.
DEFAULT_KV_CACHE_MEMORY_CPU = 0.5
DEFAULT_KV_CACHE_MEMORY_GPU = 0.8
_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30,
                 "t": 2**40}
SELF_DRAFT = "self"  # draft=SELF_DRAFT (--draft self): the target's own weights, quantised, drafting for it
DEFAULT_SELF_DRAFT_QUANTIZATION = "int4"  # a self-draft's weights unless draft_quantization says int8
# k when draft="self" and none is given: a quantised copy of the target agrees with it most of the time (greedy
# acceptance 0.92-0.94 on the bundled target's code openings), so longer drafts pay: on an AMD EPYC Zen 3 (AVX2, 1
# thread) its int4 copy gave 1.84x plain decoding at k = 8 against 1.57x at k = 5 with the default policy (int8:
# 1.46x / 1.37x; benchmarks/results/self_draft_bundled_auto_zen3_cpu.md, k = 3-8 at a fixed k in
# self_draft_bundled_zen3_cpu.md); the policy still lowers k where the measured step costs say that pays more
DEFAULT_SELF_DRAFT_NUM_SPECULATIVE_TOKENS = 8
# tokens one step computes at most (chunked prefill): the running requests' verify positions and a prompt chunk in
# one forward (mixed steps, quickdraft.engine). 20 from benchmarks/results/chunked_prefill_mixed_cpu.md (SmolLM2,
# one thread, 4 streams, a 4,000-token prompt arriving, a 2-core Xeon at load 2.3-9.4): with 4 streams a 16-token
# chunk keeps a step within ~2x a decode step (the streams' median gap while the prompt was prefilled 1.6-1.9x
# their steady median, p99 3.3-6.5x), against 4.3-5.0x and 11-15x with the old alternation at 64, whose first
# token came 1.6-2.3x sooner (27-76 s against 60-128 s); 32 gave 3.3x at load 2.7. Speculative batches need
# more: rows x (k + 1) must leave half of it for the chunk, else chunks and decode steps alternate
DEFAULT_MAX_NUM_BATCHED_TOKENS = "auto"  # CPU: 28 (position-weighted) while requests decode, 512 when none does; GPU: 2048
# "auto"'s budgets: (while requests are decoding, while none is). With nothing decoding there is no stream to keep
# flowing and a small budget only costs time to first token: a 2,690-token prompt alone took 15.5 s to its first
# token at 20, 10.5 s at 64, 8.8 s at 512 (SmolLM2 float32, one thread, the same 2-core Xeon; int4: 10.2 / 7.4 /
# 6.8 s), so a lone prompt prefills in chunks of 512 (the activations of a whole long prompt at once would
# not be bounded), and a prompt arriving while others decode in chunks within 20 tokens a step
AUTO_BATCHED_TOKENS = (28, 512)
# While requests decode, "auto" counts a prompt token at position p as 1 + p / P tokens, P the position where its
# attention (over p keys) costs what its linear layers do: a chunk's cost grows with its position. Beside 4
# SmolLM2 streams on the AOT steps (2 threads, AMD EPYC Zen 4, AVX-512), a flat 20-token chunk made the mixed step
# 2.2x a decode step at position 0 and 5.5x at 3,900, and the streams' p99 gap 4.2x their median while a
# 4,000-token prompt arrived (mixed_steps_smollm2_2t_cpu.md, chunked_prefill_aot_smollm2_2t_cpu.md).
# P = the linear layers' multiply-adds per token over AUTO_ATTENTION_COST x attention's per key: the attention
# kernel over a chunk's many queries and long keys does about 2.5x fewer multiply-adds a second than the
# linear layers there (fitted 2.2-2.8 from those step costs; an AVX-512 Xeon measured 4.3-5.3 before the
# many-row attention kernel), P = 1,229 for SmolLM2. With 28, 4 plain streams leave 24: chunks of 23 tokens at
# position 0, 13 at 1,000, 9 at 2,000, 5 at 3,900, each step ~2x a decode step (engine.attention_position,
# _weighted_chunk; in one process, 2 threads: p99 step 2.9x the decode step against 3.7x with a flat 20;
# 24 gave 2.1x / 3.1x, 32 2.6x / 3.3x). The price is the long prompt's first token, which comes later (more,
# smaller chunks: 22.8 s against 15.7 s in that run; the server figures beside the flat budget in
# chunked_prefill_aot_smollm2_*_cpu.md)
AUTO_ATTENTION_COST = 2.5
# on a GPU (steps alternate there: its GEMMs are not row-invariant, so no mixed steps) a chunk of hundreds of
# tokens costs about a decode step: "auto" is vLLM's online-serving default there
AUTO_BATCHED_TOKENS_GPU = 2048
# the speculation-length policy: "auto" follows this machine's measured step costs (quickdraft.policy.auto),
# falling back to a smaller k or plain decoding where speculation cannot pay; "fixed" drafts k every step
DEFAULT_POLICY = "auto"
# Seconds a request's constraint (JSON schema, regex, grammar) may take to compile for the model's
# vocabulary (quickdraft.constraints: on a worker thread, never the engine's step loop); past it
# the request is refused (QuickdraftError naming the constraint; HTTP 400 on the server). A sane
# schema takes milliseconds; llguidance's own size limits end even pathological ones within about a second.
DEFAULT_CONSTRAINT_COMPILE_TIMEOUT = 5.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_num_speculative_tokens(value: Any) -> int:
    """k, the draft tokens proposed per step: an integer in [1, MAX_NUM_SPECULATIVE_TOKENS].
    The one check (and message) behind LLM, SpecConfig and every command's -k."""
    if not _is_int(value) or not 1 <= value <= MAX_NUM_SPECULATIVE_TOKENS:
        raise QuickdraftError(f"num_speculative_tokens must be an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}], "
                              f"got {value!r}")
    return value


def check_max_num_seqs(value: Any) -> int:
    """Rows of the running batch: an integer >= 1 (LLM, EngineConfig, --max-num-seqs)."""
    if not _is_int(value) or value < 1:
        raise QuickdraftError(f"max_num_seqs must be an integer >= 1, got {value!r}")
    return value


def check_kv_cache_memory(value: Any) -> int | float | None:
    """The KV memory budget (kv_cache_memory, --kv-cache-memory): None (the default: a fraction
    of the available memory, DEFAULT_KV_CACHE_MEMORY_*), a byte count (an integer >= 1, or text
    such as "4GiB", "512MB", "1e9"), or a fraction of the available memory in (0, 1] (a float, or
    text such as "0.5"). Returns None, an int (bytes) or a float (a fraction)."""
    if value is None:
        return None
    bad = QuickdraftError(f"kv_cache_memory must be a byte count (e.g. 4GiB, 512MB, 1000000000) or a fraction "
                          f"of the available memory in (0, 1] (e.g. 0.5), got {value!r}", field="kv_cache_memory")
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([a-z]*)", text)
        if m is None or m.group(2) not in _MEMORY_UNITS:
            raise bad
        number, unit = float(m.group(1)), m.group(2)
        if not unit and number <= 1 and "." in m.group(1):
            value = number  # "0.5": a fraction
        else:
            value = int(number * _MEMORY_UNITS[unit])
            if value < 1:
                raise bad
            return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad
    if isinstance(value, int):
        if value < 1:
            raise bad
        return value
    if not 0 < value <= 1:
        raise bad
    return float(value)


# The KV cache's element type (kv_cache_dtype, --kv-cache-dtype): "auto" (the target's dtype; float16 for a
# target whose layers run int8 / int4 on a CPU: AUTO_QUANTISED_KV_CACHE_DTYPE), or one of these.
# A 16-bit cache halves the bytes every decode step reads per cached token (quickdraft's CPU attention widens
# them as it reads, exactly) and doubles the tokens a KV budget holds; the model then attends over its keys and
# values rounded to 16 bits, as llama.cpp's default f16 cache does: outputs differ from a float32 cache's,
# and speculative output still equals plain decoding's on the same cache (every step reads the same values).
KV_CACHE_DTYPES = {"float32": "float32", "fp32": "float32", "f32": "float32",
                   "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
                   "bfloat16": "bfloat16", "bf16": "bfloat16"}
DEFAULT_KV_CACHE_DTYPE = "auto"
# "auto"'s cache for a target whose decoder layers run int8 or int4 weights on a CPU (SmolLM2 by default, a
# GGUF's Q4 / Q8 layers, quantization="int8" / "int4"; not under tensor parallelism): llama.cpp's default f16
# cache. Such a target's output already differs from its float32 checkpoint's, its decode step reads few weight
# bytes, so past a few hundred tokens the float32 cache was most of what a step read: SmolLM2's int4 decode step
# on an AMD EPYC Zen 4 (1 thread, AOT) took 0.85x the time at 250 tokens, 0.69x at 4,000 (int8 0.94x / 0.72x),
# a 6-row verify step 0.90-1.05x (benchmarks/results/kv_cache_dtype_smollm2_zen4_cpu.md); perplexity within 0.2%
# of the float32 cache's on three texts (perplexity_kv_smollm2_zen4_cpu.txt). Twice the tokens per KV budget. A
# float32 / bfloat16 target keeps its dtype (its output matches transformers'), and "float32" keeps a quantised
# target's cache in float32
AUTO_QUANTISED_KV_CACHE_DTYPE = "float16"


def check_kv_cache_dtype(value: Any) -> str:
    """The KV cache's element type (LLM, EngineConfig, --kv-cache-dtype): "auto" (the default: the
    target's dtype, or float16 for int8 / int4 layers on a CPU: AUTO_QUANTISED_KV_CACHE_DTYPE),
    "float32", "float16" or "bfloat16" (fp32 / f32, fp16 / f16 / half, bf16 too). Returns "auto" or
    the canonical name."""
    if value is None:
        return DEFAULT_KV_CACHE_DTYPE
    name = value.strip().lower() if isinstance(value, str) else None
    if name == "auto":
        return name
    if name not in KV_CACHE_DTYPES:
        raise QuickdraftError(f"kv_cache_dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {value!r}",
                              field="kv_cache_dtype")
    return KV_CACHE_DTYPES[name]


def format_bytes(n: float) -> str:
    """A byte count for people: 1.5 GiB, 46.1 KiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_max_num_batched_tokens(value: Any) -> int | str | None:
    """The per-step token budget (LLM, EngineConfig, --max-num-batched-tokens): "auto" (the default:
    AUTO_BATCHED_TOKENS, small while requests decode, larger when none does), an integer >= 1 (every
    step, text such as "64" too), or None (no chunking: whole prompts). Returns "auto", an int or None."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if not _is_int(value) or value < 1:
        raise QuickdraftError(f"max_num_batched_tokens must be 'auto' or an integer >= 1, got {value!r}",
                              field="max_num_batched_tokens")
    return value


def check_constraint_compile_timeout(value: Any) -> float:
    """Seconds a constraint may take to compile: a number > 0 (LLM, EngineConfig,
    --constraint-compile-timeout)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise QuickdraftError(f"constraint_compile_timeout must be a number of seconds > 0, got {value!r}",
                              field="constraint_compile_timeout")
    return float(value)


def check_prefix_cache_bytes(value: Any) -> int | None:
    """The prefix cache's own cap: None (the default: the KV budget alone decides, the blocks
    evicted when requests need the memory) or an integer >= 0 of bytes, at most that much of the
    budget (LLM, EngineConfig)."""
    if value is not None and (not _is_int(value) or value < 0):
        raise QuickdraftError(f"prefix_cache_bytes must be None or an integer >= 0, got {value!r}",
                              field="prefix_cache_bytes")
    return value


# The prefix cache's debug check (prefix_cache_check, --prefix-cache-check, this environment variable): on
# every hit, the cached prefix is also prefilled from scratch and the two KV compared (quickdraft.prefix_cache)
PREFIX_CACHE_CHECK_ENV = "QUICKDRAFT_PREFIX_CACHE_CHECK"
_CHECK_WORDS = {"": False, "0": False, "false": False, "off": False, "no": False,
                "1": True, "true": True, "on": True, "yes": True, "raise": "raise"}


def check_prefix_cache_check(value: Any) -> bool | str:
    """The prefix cache's debug check: False (the default), True (on a hit, prefill the cached
    prefix from scratch too and compare the KV; a mismatch is logged, counted and repaired), or
    "raise" (a mismatch raises: tests). Text as in the environment variable (PREFIX_CACHE_CHECK_ENV):
    0/1, true/false, on/off, raise. Returns False, True or "raise"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _CHECK_WORDS:
        return _CHECK_WORDS[value.strip().lower()]
    raise QuickdraftError(f"prefix_cache_check must be true, false or 'raise' ({PREFIX_CACHE_CHECK_ENV}: 1, 0 or "
                          f"raise), got {value!r}", field="prefix_cache_check")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "draft"  # "none" = plain decoding, or a registered proposer (quickdraft.proposers)
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS  # k: the most draft tokens any path proposes per step
    options: Mapping[str, Any] = field(default_factory=dict)  # the proposer's own options
    policy: str = DEFAULT_POLICY  # speculation length per request and step: auto | fixed | acceptance | goodput
    profile: str | None = None  # cost profile JSON from `quickdraft tune` (the goodput policy)

    def __post_init__(self) -> None:
        # The method and policy names are checked by their registries (quickdraft.proposers.get,
        # quickdraft.policy.check_policy) when an engine is built: config imports neither.
        check_num_speculative_tokens(self.num_speculative_tokens)  # checked for "none" too: one rule
        if self.method == "none" and self.options:
            raise QuickdraftError("method 'none' takes no speculation options")

    @property
    def k(self) -> int:
        return 0 if self.method == "none" else self.num_speculative_tokens


@dataclass(frozen=True)
class EngineConfig:
    spec: SpecConfig = field(default_factory=SpecConfig)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # rows of the running batch (KV-cache slots)
    max_model_len: int | None = None  # tokens per request; None = the target's context, or what the KV budget holds
    # The decode / verify / draft steps: False eager; True torch.compile (quickdraft.compile); "aot"
    # ahead-of-time compiled packages on CPU, built when missing; "auto" such packages when cached
    # (quickdraft.aot), else eager.
    compile: bool | str = False
    # On a GPU: the caches for as many rows of max_model_len as the budget holds (up to max_num_seqs),
    # allocated at the first request and never resized (static shapes and addresses for CUDA graphs;
    # a server). Otherwise, and on a CPU always, the caches grow as requests need them, within the budget.
    preallocate: bool = False
    kv_cache_memory: int | float | str | None = None  # the KV budget: check_kv_cache_memory
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE  # the target's KV cache: check_kv_cache_dtype, KV_CACHE_DTYPES
    # Automatic prefix caching (quickdraft.prefix_cache): the KV of computed tokens kept after a request, reused by
    # later requests with the same prefix. Its blocks are claimed from the KV budget and evicted (least recently
    # used first) when requests need the memory; prefix_cache_bytes caps them further (None: only the budget).
    enable_prefix_caching: bool = False
    prefix_cache_bytes: int | None = None
    # Debug: on every prefix cache hit, prefill the cached prefix from scratch too and compare the KV, bit for bit
    # where the kernels are row-invariant (check_prefix_cache_check: False, True, "raise"); costs a prefill per hit
    prefix_cache_check: bool | str = False
    # Chunked prefill: tokens one step computes at most, the running requests' verify positions and a prompt
    # chunk together (mixed steps; "auto": AUTO_BATCHED_TOKENS; None: a whole batch of prompts in one step)
    max_num_batched_tokens: int | str | None = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # seconds a request's constraint may take to compile (off the step loop); past it the request is refused
    constraint_compile_timeout: float = DEFAULT_CONSTRAINT_COMPILE_TIMEOUT

    def __post_init__(self) -> None:
        check_max_num_seqs(self.max_num_seqs)
        object.__setattr__(self, "constraint_compile_timeout",
                           check_constraint_compile_timeout(self.constraint_compile_timeout))
        object.__setattr__(self, "kv_cache_memory", check_kv_cache_memory(self.kv_cache_memory))
        object.__setattr__(self, "kv_cache_dtype", check_kv_cache_dtype(self.kv_cache_dtype))
        object.__setattr__(self, "max_num_batched_tokens", check_max_num_batched_tokens(self.max_num_batched_tokens))
        check_prefix_cache_bytes(self.prefix_cache_bytes)
        object.__setattr__(self, "prefix_cache_check", check_prefix_cache_check(self.prefix_cache_check))
        if self.prefix_cache_check and not self.enable_prefix_caching:
            raise QuickdraftError("prefix_cache_check checks the prefix cache's hits: turn prefix caching on "
                                  "(enable_prefix_caching=True, --enable-prefix-caching) or the check off",
                                  field="prefix_cache_check")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise QuickdraftError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.compile not in (False, True, "aot", "auto"):
            raise QuickdraftError(f"compile must be True, False, 'aot' or 'auto', got {self.compile!r}")
