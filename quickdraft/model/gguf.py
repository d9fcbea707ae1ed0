"""GGUF files (llama.cpp's single-file format) as checkpoints.

A GGUF carries the config and the tokenizer as metadata under llama.cpp's key names and the
weights as F32 / F16 / BF16 tensors or quantised blocks. The engine works from a Hugging Face
style folder, so a GGUF is met halfway:

- `gguf_checkpoint_dir(path)` writes the small files (config.json, generation_config.json,
  tokenizer.json, tokenizer_config.json) once into `<cache>/gguf/<key>/`, keyed by the file's
  path, size and mtime, plus `gguf.json` naming the file. Tokenizer, eos ids and chat template
  then come from that folder exactly as from any checkpoint.
- `load_gguf_model(path)` (what `load_model` does for a .gguf file or such a folder) reads the
  weights straight from the GGUF, dequantised at load into the requested dtype: no copy on disk
  (under quantization="int4" a layer's 4-bit matrix is dequantised only if its format asks).
- `convert_gguf(path, out_dir)` writes a complete Hugging Face folder (model.safetensors too).
- `GGUFWeights(path)` opens the weights like safetensors' `safe_open` (keys, get_tensor,
  get_slice(name)[rows] / [:, cols]): a tensor-parallel rank reads only its own blocks (`read_part`).

The header is read here (the gguf package's reader takes seconds over a large vocabulary); its
type enum and block sizes, and the numpy dequantisers of the K-quants, are the `gguf` package's.
F32/F16/BF16/Q8_0/Q4_0/Q4_1 are dequantised in torch (checked against gguf's). What is ours too:
the name and metadata mapping, and undoing the row permutation llama.cpp's converter
applies to llama's q/k projections. Mistral files say architecture "llama" and load as Llama:
llama.cpp keeps no sliding window for them and attends to every key, and so do we.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig, RopeConfig
from ..errors import QuickdraftError, UnsupportedModelError
from .build import assemble, expected_shapes, quantised_weights, resolve_device, resolve_dtype
from .sources import cache_dir
from .transformer import Transformer, rope_inv_freq

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GGUF_POINTER = "gguf.json"  # in a metadata folder: the GGUF its weights are read from
_MAGIC = b"GGUF"

# GGUF tensor names -> Hugging Face parameter names (each with .weight / .bias).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+ rope scaling, stored as per-frequency divisors


@dataclass(frozen=True)
class GGUFContents:
    path: Path
    metadata: dict[str, Any]  # llama.cpp key -> value (arrays as lists)
    tensors: dict[str, GGUFTensor]  # name -> tensor (data memory-mapped, read on demand)

    @property
    def arch(self) -> str:
        return self.metadata.get("general.architecture", "")


def _gguf_package():
    try:
        import gguf
    except ImportError:
        raise QuickdraftError("reading GGUF files needs the gguf package: pip install gguf") from None
    return gguf


def is_gguf_file(path: str | Path) -> bool:
    """A file named *.gguf or starting with the GGUF magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(4) == _MAGIC


# --- reading --------------------------------------------------------------------------------
# GGUF layout (little-endian, versions 2 and 3): magic, u32 version, u64 tensor count, u64
# key/value count; the key/value pairs (string key, u32 type, value); per tensor its name, u32
# number of dims, u64 dims (innermost first), u32 type, u64 offset; then, aligned to
# `general.alignment` (default 32), the tensor data. The gguf package's reader wraps every field
# part in a numpy memmap view: ~4 s for a 49k-token vocabulary. This one reads the header with
# struct straight from a memory map (~0.1 s); tensors stay views of the map until dequantised.

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: innermost (the row) first
    data: np.ndarray  # the raw bytes, uint8 (rows, bytes per row): a view of the memory map

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


# Bounds a header is checked against before anything is read into memory: every count must fit
# in the bytes left (at its entries' smallest size), so what the header lists costs memory in
# proportion to the file; llama.cpp nests no arrays deeper than this and no tensor has more dims.
_MAX_NESTING = 2
_MAX_DIMS = 4
_MIN_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8, _STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dims, one dim, type, offset


