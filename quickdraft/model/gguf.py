"""GGUF files (llama.cpp's single-file format) as checkpoints.

A GGUF carries the config and the tokenizer as metadata under llama.cpp's key names and the
weights as F32 / F16 / BF16 tensors or quantised blocks. The engine works from a Hugging Face
style folder, so a GGUF is met halfway:

- `gguf_checkpoint_dir(path)` writes the small files (config.json, generation_config.json,
  tokenizer.json, tokenizer_config.json) once into `<cache>/gguf/<key>/`, keyed by the file's
  path, size and mtime, plus `gguf.json` naming the file. Tokenizer, eos ids and chat template
  then come from that folder exactly as from any checkpoint.
- `load_gguf_model(path)` (what `load_model` does for a .gguf file or such a folder) reads the
  weights straight from the GGUF, dequantised at load into the requested dtype: no copy on disk.
- `convert_gguf(path, out_dir)` writes a complete Hugging Face folder (model.safetensors too).

Reading and dequantising are the `gguf` package's (GGUFReader, gguf.quants.dequantize). What is
ours: the name and metadata mapping, and undoing the row permutation llama.cpp's converter
applies to llama's q/k projections. Mistral files say architecture "llama" and load as Llama:
llama.cpp keeps no sliding window for them and attends to every key, and so do we.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig, RopeConfig
from ..errors import QuickdraftError, UnsupportedModelError
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
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor (data memory-mapped, read on demand)

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


def read_gguf(path: str | Path) -> GGUFContents:
    """Header and metadata of a GGUF; every failure is one QuickdraftError line."""
    gguf = _gguf_package()
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
        reader = gguf.GGUFReader(path, mode="c")  # copy-on-write map: writable arrays, file untouched
        metadata = {name: field.contents() for name, field in reader.fields.items()}
        tensors = {t.name: t for t in reader.tensors}
    except Exception as exc:  # a damaged file fails deep in numpy / enum / utf-8 parsing: one line, no traceback
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise QuickdraftError(f"{path} is truncated or corrupt: the gguf package cannot read it ({reason})") from None
    bad = sorted({t.tensor_type.name for t in tensors.values()} - set(TENSOR_TYPES))
    if bad:
        raise UnsupportedModelError(f"{path.name}: unsupported GGUF tensor type {', '.join(bad)} "
                                    f"(quickdraft reads {', '.join(TENSOR_TYPES)})")
    return GGUFContents(path, metadata, tensors)


# --- config ---------------------------------------------------------------------------------

def hf_config(g: GGUFContents) -> dict[str, Any]:
    """The Hugging Face config.json dict the metadata describes (what ModelConfig.from_hf takes)."""
    arch = g.arch
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{g.path.name}: unsupported GGUF architecture {arch!r} "
                                    f"(quickdraft loads {', '.join(ARCHITECTURES)}; Mistral files are llama)")
    meta = g.metadata

    def key(name: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is ...:
            raise QuickdraftError(f"{g.path.name}: GGUF metadata has no {arch}.{name}")
        if isinstance(value, list):  # per-layer values: we only build uniform layers
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"{g.path.name}: {arch}.{name} differs between layers")
            value = value[0]
        return value

    if "token_embd.weight" not in g.tensors:
        raise QuickdraftError(f"{g.path.name}: no token_embd.weight tensor")
    hidden, n_heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", None) or key("rope.dimension_count", None) or hidden // max(n_heads, 1)
    if key("rope.dimension_count", head_dim) != head_dim or key("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{g.path.name}: partial rotary or value heads of another size are not supported")
    theta = float(key("rope.freq_base", 10000.0))
    tok = "tokenizer.ggml."
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(g.tensors["token_embd.weight"].shape[1]),  # ggml lists (hidden, vocab)
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": key("context_length", 2048),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(g, theta, head_dim),
        "tie_word_embeddings": "output.weight" not in g.tensors,  # llama.cpp writes no copy of a tied head
        "mlp_bias": "blk.0.ffn_gate.bias" in g.tensors,
        "bos_token_id": meta.get(tok + "bos_token_id"),
        "eos_token_id": meta.get(tok + "eos_token_id"),
        "torch_dtype": _natural_dtype(g),
    }
    if arch != "qwen2":  # qwen2 always has q/k/v biases
        cfg["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
    return cfg


def _rope_scaling(g: GGUFContents, theta: float, head_dim: int) -> dict[str, Any] | None:
    kind = g.metadata.get(f"{g.arch}.rope.scaling.type", "none")
    if _ROPE_FREQS in g.tensors:
        if kind != "none":
            raise UnsupportedModelError(f"{g.path.name}: rope_freqs.weight together with rope scaling {kind!r}")
        return _llama3_rope(g, theta, head_dim)
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(g.metadata[f"{g.arch}.rope.scaling.factor"])}
    raise UnsupportedModelError(f"{g.path.name}: unsupported rope scaling {kind!r} (supported: none, linear, llama3)")


def _llama3_rope(g: GGUFContents, theta: float, head_dim: int) -> dict[str, Any] | None:
    """llama.cpp stores Llama 3.1's rope scaling as the divisor of each frequency, not as its
    parameters. Recover them (factor: the largest divisor; Llama 3's band edges, 1 and 4) and
    accept them only if they reproduce every stored divisor."""
    stored = _dequantize(g.tensors[_ROPE_FREQS]).double()  # (head_dim / 2,)
    if torch.allclose(stored, torch.ones_like(stored)):
        return None
    rope = RopeConfig(theta=theta, kind="llama3", factor=float(stored.max()), original_max_position_embeddings=int(
        g.metadata.get(f"{g.arch}.rope.scaling.original_context_length", 8192)))
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

def _dequantize(t: Any) -> torch.Tensor:
    """One GGUF tensor as float32, in Hugging Face's (out_features, in_features) order."""
    from gguf.quants import dequantize

    values = dequantize(t.data, t.tensor_type)
    if np.may_share_memory(values, t.data):  # F32 comes back as a view of the mapped file
        values = values.copy()
    return torch.from_numpy(values.reshape([int(d) for d in reversed(t.shape)]))  # ggml lists dims innermost first


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of llama's q/k rows (weights and biases), which interleaves
    the two rotary halves of each head for ggml's rope: rows (head, pair, half) -> (head, half, pair)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_state_dict(g: GGUFContents, cfg: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every weight, dequantised, under its Hugging Face name. Unknown tensors keep their GGUF
    name, so the loader's unexpected-tensor check names them."""
    state: dict[str, torch.Tensor] = {}
    for name, t in g.tensors.items():
        if name == _ROPE_FREQS:
            continue  # read into the config
        base, _, kind = name.rpartition(".")
        parts = base.split(".")
        hf_name = name
        if base in _GLOBAL_NAMES:
            hf_name = f"{_GLOBAL_NAMES[base]}.{kind}"
        elif len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
            hf_name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
        w = _dequantize(t)
        if g.arch == "llama" and parts[-1] in ("attn_q", "attn_k"):
            w = _unpermute(w, cfg.num_attention_heads if parts[-1] == "attn_q" else cfg.num_key_value_heads)
        state[hf_name] = w.to(device=device, dtype=dtype)
    return state


def load_gguf_model(path: str | Path, dtype: str | torch.dtype | None = None,
                    device: str | torch.device | None = None) -> Transformer:
    """Load a GGUF's weights, dequantised into `dtype`. `model(input_ids)` (B, T) -> logits (B, T, vocab)."""
    from .loader import assemble, resolve_device, resolve_dtype

    g = read_gguf(path)
    cfg = ModelConfig.from_hf(hf_config(g))
    dev = resolve_device(device)
    return assemble(cfg, gguf_state_dict(g, cfg, resolve_dtype(dtype, cfg, dev), dev), g.path)


# --- folders --------------------------------------------------------------------------------

def metadata_files(g: GGUFContents, config: dict[str, Any]) -> dict[str, str]:
    """File name -> text of a checkpoint folder's small files (the tokenizer's only if the GGUF has one)."""
    from .gguf_tokenizer import build_tokenizer

    meta = g.metadata
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]  # llama.cpp stops on each
    generation = {"bos_token_id": config["bos_token_id"],
                  "eos_token_id": list(dict.fromkeys(i for i in eos if i is not None))}
    files = {"config.json": json.dumps(config, indent=2), "generation_config.json": json.dumps(generation, indent=2)}
    tokenizer = build_tokenizer(meta)
    if tokenizer is not None:
        files["tokenizer.json"] = tokenizer.tokenizer_json
        files["tokenizer_config.json"] = json.dumps(tokenizer.config, indent=2, ensure_ascii=False)
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

    from .loader import resolve_dtype

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
