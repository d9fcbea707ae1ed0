"""From a state dict to a Transformer: the dtype and device a model loads into, and `assemble`,
which builds the module on the meta device and fills it with exactly the checkpoint's tensors.
Shared by every checkpoint reader (model/loader.py for safetensors folders, model/gguf.py,
parallel/shard.py), so none of them imports another for it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import QuickdraftError
from .transformer import Transformer

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

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


def meta_model(cfg: ModelConfig) -> Transformer:
    """The model's module tree on the meta device (no memory, no initialisation)."""
    with torch.device("meta"), _no_init():
        return Transformer(cfg)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the model `cfg` describes (built on the meta device: no memory),
    for a reader to check a checkpoint against before reading any tensor."""
    return {name: tuple(p.shape) for name, p in meta_model(cfg).named_parameters()}  # a tied lm_head is deduplicated


def quantised_weights(cfg: ModelConfig) -> set[str]:
    """The checkpoint names of the weights `quant.prepare` replaces: every nn.Linear's (a tied
    lm_head is the embedding's, which stays in the model's dtype)."""
    return {f"{name}.weight" for name, module in meta_model(cfg).named_modules()
            if isinstance(module, torch.nn.Linear) and not (cfg.tie_word_embeddings and name == "lm_head")}


def assemble(cfg: ModelConfig, state: dict[str, torch.Tensor], path: Path) -> Transformer:
    """A Transformer holding exactly `state` (Hugging Face parameter names, already on the
    device and in the dtype wanted): a missing, unexpected or misshapen tensor is an error."""
    model = meta_model(cfg)
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
