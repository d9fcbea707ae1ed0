"""int8 weight-only quantisation of a model's linear layers (per output channel, symmetric).

Each nn.Linear becomes an Int8Linear holding int8 weights and one scale per output row;
activations stay in the model's dtype. On CPU and CUDA (and MPS where PyTorch has it) the
matmul is PyTorch's int8-weight kernel (`torch._weight_int8pack_mm`, as gpt-fast uses);
elsewhere the weight is dequantised for the matmul. The embedding is kept as it is.

Used for drafts (speculative decoding stays lossless with respect to the target: a
quantised draft only changes how often its guesses are accepted) and optionally for the
target, in which case the output follows the quantised target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import QuickdraftError

QUANTIZATIONS = ("none", "int8")


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # (out,)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        dtype = linear.weight.dtype
        self.register_buffer("weight", q)
        self.register_buffer("scales", scale.to(dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._fused = None  # whether the fused kernel works here; found out on the first call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out = None
        if self._fused is not False:
            try:
                out = torch._weight_int8pack_mm(x2, self.weight, self.scales.to(x.dtype))
                self._fused = True
            except (RuntimeError, AttributeError, NotImplementedError):
                self._fused = False  # no kernel for this device / dtype: dequantise instead
        if out is None:
            out = F.linear(x2, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize(model: nn.Module, method: str | None) -> nn.Module:
    """Replace the model's linear layers in place (method "int8"); "none"/None does nothing."""
    if method in (None, "none"):
        return model
    if method != "int8":
        raise QuickdraftError(f"unknown quantization {method!r}; choose one of {', '.join(QUANTIZATIONS)}")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and persistent buffers (tied tensors counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + [b for b in model.buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
