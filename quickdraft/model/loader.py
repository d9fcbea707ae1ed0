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

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..errors import QuickdraftError
from . import compressed
from .transformer import Transformer

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# Tensors some checkpoints carry that we recompute rather than load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """None: the checkpoint's dtype on an accelerator, float32 on CPU (half-precision
    matmuls are slow on most CPUs and float32 keeps greedy output exact)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise QuickdraftError(f"unsupported dtype {dtype}: use float32, bfloat16 or float16")
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(str(cfg.torch_dtype), torch.float32) if cfg.torch_dtype else torch.float32
    if dtype not in _DTYPES:
        raise QuickdraftError(f"unsupported dtype {dtype!r}: use float32, bfloat16 or float16")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        if torch.cuda.is_available():  # also true for ROCm builds
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as exc:
        raise QuickdraftError(f"device {device!r} is not available: {exc}") from None
    return dev


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
                    state[name] = f.get_tensor(name).to(device=dev, dtype=torch_dtype)
        except (OSError, RuntimeError, ValueError) as exc:
            if isinstance(exc, QuickdraftError):
                raise
            raise QuickdraftError(f"cannot read weights {file}: {exc}") from None
    return assemble(cfg, state, path)


@contextlib.contextmanager
def _no_init():
    """Parameter initialisers as no-ops while a model is built on the meta device: its values are
    replaced by the checkpoint's anyway, and the first `normal_` on meta imports PyTorch's Python
    decompositions (~1-2 s of start-up, measured on SmolLM2)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def assemble(cfg: ModelConfig, state: dict[str, torch.Tensor], path: Path) -> Transformer:
    """A Transformer holding exactly `state` (Hugging Face parameter names, already on the
    device and in the dtype wanted): a missing, unexpected or misshapen tensor is an error."""
    with torch.device("meta"), _no_init():
        model = Transformer(cfg)
    expected = {name for name, _ in model.named_parameters()}  # tied lm_head is deduplicated
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if unexpected:
        raise QuickdraftError(
            f"{path}: unexpected tensors for {cfg.model_type} (unsupported option?): {', '.join(unexpected[:5])}"
            + (" ..." if len(unexpected) > 5 else ""))
    if missing:
        raise QuickdraftError(f"{path}: missing tensors: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    params = dict(model.named_parameters())
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise QuickdraftError(
                f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config implies {tuple(params[name].shape)}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_buffers()
    model.checkpoint_path = path
    return model.eval().requires_grad_(False)
