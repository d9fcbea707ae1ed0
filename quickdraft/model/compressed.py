"""Checkpoints whose weights are stored as int8 with group-wise scales, in the compressed-tensors
layout (`quantization_config.quant_method == "compressed-tensors"`, format "int-quantized" or
"naive-quantized"), as llm-compressor writes W8A16 models and vLLM and transformers load them.

A quantised weight `X.weight` is stored as int8 (out, in) beside `X.weight_scale`
(out, in / group_size), symmetric (no zero point): the value is `weight * scale` per group of
`group_size` inputs ("group" strategy) or per output row ("channel"). quickdraft dequantises at
load into the dtype asked for, so the model computes as a float checkpoint whose weights are
those products; `--quantization int8` then re-quantises for the CPU kernels as for any model.

The bundled models ship this way (a quarter of float32's bytes, half of bfloat16's), written by
`quantize_folder(SRC, DST, group_size=64)`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import QuickdraftError, UnsupportedModelError

SCALE = "_scale"  # suffix of a quantised weight's scales: X.weight -> X.weight_scale
FORMATS = ("int-quantized", "naive-quantized")


@dataclass(frozen=True)
class Int8Scheme:
    group_size: int | None  # inputs per scale; None: one scale per output row ("channel")


def scheme(config: dict) -> Int8Scheme | None:
    """The int8 scheme a config.json declares; None for an unquantised checkpoint. Any other
    quantisation (GPTQ, AWQ, bitsandbytes, fp8, 4-bit compressed-tensors...) is a clear error."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise UnsupportedModelError(f"unsupported quantization_config quant_method {method!r}: quickdraft "
                                    "loads float checkpoints, GGUF files and compressed-tensors int8 weights")
    fmt = qc.get("format")
    if fmt not in FORMATS:
        raise UnsupportedModelError(f"unsupported compressed-tensors format {fmt!r} (supported: {', '.join(FORMATS)})")
    groups = list((qc.get("config_groups") or {}).values())
    sizes = set()
    for g in groups:
        w = g.get("weights") or {}
        if g.get("input_activations") or g.get("output_activations"):
            raise UnsupportedModelError("unsupported compressed-tensors scheme: quantised activations (only weights)")
        if w.get("num_bits") != 8 or w.get("type", "int") != "int" or not w.get("symmetric", True):
            raise UnsupportedModelError(
                f"unsupported compressed-tensors weights {w}: only symmetric 8-bit int weights are loaded")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise UnsupportedModelError(f"unsupported compressed-tensors strategy {strategy!r} (group or channel)")
        sizes.add(w.get("group_size") if strategy == "group" else None)
    if len(sizes) != 1:
        raise UnsupportedModelError("unsupported compressed-tensors config: one weight scheme expected, "
                                    f"found {len(groups)} groups with group sizes {sorted(map(str, sizes))}")
    return Int8Scheme(group_size=sizes.pop())


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, name: str = "") -> torch.Tensor:
    """(out, in) int8 times (out, in / g) scales, in float32, then cast to `dtype`."""
    if q.dtype != torch.int8 or q.dim() != 2 or scale.dim() != 2 or scale.shape[0] != q.shape[0] \
            or scale.shape[1] == 0 or q.shape[1] % scale.shape[1]:
        raise QuickdraftError(f"{name}: int8 weight {tuple(q.shape)} {q.dtype} does not match its scales "
                              f"{tuple(scale.shape)}")
    g = q.shape[1] // scale.shape[1]
    w = q.float().view(q.shape[0], -1, g) * scale.float().unsqueeze(-1)
    return w.view(q.shape).to(dtype)


class Int8Reader:
    """A safetensors handle (safe_open) over a compressed-tensors file, read as the float
    checkpoint it stands for: `keys()` lists no scales, `get_tensor` and `get_slice` give
    dequantised float32 weights (unquantised tensors as stored)."""

    def __init__(self, handle, path: Path):
        self.f, self.path = handle, path
        names = set(handle.keys())
        self.quantised = {n[: -len(SCALE)] for n in names if n.endswith(SCALE) and n[: -len(SCALE)] in names}
        self._keys = [n for n in handle.keys() if not (n.endswith(SCALE) and n[: -len(SCALE)] in names)]

    def keys(self):
        return list(self._keys)

    def get_tensor(self, name: str) -> torch.Tensor:
        if name not in self.quantised:
            return self.f.get_tensor(name)
        return dequantize(self.f.get_tensor(name), self.f.get_tensor(name + SCALE), torch.float32, f"{self.path}: {name}")

    def get_slice(self, name: str):
        if name not in self.quantised:
            return self.f.get_slice(name)
        return _Slice(self, name)


class _Slice:
    """`get_slice(name)[rows, cols]` of a quantised weight: the rows' int8 values and scales are
    read, dequantised, then the columns cut (a column range need not fall on scale groups)."""

    def __init__(self, reader: Int8Reader, name: str):
        self.reader, self.name = reader, name

    def get_shape(self):
        return self.reader.f.get_slice(self.name).get_shape()

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        rows, cols = (key + (slice(None),) * 2)[:2]
        f = self.reader.f
        q, s = f.get_slice(self.name)[rows, :], f.get_slice(self.name + SCALE)[rows, :]
        return dequantize(q, s, torch.float32, f"{self.reader.path}: {self.name}")[:, cols]


def transformers_kwargs(folder: str | Path) -> dict:
    """What transformers' from_pretrained needs to load `folder` as the float model quickdraft
    loads: for a compressed-tensors checkpoint, dequantised weights (the `compressed-tensors`
    package must be installed); nothing for another folder."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if scheme(config) is None:
        return {}
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(run_compressed=False)}


def open_weights(handle, path: Path, quantised: Int8Scheme | None):
    """The handle as the float checkpoint it stands for (itself when nothing is quantised)."""
    return handle if quantised is None else Int8Reader(handle, path)


# --- writing ---------------------------------------------------------------------------------

def quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per group of `group_size` inputs: (q int8, scale float16), the scale
    rounded to float16 before the weights are divided by it, so q * scale is what loads."""
    out, inp = w.shape
    if inp % group_size:
        raise QuickdraftError(f"a weight of {inp} inputs cannot be split into groups of {group_size}")
    g = w.float().view(out, inp // group_size, group_size)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-8).half()
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.view(out, inp), scale


def quantize_folder(src: str | Path, dst: str | Path, group_size: int = 64,
                    skip: tuple[str, ...] = ("norm", "d2t", "t2d")) -> dict:
    """Copy a checkpoint folder with every 2-D weight (linear layers and embeddings, not norms or
    vocabulary maps) stored as int8 + float16 group scales, and config.json's quantization_config
    saying so. Returns the size of the weights before and after."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise QuickdraftError("quantize_folder writes a new folder: give another destination")
    config = json.loads((src / "config.json").read_text())
    if scheme(config) is not None:
        raise QuickdraftError(f"{src} is quantised already")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(src / "model.safetensors"), framework="pt", device="cpu") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if t.dim() == 2 and t.is_floating_point() and name.endswith(".weight") and not any(s in name for s in skip):
                state[name], state[name + SCALE] = quantize(t, group_size)
            else:
                state[name] = t
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear", "Embedding"], "input_activations": None,
                                      "output_activations": None,
                                      "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": group_size,
                                                  "dynamic": False, "observer": "minmax"}}},
        "ignore": [], "kv_cache_scheme": None}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"bytes_before": (src / "model.safetensors").stat().st_size,
            "bytes_after": (dst / "model.safetensors").stat().st_size}

