"""Local Hugging Face checkpoint folder (or GGUF file) -> Transformer.

Reads config.json, then weights from `model.safetensors` or a sharded
`model.safetensors.index.json` (float, or int8 with scales in the compressed-tensors layout:
quickdraft.model.compressed). Every tensor must be consumed and every parameter
filled: a missing or unexpected tensor is an error naming it.

A `.gguf` file stands for a folder too: `checkpoint_dir` turns it into a small metadata folder
(config, tokenizer, chat template; no weights) and `load_model` reads the weights straight from
the GGUF (quickdraft.model.gguf).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..errors import QuickdraftError
from . import compressed
from .build import assemble, meta_model, quantised_weights, resolve_device, resolve_dtype  # noqa: F401 - re-exported
from .transformer import Transformer

# Tensors some checkpoints carry that we recompute rather than load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint folder `path` names; for a GGUF file, its metadata folder (written once)."""
    from .gguf import gguf_checkpoint_dir, is_gguf_file

    path = Path(path).expanduser()
    if not path.exists():
        raise QuickdraftError(f"model folder not found: {path}")
    if is_gguf_file(path):
        return gguf_checkpoint_dir(path)
    if not path.is_dir():
        raise QuickdraftError(f"not a model folder or .gguf file: {path}")
    return path


def weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise QuickdraftError(f"cannot read {index}: {exc}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise QuickdraftError(f"{index.name} names shards that are missing: {', '.join(missing)}")
        return [path / f for f in files]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise QuickdraftError(f"{path} has only PyTorch pickle weights; quickdraft loads safetensors only")
    raise QuickdraftError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_model(path: str | Path, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, quantization: str | None = None) -> Transformer:
    """Load a Llama-family checkpoint folder or GGUF file. Returns the module in eval mode.

    `model(input_ids)` with input_ids (B, T) returns logits (B, T, vocab). `quantization` is what
    `quant.prepare` will be asked for: with "int4", a GGUF's 4-bit blocks are kept for it.
    """
    from .gguf import gguf_source, is_gguf_file, load_gguf_model

    path = Path(path).expanduser()
    if is_gguf_file(path):
        return load_gguf_model(path, dtype=dtype, device=device, quantization=quantization)
    path = checkpoint_dir(path)
    source = gguf_source(path)  # a GGUF's metadata folder: the weights are in the GGUF
    if source is not None:
        return load_gguf_model(source, dtype=dtype, device=device, quantization=quantization)
    cfg = ModelConfig.from_file(path / "config.json")
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, cfg, dev)

    quantised = compressed.scheme(json.loads((path / "config.json").read_text()))
    keep = quantised_weights(cfg) if _quantises_from_checkpoint(quantization, dev, torch_dtype) else set()
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                f = compressed.open_weights(handle, file, quantised)
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if cfg.tie_word_embeddings and name == "lm_head.weight":
                        continue  # tied: the embedding is the head
                    tensor = f.get_tensor(name)
                    if not (name in keep and tensor.dtype in _HALF):
                        tensor = tensor.to(device=dev, dtype=torch_dtype)
                    state[name] = tensor
        except (OSError, RuntimeError, ValueError) as exc:
            if isinstance(exc, QuickdraftError):
                raise
            raise QuickdraftError(f"cannot read weights {file}: {exc}") from None
    return assemble(cfg, state, path)


_HALF = (torch.bfloat16, torch.float16)


def _quantises_from_checkpoint(quantization: str | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the linear weights `quant.prepare` will quantise stay in the checkpoint's 16-bit
    type until it does (CPU, int8 / int4, a float32 model): a 1.7B model's float32 copy is 6.8 GB,
    and the quantisers widen a 16-bit weight exactly, so the quantised bits are the same."""
    return quantization in ("int8", "int4") and device.type == "cpu" and dtype == torch.float32