class _Cursor:
    def __init__(self, buf: Any):
        self.buf, self.pos = buf, 0

    def fits(self, n: int, each: int, what: str) -> None:
        """`n` entries of at least `each` bytes fit in what is left of the file."""
        left = len(self.buf) - self.pos
        if n * each > left:
            raise ValueError(f"{what}: {n} entries cannot fit in the {left} bytes left")

    def scalar(self, kind: int) -> Any:
        fmt = "<" + _SCALAR[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        if start + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        self.pos = start + n
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            if depth >= _MAX_NESTING:
                raise ValueError(f"metadata arrays nested more than {_MAX_NESTING} deep")
            item, n = self.scalar(4), self.scalar(10)
            if item not in _MIN_BYTES:
                raise ValueError(f"unknown metadata value type {item}")
            self.fits(n, _MIN_BYTES[item], "a metadata array")
            if item == _STRING:
                return [self.string() for _ in range(n)]
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
                values = np.frombuffer(self.buf, dtype, n, self.pos)
                self.pos += n * dtype.itemsize
                return values.tolist()
            return [self.value(item, depth + 1) for _ in range(n)]  # arrays of arrays
        if kind not in _SCALAR:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.scalar(kind)


def _show(text: str, limit: int = 60) -> str:
    """A name or value from the file, fit for a one-line message (control characters escaped)."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return text if text.isprintable() else ascii(text)


def _alignment(metadata: dict[str, Any]) -> int:
    align = metadata.get("general.alignment", 32)
    if type(align) is not int or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    return align


def _parse(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """The header, checked before any tensor is touched: counts within the file's size, no
    duplicate key or tensor name, at most 4 dims of at least 1, sizes computed exactly (Python
    integers: no overflow), every tensor inside the file, aligned, and no two sharing bytes."""
    gguf = _gguf_package()
    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: writable views, file untouched
    c = _Cursor(buf)
    c.pos = 4
    version = c.scalar(4)
    if version not in (2, 3):
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        raise ValueError("a big-endian GGUF (convert it on a little-endian machine)" if swapped in (2, 3)
                         else f"GGUF version {version} (quickdraft reads versions 2 and 3)")
    n_tensors, n_kv = c.scalar(10), c.scalar(10)
    c.fits(n_kv, _MIN_KV_BYTES, "metadata")
    metadata = {}
    for _ in range(n_kv):
        key = c.string()
        if key in metadata:
            raise ValueError(f"metadata key {_show(key)} appears twice")
        metadata[key] = c.value(c.scalar(4))
    c.fits(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensor list")
    infos = {}
    for _ in range(n_tensors):
        name = c.string()
        if name in infos:
            raise ValueError(f"tensor {_show(name)} appears twice")
        n_dims = c.scalar(4)
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {_show(name)} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = tuple(c.scalar(10) for _ in range(n_dims))
        if min(dims) < 1:
            raise ValueError(f"tensor {_show(name)} has an empty dimension {list(dims)}")
        infos[name] = (dims, c.scalar(4), c.scalar(10))
    align = _alignment(metadata)
    start = c.pos + (-c.pos % align)
    tensors, spans = {}, []
    for name, (dims, kind, offset) in infos.items():
        try:
            qtype = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise UnsupportedModelError(f"{path.name}: unsupported GGUF tensor type {kind} in {_show(name)}") from None
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        row = dims[0]
        if row % block:
            raise ValueError(f"tensor {_show(name)}: row of {row} values is not a whole number of {block}-value blocks")
        if offset % align:
            raise ValueError(f"tensor {_show(name)}: offset {offset} is not a multiple of the alignment {align}")
        rows = math.prod(dims[1:])  # Python integers: exact, whatever the header says
        row_bytes = row // block * block_bytes
        if start + offset + rows * row_bytes > len(buf):
            raise ValueError(f"tensor {_show(name)} runs past the end of the file")
        spans.append((offset, offset + rows * row_bytes, name))
        data = np.frombuffer(buf, np.uint8, rows * row_bytes, start + offset).reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, qtype, dims, data)
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"tensors {_show(first)} and {_show(second)} share bytes")
    return metadata, tensors


def read_gguf(path: str | Path) -> GGUFContents:
    """Header and metadata of a GGUF; every failure is one QuickdraftError line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise QuickdraftError(f"GGUF file not found: {path}")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise QuickdraftError(f"cannot read {path}: {exc.strerror or exc}") from None
    if magic != _MAGIC:
        raise QuickdraftError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        metadata, tensors = _parse(path)
    except (ValueError, struct.error, OverflowError, UnicodeDecodeError, MemoryError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise QuickdraftError(f"{path} is truncated or corrupt ({reason})") from None
    bad = sorted({t.tensor_type.name for t in tensors.values()} - set(TENSOR_TYPES))
    if bad:
        raise UnsupportedModelError(f"{path.name}: unsupported GGUF tensor type {', '.join(bad)} "
                                    f"(quickdraft reads {', '.join(TENSOR_TYPES)})")
    return GGUFContents(path, metadata, tensors)


# --- config ---------------------------------------------------------------------------------

MAX_CONTEXT = 1 << 24  # a context_length above this (16M tokens) is taken for a corrupt file


def _layers(g: GGUFContents) -> int:
    """How many layers the tensors hold (blk.0 ... blk.N-1, none missing)."""
    found = {int(p[1]) for p in (n.split(".") for n in g.tensors) if p[0] == "blk" and len(p) > 2 and p[1].isdigit()}
    if found != set(range(len(found))):
        raise QuickdraftError(f"{g.path.name}: GGUF layers are not numbered 0 to {len(found) - 1}: {sorted(found)[:8]}")
    return len(found)


def hf_config(g: GGUFContents) -> dict[str, Any]:
    """The Hugging Face config.json dict the metadata describes (what ModelConfig.from_hf takes).
    Every value is checked against the tensors present before anything is built from it: the
    layer count equals the layers in the file, sizes are counts no larger than the tensors', so
    a header cannot make a model larger than the file it comes with."""
    arch = g.arch
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{g.path.name}: unsupported GGUF architecture {_show(str(arch))!r} "
                                    f"(quickdraft loads {', '.join(ARCHITECTURES)}; Mistral files are llama)")
    meta = g.metadata

    def bad(name: str, value: Any, what: str) -> QuickdraftError:
        return QuickdraftError(f"{g.path.name}: GGUF metadata {name} = {_show(str(value))} is not {what}")

    def key(name: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is ...:
            raise QuickdraftError(f"{g.path.name}: GGUF metadata has no {arch}.{name}")
        if isinstance(value, list):  # per-layer values: we only build uniform layers
            if not value or any(isinstance(v, list) for v in value) or len(set(value)) != 1:
                raise UnsupportedModelError(f"{g.path.name}: {arch}.{name} differs between layers")
            value = value[0]
        return value

    def count(name: str, upper: int, default: Any = ...) -> Any:
        value = key(name, default)
        if value is None and default is None:
            return None
        if type(value) is not int or not 1 <= value <= upper:
            raise bad(f"{arch}.{name}", value, f"a count from 1 to {upper}")
        return value

    def number(name: str, default: float) -> float:
        value = key(name, default)
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise bad(f"{arch}.{name}", value, "a positive number")
        return float(value)

    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise QuickdraftError(f"{g.path.name}: no token_embd.weight tensor")
    if len(embd.shape) != 2:
        raise QuickdraftError(f"{g.path.name}: token_embd.weight has shape {list(embd.shape)}, not (hidden, vocab)")
    widest = max(max(t.shape) for t in g.tensors.values())  # no size in the config may exceed it
    hidden, vocab = embd.shape  # ggml lists (hidden, vocab)
    layers = _layers(g)
    if count("block_count", widest) != layers:
        raise QuickdraftError(f"{g.path.name}: GGUF metadata {arch}.block_count = {key('block_count')} but the file "
                              f"has tensors for {layers} layers")
    if count("embedding_length", widest) != hidden:
        raise QuickdraftError(f"{g.path.name}: GGUF metadata {arch}.embedding_length = {key('embedding_length')} "
                              f"but token_embd.weight has {hidden} columns")
    n_heads = count("attention.head_count", hidden)
    head_dim = (count("attention.key_length", widest, None) or count("rope.dimension_count", widest, None)
                or hidden // n_heads)
    if count("rope.dimension_count", widest, head_dim) != head_dim or count("attention.value_length", widest,
                                                                          head_dim) != head_dim:
        raise UnsupportedModelError(f"{g.path.name}: partial rotary or value heads of another size are not supported")
    theta = number("rope.freq_base", 10000.0)
    tok = "tokenizer.ggml."
    special = {}
    for name in ("bos", "eos", "eot", "eom"):
        value = meta.get(f"{tok}{name}_token_id")
        if value is not None and (type(value) is not int or not 0 <= value < vocab):
            raise bad(f"{tok}{name}_token_id", value, f"a token id below the vocabulary's {vocab}")
        special[name] = value
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": count("feed_forward_length", widest),
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": count("attention.head_count_kv", n_heads, n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": count("context_length", MAX_CONTEXT, 2048),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(g, theta, head_dim),
        "tie_word_embeddings": "output.weight" not in g.tensors,  # llama.cpp writes no copy of a tied head
        "mlp_bias": "blk.0.ffn_gate.bias" in g.tensors,
        "bos_token_id": special["bos"],
        "eos_token_id": special["eos"],
        "torch_dtype": _natural_dtype(g),
    }
    if arch != "qwen2":  # qwen2 always has q/k/v biases
        cfg["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
    return cfg


def check_tensors(g: GGUFContents, cfg: ModelConfig) -> dict[str, str]:
    """Before any tensor is read: the file holds exactly the tensors `cfg`'s model has, each of
    the shape it expects (so what is dequantised is bounded by the declared model, and an unknown
    or misshapen entry is an error, not memory). Returns Hugging Face name -> GGUF name."""
    names: dict[str, str] = {}
    for name in g.tensors:
        if name == _ROPE_FREQS:
            continue  # read into the config
        hf = hf_name(name)
        if hf in names:
            raise QuickdraftError(f"{g.path.name}: GGUF tensors {_show(names[hf])} and {_show(name)} are both {_show(hf)}")
        names[hf] = name
    expected = expected_shapes(cfg)
    unexpected = sorted(names.keys() - expected.keys())
    if unexpected:
        raise UnsupportedModelError(f"{g.path.name}: unexpected tensors for {cfg.model_type}: "
                                    f"{', '.join(_show(names[n]) for n in unexpected[:5])}" + (" ..." if len(unexpected) > 5 else ""))
    missing = sorted(expected.keys() - names.keys())
    if missing:
        raise QuickdraftError(f"{g.path.name}: missing tensors: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    for hf, shape in expected.items():
        t = g.tensors[names[hf]]
        if t.hf_shape != shape:
            raise QuickdraftError(f"{g.path.name}: tensor {_show(t.name)} has shape {t.hf_shape}, the config implies {shape}")
    return names


def _rope_scaling(g: GGUFContents, theta: float, head_dim: int) -> dict[str, Any] | None:
    kind = g.metadata.get(f"{g.arch}.rope.scaling.type", "none")
    if not isinstance(kind, str):
        raise QuickdraftError(f"{g.path.name}: GGUF metadata {g.arch}.rope.scaling.type is not a name")
    if _ROPE_FREQS in g.tensors:
        if kind != "none":
            raise UnsupportedModelError(f"{g.path.name}: rope_freqs.weight together with rope scaling {kind!r}")
        return _llama3_rope(g, theta, head_dim)
    if kind == "none":
        return None
    if kind == "linear":
        factor = g.metadata.get(f"{g.arch}.rope.scaling.factor")
        if type(factor) not in (int, float) or not 0 < factor < math.inf:
            raise QuickdraftError(f"{g.path.name}: GGUF metadata {g.arch}.rope.scaling.factor = {factor!r} is not "
                                  "a positive number")
        return {"rope_type": "linear", "factor": float(factor)}
    raise UnsupportedModelError(f"{g.path.name}: unsupported rope scaling {kind!r} (supported: none, linear, llama3)")


def _llama3_rope(g: GGUFContents, theta: float, head_dim: int) -> dict[str, Any] | None:
    """llama.cpp stores Llama 3.1's rope scaling as the divisor of each frequency, not as its
    parameters. Recover them (factor: the largest divisor; Llama 3's band edges, 1 and 4) and
    accept them only if they reproduce every stored divisor."""
    if g.tensors[_ROPE_FREQS].shape != (head_dim // 2,):
        raise UnsupportedModelError(f"{g.path.name}: rope_freqs.weight has shape {list(g.tensors[_ROPE_FREQS].shape)}, "
                                    f"not ({head_dim // 2},)")
    stored = _dequantize(g.tensors[_ROPE_FREQS]).double()  # (head_dim / 2,)
    if torch.allclose(stored, torch.ones_like(stored)):
        return None
    original = g.metadata.get(f"{g.arch}.rope.scaling.original_context_length", 8192)
    if type(original) is not int or not 1 <= original <= MAX_CONTEXT:
        raise QuickdraftError(f"{g.path.name}: GGUF metadata {g.arch}.rope.scaling.original_context_length = "
                              f"{_show(str(original))} is not a context length")
    factor = float(stored.max())
    if not math.isfinite(factor) or factor <= 0:
        raise UnsupportedModelError(f"{g.path.name}: rope_freqs.weight is not a Llama 3 rope schedule")
    rope = RopeConfig(theta=theta, kind="llama3", factor=factor, original_max_position_embeddings=original)
    implied = rope_inv_freq(RopeConfig(theta=theta), head_dim).double() / rope_inv_freq(rope, head_dim).double()
    if stored.shape != implied.shape or not torch.allclose(stored, implied, rtol=1e-3):
        raise UnsupportedModelError(f"{g.path.name}: rope_freqs.weight is not a Llama 3 rope schedule")
    return {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings}


def _natural_dtype(g: GGUFContents) -> str:
    """The dtype `dtype=None` picks on an accelerator: the file's own float type, else bfloat16."""
    kinds = {t.tensor_type.name for t in g.tensors.values() if len(t.shape) == 2}
    return {frozenset({"F32"}): "float32", frozenset({"F16"}): "float16"}.get(frozenset(kinds), "bfloat16")


# --- weights --------------------------------------------------------------------------------

# Block layouts dequantised here in torch (the rest by gguf.quants, in numpy): bytes per block of
# 32 values, and where the scale, the minimum and the packed values sit in it.
_BLOCKS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _dequantize(t: GGUFTensor) -> torch.Tensor:
    """One GGUF tensor as float32, in Hugging Face's (out_features, in_features) order."""
    kind = t.tensor_type.name
    raw = torch.from_numpy(t.data)  # uint8 (rows, bytes per row), a view of the file's map
    if kind == "F32":
        values = raw.view(torch.float32).clone()
    elif kind in ("F16", "BF16"):
        values = raw.view(torch.float16 if kind == "F16" else torch.bfloat16).float()
    elif kind in _BLOCKS:
        blocks = raw.reshape(-1, _BLOCKS[kind])
        d = blocks[:, 0:2].view(torch.float16).float()
        if kind == "Q8_0":
            values = blocks[:, 2:].view(torch.int8).float() * d
        else:
            qs = blocks[:, 2 if kind == "Q4_0" else 4:]
            q = torch.cat([qs & 0xF, qs >> 4], dim=1)  # low nibbles hold values 0-15, high ones 16-31
            if kind == "Q4_0":
                values = d * (q.float() - 8)
            else:
                values = d * q.float() + blocks[:, 2:4].view(torch.float16).float()
    else:
        from gguf.quants import dequantize

        values = torch.from_numpy(dequantize(t.data, t.tensor_type))
    return values.reshape(t.hf_shape)


FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")  # the 4-bit types whose blocks the int4 format keeps as they are


def _four_bit(t: GGUFTensor) -> bool:
    """Whether `t` is a matrix whose blocks the int4 format keeps (`int4_groups`)."""
    return t.tensor_type.name in FOUR_BIT and len(t.shape) == 2


def int4_groups(t: GGUFTensor, codes: bool = False) -> tuple[torch.Tensor, ...] | None:
    """A Q4_0 / Q4_1 / Q4_K matrix in the int4 weight format's terms, without re-quantising: q in
    0..15 (out, in) uint8, scale and zero (out, in / 32) float32 with w = (q - 8) * scale + zero.
    Q4_0 stores w = d (q - 8); Q4_1 w = d q + m; Q4_K, per 32 values of a 256-value block,
    w = (d sc) q - (dmin m) with 6-bit sc and m. With `codes`, a Q4_K matrix comes as the int4
    kernel's super-block layout takes it (`kernels.pack_int4_super`): (q, sc uint8, -m int8
    (out, in / 32), d, dmin (out, in / 256) float32). None for any other type."""
    if not _four_bit(t):
        return None
    kind = t.tensor_type.name
    out_f, in_f = t.hf_shape
    raw = torch.from_numpy(t.data)
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)  # d, dmin (f16), 12 bytes of packed 6-bit scales and mins, 128 of nibbles
        d, dmin = (blocks[:, i:i + 2].view(torch.float16).float() for i in (0, 2))
        sc, m = (torch.from_numpy(np.ascontiguousarray(a)).float() for a in Q4_K.get_scale_min(blocks[:, 4:16].numpy()))
        shifts = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
        q = ((blocks[:, 16:].reshape(-1, 4, 1, 32) >> shifts) & 0xF).reshape(-1, 32)  # 64 values per 32 bytes: low then high nibbles
        if codes:
            return (q.reshape(out_f, in_f), sc.to(torch.uint8).reshape(out_f, in_f // 32),
                    m.neg().to(torch.int8).reshape(out_f, in_f // 32), d.reshape(out_f, in_f // 256),
                    dmin.reshape(out_f, in_f // 256))
        scale, low = d * sc, dmin * m  # (blocks, 8): per 32 values
        zero = 8 * scale - low
    else:
        blocks = raw.reshape(-1, _BLOCKS[kind])
        scale = blocks[:, 0:2].view(torch.float16).float()
        qs = blocks[:, 2 if kind == "Q4_0" else 4:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=1)
        zero = torch.zeros_like(scale) if kind == "Q4_0" else blocks[:, 2:4].view(torch.float16).float() + 8 * scale
    return q.reshape(out_f, in_f), scale.reshape(out_f, in_f // 32), zero.reshape(out_f, in_f // 32)


def four_bit_type(path: str | Path) -> str | None:
    """The 4-bit type (Q4_0 / Q4_1 / Q4_K) most of a GGUF's layer matrices are stored in, or None
    when most are wider: a self-draft in 4 bits of such a target would be the target itself."""
    kinds = [t.tensor_type.name for n, t in read_gguf(path).tensors.items()
             if n.startswith("blk.") and len(t.shape) == 2]
    four = [k for k in kinds if k in FOUR_BIT]
    return max(set(four), key=four.count) if kinds and 2 * len(four) > len(kinds) else None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of llama's q/k rows (weights and biases), which interleaves
    the two rotary halves of each head for ggml's rope: rows (head, pair, half) -> (head, half, pair)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(name: str) -> str:
    """The Hugging Face parameter name of GGUF tensor `name` (unknown tensors keep theirs, so the
    loader's unexpected-tensor check names them)."""
    base, _, kind = name.rpartition(".")
    parts = base.split(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    return name


def permuted_heads(g: GGUFContents, cfg: ModelConfig, name: str) -> int | None:
    """The number of heads whose rows llama.cpp permuted in GGUF tensor `name` (llama's q / k), else None."""
    part = name.rpartition(".")[0].split(".")[-1]
    if g.arch == "llama" and part in ("attn_q", "attn_k"):
        return cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads
    return None


def gguf_state_dict(g: GGUFContents, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                    int4: dict[str, tuple[torch.Tensor, ...]] | None = None,
                    deferred: dict[str, Callable[[], torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """Every weight, dequantised, under its Hugging Face name. Unknown tensors keep their GGUF
    name, so the loader's unexpected-tensor check names them. With `int4` (a dict), the 4-bit
    matrices' blocks are put there too, under the same names (see `int4_groups`). With `deferred`
    (a dict) as well, a linear layer's 4-bit matrix is not read here: its entry is a placeholder
    of its shape holding no memory, its `int4` entry a function that reads its blocks, and
    `deferred[name]()` reads its float weight, for `quant.make_linear` where it does not run the
    blocks as they are (a 1.7B Q4_0 file: most of the load time and a float32 copy spared, and the
    blocks unpacked one layer at a time)."""
    linear = quantised_weights(cfg) if int4 is not None and deferred is not None else set()
    state: dict[str, torch.Tensor] = {}
    for hf, name in check_tensors(g, cfg).items():  # every entry checked before any is read
        t = g.tensors[name]
        n_head = permuted_heads(g, cfg, name)
        four = int4 is not None and _four_bit(t)
        read = lambda t=t, n_head=n_head: _float_weight(t, n_head).to(device=device, dtype=dtype)  # noqa: E731
        if four and hf in linear:
            state[hf] = torch.zeros((), dtype=dtype, device=device).expand(t.hf_shape)
            deferred[hf] = read
            int4[hf] = lambda t=t, n_head=n_head: _groups(t, n_head, device)
        else:
            state[hf] = read()
            if four:
                int4[hf] = _groups(t, n_head, device)
    return state


def _groups(t: GGUFTensor, n_head: int | None, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """4-bit matrix `t`'s int4 groups (`int4_groups`; Q4_K's as codes and factors), q / k rows
    un-permuted over `n_head` heads."""
    groups = int4_groups(t, codes=True)
    if n_head is not None:
        groups = tuple(_unpermute(x, n_head) for x in groups)
    return tuple(x.to(device) for x in groups)


def _float_weight(t: GGUFTensor, n_head: int | None) -> torch.Tensor:
    """Tensor `t` dequantised to float32, q / k un-permuted over `n_head` heads."""
    w = _dequantize(t)
    return w if n_head is None else _unpermute(w, n_head)


# --- parts of tensors (tensor parallelism: each rank reads its own) --------------------------

def _rows(t: GGUFTensor, start: int, stop: int) -> GGUFTensor:
    """Rows start:stop of a matrix, as raw blocks: every type stores a row as whole blocks, so
    this is one contiguous byte range of the file."""
    return GGUFTensor(t.name, t.tensor_type, (t.shape[0], stop - start), t.data[start:stop])


def _columns(t: GGUFTensor, start: int, stop: int) -> GGUFTensor | None:
    """Columns (input features) start:stop of a matrix as raw blocks, when both ends fall on the
    type's block boundaries (32 values for Q8_0 / Q4_0 / Q4_1 / Q5_x, 256 for K-quants, any for
    F32 / F16 / BF16); None otherwise."""
    gguf = _gguf_package()
    block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
    if start % block or stop % block:
        return None
    data = np.ascontiguousarray(t.data[:, start // block * block_bytes: stop // block * block_bytes])
    return GGUFTensor(t.name, t.tensor_type, (stop - start, *t.shape[1:]), data)


def _cut_groups(t: GGUFTensor, groups: tuple[torch.Tensor, ...], start: int, stop: int) -> tuple[torch.Tensor, ...]:
    """Columns start:stop of int4 groups (q per value; scale, zero per 32 values; Q4_K's codes per
    32 values and factors per 256, kept where both ends fall on 256-value blocks, else as scales and
    zeros); an error unless both ends fall on the 32-value groups (a group cannot be split between
    ranks)."""
    if start % 32 or stop % 32:
        raise QuickdraftError(f"{t.name}: columns {start}:{stop} cut its 32-value int4 groups, so its 4-bit blocks "
                              "cannot be kept under this tensor parallelism: use fewer ranks, or quantization None "
                              "or int8")
    if len(groups) == 5:
        if start % 256 == 0 and stop % 256 == 0:
            q, codes_s, codes_o, factor_s, factor_o = groups
            return (q[:, start:stop], codes_s[:, start // 32:stop // 32], codes_o[:, start // 32:stop // 32],
                    factor_s[:, start // 256:stop // 256], factor_o[:, start // 256:stop // 256])
        from .formats import int4_zero_form

        groups = int4_zero_form(groups)
    q, scale, zero = groups
    return q[:, start:stop], scale[:, start // 32:stop // 32], zero[:, start // 32:stop // 32]


def read_part(t: GGUFTensor, n_head: int | None, rows: tuple[int, int] | None = None,
              cols: tuple[int, int] | None = None, int4: bool = False):
    """Rows and/or columns of GGUF tensor `t` in Hugging Face order (q / k un-permuted over
    `n_head` heads), dequantised to float32, or with `int4` its int4 groups (`int4_groups`, Q4_K's
    as codes and factors; None when `t` is not a 4-bit matrix; an error when the columns cut its
    32-value groups).

    Only the needed bytes are read where the format allows:
    - rows: the rows' blocks only (a contiguous byte range). For q / k, whole heads' rows are
      taken and un-permuted per head (the permutation stays within each head, so this equals
      un-permuting the whole tensor and slicing); a row range that is not whole heads is cut
      from the fully un-permuted tensor instead.
    - columns: each row's blocks that the range covers, when its ends are multiples of the
      type's block size (see `_columns`); otherwise every row is dequantised fully and cut.
      Either way a column range reads every row (only its own part of each where aligned).
    1-D tensors (norms, biases) are small: read whole, then cut."""
    convert = (lambda x: int4_groups(x, codes=True)) if int4 else _dequantize
    if len(t.shape) != 2:
        if int4:
            return None
        w = _dequantize(t)
        if n_head is not None:
            w = _unpermute(w, n_head)
        return w if rows is None else w[rows[0]:rows[1]]
    cut_after = None
    if rows is not None:
        head = t.hf_shape[0] // n_head if n_head else 1
        if rows[0] % head or rows[1] % head:
            cut_after = rows  # not whole heads: un-permute everything, then cut
        else:
            t = _rows(t, *rows)
            n_head = n_head and (rows[1] - rows[0]) // head
    if cols is not None:
        part = _columns(t, *cols)
        if part is None:
            w = convert(t)
            if w is None:
                return None
            w = _cut_groups(t, w, *cols) if int4 else w[:, cols[0]:cols[1]]
        else:
            w = convert(part)
    else:
        w = convert(t)
    if w is None:
        return None
    if n_head is not None:
        w = tuple(_unpermute(x, n_head) for x in w) if int4 else _unpermute(w, n_head)
    if cut_after is not None:
        w = tuple(x[cut_after[0]:cut_after[1]] for x in w) if int4 else w[cut_after[0]:cut_after[1]]
    return w


class GGUFWeights:
    """A GGUF's weights under Hugging Face names, opened like safetensors' `safe_open`:
    `keys()`, `get_tensor(name)`, and `get_slice(name)[a:b]` (rows) / `[:, a:b]` (columns)
    reading only that part (`read_part`), as float32. `get_slice(name).int4(rows, cols)`: the
    4-bit blocks of that part (see `int4_groups`), or None."""

    def __init__(self, path: str | Path, cfg: ModelConfig | None = None):
        self.g = read_gguf(path)
        self.cfg = cfg or ModelConfig.from_hf(hf_config(self.g))
        self._names = check_tensors(self.g, self.cfg)

    def __enter__(self) -> GGUFWeights:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self._names)

    def get_slice(self, name: str) -> GGUFSlice:
        gname = self._names[name]
        return GGUFSlice(self.g.tensors[gname], permuted_heads(self.g, self.cfg, gname))

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]


class GGUFSlice:
    """One tensor of a `GGUFWeights`, read in part: [:], [a:b] (rows), [:, a:b] (columns)."""

    def __init__(self, t: GGUFTensor, n_head: int | None):
        self.t, self.n_head = t, n_head

    def get_shape(self) -> list[int]:
        return list(self.t.hf_shape)

    def _span(self, key: Any, dim: int) -> tuple[int, int] | None:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"GGUF tensors are read by contiguous slices, not {key!r}")
        start, stop, _ = key.indices(self.t.hf_shape[dim])
        if (start, stop) == (0, self.t.hf_shape[dim]):
            return None
        return start, max(start, stop)

    def _key(self, key: Any) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        if isinstance(key, tuple):
            if len(key) != 2 or len(self.t.hf_shape) != 2:
                raise TypeError(f"GGUF tensor {self.t.name}: cannot index {len(self.t.hf_shape)}-D data by {key!r}")
            return self._span(key[0], 0), self._span(key[1], 1)
        return self._span(key, 0), None

    def __getitem__(self, key: Any) -> torch.Tensor:
        return read_part(self.t, self.n_head, *self._key(key))

    def int4(self, key: Any = slice(None)) -> tuple[torch.Tensor, ...] | None:
        return read_part(self.t, self.n_head, *self._key(key), int4=True)


def load_gguf_model(path: str | Path, dtype: str | torch.dtype | None = None,
                    device: str | torch.device | None = None, quantization: str | None = None) -> Transformer:
    """Load a GGUF's weights, dequantised into `dtype`. `model(input_ids)` (B, T) -> logits (B, T, vocab).
    With quantization="int4", each Q4_0 / Q4_1 / Q4_K matrix keeps its own blocks (the
    parameter's `gguf_int4` attribute: the groups, or for a linear layer's a function that reads
    them), which `quant.prepare` packs as they are; a linear layer's is not dequantised unless
    `quant.prepare` asks (the parameter's `gguf_deferred`: it holds a placeholder until then)."""

    g = read_gguf(path)
    cfg = ModelConfig.from_hf(hf_config(g))
    dev = resolve_device(device)
    int4: dict[str, tuple[torch.Tensor, ...]] | None = {} if quantization == "int4" else None
    deferred: dict[str, Callable[[], torch.Tensor]] = {}
    model = assemble(cfg, gguf_state_dict(g, cfg, resolve_dtype(dtype, cfg, dev), dev, int4, deferred), g.path)
    for name, groups in (int4 or {}).items():
        model.get_parameter(name).gguf_int4 = groups
    for name, read in deferred.items():
        model.get_parameter(name).gguf_deferred = read
    if int4 is not None:
        mark_wide(model)
    return model


def mark_wide(model: torch.nn.Module) -> None:
    """Under quantization="int4", mark the matrices a GGUF stores wider than 4 bits (no 4-bit
    blocks of their own): `quant.make_linear` runs them in int8 instead of rounding them to 4 bits."""
    for p in model.parameters():
        if p.dim() == 2 and getattr(p, "gguf_int4", None) is None:
            p.gguf_wide = True


# --- folders --------------------------------------------------------------------------------

def metadata_files(g: GGUFContents, config: dict[str, Any]) -> dict[str, str]:
    """File name -> text of a checkpoint folder's small files (the tokenizer's only if the GGUF has one)."""
    from .gguf_tokenizer import build_tokenizer

    meta = g.metadata
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]  # llama.cpp stops on each
    generation = {"bos_token_id": config["bos_token_id"],
                  "eos_token_id": list(dict.fromkeys(i for i in eos if i is not None))}
    files = {"config.json": json.dumps(config, indent=2), "generation_config.json": json.dumps(generation, indent=2)}
    try:
        tokenizer = build_tokenizer(meta)
        if tokenizer is not None:
            files["tokenizer.json"] = tokenizer.tokenizer_json
            files["tokenizer_config.json"] = json.dumps(tokenizer.config, indent=2, ensure_ascii=False)
    except QuickdraftError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tokenizers library's own errors on a malformed vocabulary
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise QuickdraftError(f"{g.path.name}: its tokenizer metadata is malformed ({_show(reason, 120)})") from None
    return files


def _identity(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_folder(dest: Path, files: dict[str, str], write_extra: Callable[[Path], None] | None = None) -> None:
    """Write `files` into a temporary sibling of `dest`, then rename: `dest` is never half-written."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if write_extra is not None:
            write_extra(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / GGUF_POINTER).exists():  # else another process wrote it first: keep theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_checkpoint_dir(path: str | Path) -> Path:
    """The metadata folder standing for GGUF `path` (config, tokenizer; weights stay in the GGUF)."""
    path = Path(path).expanduser().resolve()
    ident = _identity(path)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    folder = cache_dir() / "gguf" / key
    if (folder / GGUF_POINTER).exists():
        return folder
    g = read_gguf(path)
    files = metadata_files(g, hf_config(g))
    files[GGUF_POINTER] = json.dumps(ident, indent=2)
    try:
        _write_folder(folder, files)
    except OSError as exc:
        raise QuickdraftError(f"cannot write the metadata folder of {path.name} under {folder.parent} ({exc}); "
                              "set QUICKDRAFT_CACHE to a writable folder") from None
    return folder


def gguf_source(folder: str | Path) -> Path | None:
    """The GGUF a metadata folder stands for; None for an ordinary checkpoint folder."""
    pointer = Path(folder) / GGUF_POINTER
    if not pointer.exists():
        return None
    try:
        ident = json.loads(pointer.read_text())
        path = Path(ident["path"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise QuickdraftError(f"cannot read {pointer}: {exc}") from None
    if not path.is_file() or _identity(path) != ident:
        raise QuickdraftError(f"{path} changed or is gone since {folder} was written from it; load the .gguf again")
    return path


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str | torch.dtype | None = None) -> Path:
    """Write a Hugging Face checkpoint folder from a GGUF: model.safetensors (dequantised into
    `dtype`; None = the file's own float type, bfloat16 for quantised files), config.json,
    generation_config.json, tokenizer.json, tokenizer_config.json. Returns `out_dir`."""
    from safetensors.torch import save_file


    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QuickdraftError(f"{out} already exists and is not an empty folder")
    g = read_gguf(gguf_path)
    config = hf_config(g)
    cfg = ModelConfig.from_hf(config)
    torch_dtype = resolve_dtype(dtype or config["torch_dtype"], cfg, torch.device("cpu"))
    config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    state = gguf_state_dict(g, cfg, torch_dtype)
    if out.exists():
        out.rmdir()
    _write_folder(out, metadata_files(g, config),
                  lambda tmp: save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"}))
    return out
