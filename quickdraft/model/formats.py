"""The weight formats of inference linear layers: one `FastLinear` class per format and per
kernel that runs it, and the quantisers that make their weights. Which class a layer gets is
chosen once, by `quant.make_linear` when `quant.prepare` converts a loaded model; the rest of
the package asks the class what it needs (`row_invariant`, `kernel_rows`, `calls_kernels`,
`embeds_weights`, `export_blocker`, `bytes_read`, `dequantized`), never its buffers. See
`quant`'s doc for where each format runs and what it costs.

A new format is one more class here, chosen in `quant.make_linear` and named in
`quant.weight_format`.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..errors import QuickdraftError

INT4_GROUP = 32
# Rows above which a quantised matmul on PyTorch's weight-only kernels (CPUs without quickdraft's)
# converts its weight to bf16 and runs a dense GEMM (those are GEMV kernels: from ~16 rows on,
# conversion + the AMX/AVX512 GEMM wins; measured in benchmarks/results/cpu_kernels_*.json).
# quickdraft's blocked int8 / int4 kernels run every row count instead: a row's bits then never
# depend on the rows beside it (exact speculation, seeded requests independent of their batch),
# at a prefill cost (past ~64 rows conversion + dense GEMM is faster: at 256 rows about 2x per
# matmul, benchmarks/results/blocked_vs_dense_rows_cpu.txt).
DENSE_ROWS = 16
_KERNELS_ONLY = False  # set while exporting a step (quickdraft.aot): no branch on the row count


@contextlib.contextmanager
def kernels_only():
    """Quantised matmuls take their kernel path whatever the row count (a traced graph has one
    path; its caller keeps it to at most DENSE_ROWS rows)."""
    global _KERNELS_ONLY
    _KERNELS_ONLY = True
    try:
        yield
    finally:
        _KERNELS_ONLY = False


def has_kernel(op: str, device: torch.device) -> bool:
    """Whether this PyTorch build has a kernel for aten `op` on `device` (the weight-only matmuls
    exist for CPU, some for MPS, none for CUDA in PyTorch itself)."""
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS", "xpu": "XPU"}.get(device.type)
    try:
        return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)
    except (AttributeError, RuntimeError):
        return device.type == "cpu"


# Quantisers work through a weight this many elements at a time (16 MB of float32 temporaries),
# in place: a 16-bit checkpoint weight is never widened whole (a 1.7B model's float32 copy is
# 6.8 GB). Same bits as the whole-tensor expressions in their docstrings. (Much smaller chunks
# mean many small parallel ops, which crawl on an oversubscribed machine.)
_QUANT_CHUNK = 1 << 22


def _row_chunks(w: torch.Tensor):
    """(start row, float32 copy of the rows) over `w` (out, in), _QUANT_CHUNK elements at a time."""
    rows = max(1, _QUANT_CHUNK // max(1, w.shape[1]))
    for r in range(0, w.shape[0], rows):
        part = w[r:r + rows].detach()
        yield r, part.float() if part.dtype != torch.float32 else part.clone()


def int8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 (out, in), scale float32 (out,)):
    scale = max |w| / 127 per row (at least 1e-8 / 127), q = round(w / scale) in -127..127."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for r, c in _row_chunks(w):
        s = torch.maximum(c.amin(1).neg_(), c.amax(1)).clamp_(min=1e-8).div_(127.0)  # (aminmax: ~10x slower)
        q[r:r + len(c)] = c.div_(s[:, None]).round_().clamp_(-127, 127)
        scale[r:r + len(c)] = s
    return q, scale


def int4_quantize(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit: q in 0..15 (out, in) uint8, scale and zero (out, in/group)
    float32, with w ~ (q - 8) * scale + zero (the convention of PyTorch's int4 kernels): per group,
    lo / hi its least / largest weight, scale = (hi - lo) / 15 (at least 1e-8 / 15),
    q = round((w - lo) / scale) in 0..15, zero = lo + 8 * scale."""
    out_f, in_f = w.shape
    if in_f % group:
        raise QuickdraftError(f"int4 needs input sizes divisible by {group}; this layer has {in_f}")
    q = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    scale = torch.empty(out_f, in_f // group, dtype=torch.float32, device=w.device)
    zero = torch.empty_like(scale)
    for r, c in _row_chunks(w):
        n = len(c)
        cg = c.view(n, in_f // group, group)
        lo, hi = cg.amin(-1), cg.amax(-1)
        s = (hi - lo).clamp_(min=1e-8).div_(15)
        q[r:r + n] = cg.sub_(lo[..., None]).div_(s[..., None]).round_().clamp_(0, 15).view(n, in_f)
        scale[r:r + n], zero[r:r + n] = s, lo + 8 * s
    return q, scale, zero


INT4_SUPER = 8  # groups per super group in int4's super-block layout (kernels.SUPER)


def _float16_above(x: torch.Tensor) -> torch.Tensor:
    """The float16 values of x (>= 0), rounded up: never below x (a relative 2^-10 and an absolute
    2^-24 cover float16's rounding, normal or subnormal), as float32."""
    return (x * (1 + 2.0 ** -10) + 2.0 ** -24).half().float()


def int4_quantize_super(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Asymmetric group-wise 4-bit in the super-block layout (kernels.pack_int4_super; llama.cpp's
    Q4_K scheme with 8-bit codes): (q (out, in) uint8 in 0..15, scale codes (out, in / 32) uint8,
    offset codes int8, scale factors D and offset factors O (out, in / 256) float32 holding float16
    values), with w ~ q * (scale code * D) + offset code * O over each group of 32 inputs. Per super
    group of 8 groups: lo / hi each group's least / largest weight; O = max |lo| / 127 and the
    offset codes floor(lo / O), so a group's offset o = code * O <= lo (never above its least
    weight); its step s = (hi - o) / 15; D = max s / 255 and the scale codes ceil(s / D), so the
    step it gets covers the group (both factors rounded up to float16); q = round((w - o) / step)
    in 0..15. Costs a weight at most half a step of at most (hi - lo + O) / 15 + D."""
    out_f, in_f = w.shape
    span = INT4_GROUP * INT4_SUPER
    if in_f % span:
        raise QuickdraftError(f"int4's super-block layout needs input sizes divisible by {span}; this layer has {in_f}")
    groups = in_f // INT4_GROUP
    q = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    codes_s = torch.empty(out_f, groups, dtype=torch.uint8, device=w.device)
    codes_o = torch.empty(out_f, groups, dtype=torch.int8, device=w.device)
    factor_s = torch.empty(out_f, groups // INT4_SUPER, dtype=torch.float32, device=w.device)
    factor_o = torch.empty_like(factor_s)
    for r, c in _row_chunks(w):
        n = len(c)
        cg = c.view(n, groups, INT4_GROUP)
        lo, hi = cg.amin(-1), cg.amax(-1)  # (n, groups)
        o_f = _float16_above(lo.abs().view(n, -1, INT4_SUPER).amax(-1) / 127)  # (n, supers)
        o_each = o_f.repeat_interleave(INT4_SUPER, 1)
        co = torch.where(o_each > 0, torch.floor(lo / o_each.clamp(min=2.0 ** -24)), torch.zeros_like(lo)).clamp_(-127, 127)
        offset = co * o_each  # (exact: 8 bits times a float16)
        step = (hi - offset) / 15
        s_f = _float16_above(step.view(n, -1, INT4_SUPER).amax(-1) / 255)
        s_each = s_f.repeat_interleave(INT4_SUPER, 1)
        cs = torch.where(s_each > 0, torch.ceil(step / s_each.clamp(min=2.0 ** -24)), torch.zeros_like(step)).clamp_(0, 255)
        scale = cs * s_each
        inv = torch.where(scale > 0, 1 / scale.clamp(min=2.0 ** -40), torch.zeros_like(scale))
        q[r:r + n] = cg.sub_(offset[..., None]).mul_(inv[..., None]).round_().clamp_(0, 15).view(n, in_f)
        codes_s[r:r + n], codes_o[r:r + n] = cs, co
        factor_s[r:r + n], factor_o[r:r + n] = s_f, o_f
    return q, codes_s, codes_o, factor_s, factor_o


def int4_zero_form(groups: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int4 groups as (q, scale, zero), w = (q - 8) * scale + zero per group of 32: as they are, or
    from the super-block layout's (q, scale codes, offset codes, scale factors D, offset factors O)
    (a GGUF's Q4_K: scale = code * D, offset = code * O, both exact in float32)."""
    if len(groups) == 3:
        return groups
    q, codes_s, codes_o, factor_s, factor_o = groups
    scale = codes_s.float() * factor_s.repeat_interleave(INT4_SUPER, 1)
    return q, scale, codes_o.float() * factor_o.repeat_interleave(INT4_SUPER, 1) + 8 * scale


def int4_pack(w: torch.Tensor, group: int = INT4_GROUP, inner_k_tiles: int = 2):
    """w (out, in) in PyTorch's CPU int4 layout: (packed uint8, scales_and_zeros (in/group, out, 2)
    bfloat16) for `torch._weight_int4pack_mm_for_cpu`."""
    q, scale, zero = int4_quantize(w, group)
    return _int4_cpu_pack(q, scale, zero, inner_k_tiles)


def _int4_cpu_pack(q, scale, zero, inner_k_tiles: int = 2):
    pad = -q.shape[0] % 16  # the kernel packs output rows in sixteens: pad with zero rows
    if pad:
        q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])
        scale, zero = torch.cat([scale, scale.new_ones(pad, scale.shape[1])]), torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), inner_k_tiles)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz


class FastLinear(nn.Module):
    """y = x W^T + b over one or more checkpoint linears fused along the output dimension
    (`splits` gives each one's share of the output). The common base of the weight formats: one
    subclass per format (and per kernel that runs it), chosen once by `quant.make_linear`; what the
    rest of the package needs to know about a format it asks the class (the attributes below),
    never its buffers."""

    fmt: ClassVar[str]  # the format's name (see the module doc): reprs, shape keys, benchmarks
    # why torch.export cannot trace it (quickdraft.aot), or None
    export_blocker: ClassVar[str | None] = None
    calls_kernels: ClassVar[bool] = False  # its matmul calls quickdraft's CPU kernels (quickdraft.kernels)
    # an AOTInductor package must carry its tensors inside (PyTorch's int4 kernel: see quickdraft.aot)
    embeds_weights: ClassVar[bool] = False
    # a row's result has the same bits whatever the other rows and their count (verify rows equal
    # decode rows; a request's output does not depend on its batch): quickdraft's kernels promise
    # it, PyTorch's GEMMs do not
    row_invariant: ClassVar[bool] = False
    # rows up to which the matmul stays on the one path a traced step (quickdraft.aot) has; None:
    # every row count
    kernel_rows: ClassVar[int | None] = None

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, splits: list[int]):
        super().__init__()
        self.splits = splits
        self.out_features, self.in_features = w.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self._mm(x.reshape(-1, shape[-1]))
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 (M, in) @ W^T + bias -> (M, out)."""
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight (out, in) as the matmul sees it, in `dtype`."""
        raise NotImplementedError

    def _read(self) -> list[torch.Tensor]:
        """The tensors a one-row (decode) matmul reads, bias excepted."""
        raise NotImplementedError

    def bytes_read(self) -> int:
        """Bytes a one-row (decode) matmul streams: the tensors its kernel reads."""
        tensors = self._read() + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def weight_bytes(self) -> int:
        """Bytes this layer keeps resident (all its tensors)."""
        return sum(t.numel() * t.element_size() for t in list(self.parameters()) + list(self.buffers()))

    def _describe(self) -> str:
        return self.fmt

    def extra_repr(self) -> str:
        fused = f", fused {self.splits}" if len(self.splits) > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self._describe()}{fused}"


class DenseLinear(FastLinear):
    """`dense`: F.linear, the device's GEMM (not CPU; float16; bfloat16 without native bf16 on CPU)."""

    fmt = "dense"

    def __init__(self, w, bias, splits):
        super().__init__(w, bias, splits)
        self.register_buffer("weight", w)

    def _mm(self, x2):
        return F.linear(x2, self.weight, self.bias)

    def dequantized(self, dtype):
        return self.weight.to(dtype)

    def _read(self):
        return [self.weight]


class TransposedLinear(FastLinear):
    """`transposed`: CPU float32 without quickdraft's kernels: `x @ W[in, out]` (MKL sgemm)."""

    fmt = "transposed"

    def __init__(self, w, bias, splits):
        super().__init__(w, bias, splits)
        self.register_buffer("weight_t", w.t().contiguous())

    def _mm(self, x2):
        return x2 @ self.weight_t if self.bias is None else torch.addmm(self.bias, x2, self.weight_t)

    def dequantized(self, dtype):
        return self.weight_t.t().to(dtype)

    def _read(self):
        return [self.weight_t]


class BlockedLinear(FastLinear):
    """`blocked`: CPU float32 on quickdraft's kernel at every row count (2-3 rows cost one,
    prefill runs as fast as MKL's); W in 64-column blocks."""

    fmt = "blocked"
    calls_kernels = True
    row_invariant = True

    def __init__(self, w, bias, splits):
        super().__init__(w, None if bias is None else bias.float(), splits)
        self.register_buffer("packed", kernels.pack(w.t().float()))

    def _mm(self, x2):
        return kernels.blocked_mm(x2, self.packed, self.bias, self.out_features)

    def dequantized(self, dtype):
        return kernels.unpack(self.packed, self.out_features).t().to(dtype)

    def _read(self):
        return [self.packed]


class BlockedBF16Linear(FastLinear):
    """`blocked_bf16`: CPU bfloat16 weights on quickdraft's kernel at every row count, widened to
    float32 in registers (exact): half the bytes of `blocked`, float32 sums in the same order, so
    row-invariant on any CPU with a vector path, native bf16 or not. Activations come in and go
    out in the model's dtype (bfloat16); the sums are float32."""

    fmt = "blocked_bf16"
    calls_kernels = True
    row_invariant = True

    def __init__(self, w, bias, splits):
        super().__init__(w, None if bias is None else bias.float(), splits)
        self.register_buffer("packed", kernels.pack_bf16(w.t()))

    def _mm(self, x2):
        return kernels.blocked_mm_bf16(x2.float(), self.packed, self.bias, self.out_features)

    def dequantized(self, dtype):
        return kernels.unpack(self.packed, self.out_features).t().to(dtype)

    def _read(self):
        return [self.packed]


class OneDNNLinear(FastLinear):
    """`onednn`: CPU bfloat16 with native bf16 (AMX / AVX512-BF16): oneDNN's packed GEMM. The
    packed weight is an opaque tensor, kept out of state_dict / to() and unreadable."""

    fmt = "onednn"
    export_blocker = "oneDNN-packed bfloat16 weights are opaque tensors, which export cannot take"

    def __init__(self, w, bias, splits):
        super().__init__(w, bias, splits)
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 1),
                             persistent=False)

    def _mm(self, x2):
        return torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")

    def dequantized(self, dtype):
        raise QuickdraftError("a oneDNN-packed weight cannot be read back")

    def _read(self):
        return [self.packed]


class _Quantised(FastLinear):
    """int8 / int4 on PyTorch's weight-only kernels (or none): the kernel for small matmuls; past
    DENSE_ROWS rows the weight is dequantised to bf16 (CPU) and a dense GEMM runs."""

    kernel_rows = DENSE_ROWS

    def _mm(self, x2):
        if self._dense(x2.shape[0]):
            xd = x2.to(torch.bfloat16) if x2.device.type == "cpu" else x2
            out = self._dense_mm(xd).to(x2.dtype)
            return out if self.bias is None else out + self.bias
        return self._kernel_mm(x2)

    def _dense(self, rows: int) -> bool:
        return not _KERNELS_ONLY and rows > self.kernel_rows

    def _dense_mm(self, xd: torch.Tensor) -> torch.Tensor:
        """xd @ W^T in xd's dtype, without the bias."""
        return F.linear(xd, self.dequantized(xd.dtype))

    def _kernel_mm(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8BlockedLinear(FastLinear):
    """`int8` on quickdraft's blocked kernel (CPU with AVX-512 or AVX2) at every row count:
    per-channel scales, activations quantised to int8 per group of 32 (a float32 scale each,
    int4's formula), integer dot products."""

    fmt = "int8"
    calls_kernels = True
    row_invariant = True

    def __init__(self, w, bias, splits):
        super().__init__(w, None if bias is None else bias.float(), splits)
        q, scale = int8_quantize(w)
        self.register_buffer("qpacked", kernels.pack_int8(q))
        self.register_buffer("scales", scale)

    def _mm(self, x2):
        return kernels.blocked_mm_int8(x2.float(), self.qpacked, self.scales, self.bias, self.out_features)

    def dequantized(self, dtype):
        q = kernels.unpack_int8(self.qpacked, self.out_features, self.in_features)  # (out, in)
        return q.to(dtype) * self.scales.to(dtype)[:, None]

    def _read(self):
        return [self.qpacked, self.scales]

    def _describe(self):
        return "int8 (quickdraft's blocked kernel, int8 activations)"


class Int8TorchLinear(_Quantised):
    """`int8` on PyTorch's weight-only kernel (`torch._weight_int8pack_mm`, bf16 activations on
    CPU), where quickdraft's does not run; dequantised per call where the device has neither."""

    fmt = "int8"

    def __init__(self, w, bias, splits):
        super().__init__(w, bias, splits)
        q, scale = int8_quantize(w)
        cpu = w.device.type == "cpu"
        self.kernel = has_kernel("_weight_int8pack_mm", w.device)
        self.register_buffer("qweight", q)
        self.act_dtype = torch.bfloat16 if cpu else w.dtype  # f32 activations hit a slow path on CPU
        self.register_buffer("scales", scale.to(self.act_dtype))

    def _dense(self, rows):
        return not self.kernel or super()._dense(rows)

    def _kernel_mm(self, x2):
        out = torch._weight_int8pack_mm(x2.to(self.act_dtype), self.qweight, self.scales).to(x2.dtype)
        return out if self.bias is None else out + self.bias

    def _dense_mm(self, xd):
        return F.linear(xd, self.qweight.to(xd.dtype)) * self.scales.to(xd.dtype)

    def dequantized(self, dtype):
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    def _read(self):
        return [self.qweight, self.scales]

    def _describe(self):
        return "int8" + ("" if self.kernel else " (dequantised per call: no int8 kernel on this device)")


class Int4BlockedLinear(FastLinear):
    """`int4` on quickdraft's blocked kernel (CPU with AVX-512 or AVX2) at every row count:
    activations quantised to int8 per group of 32 (a float32 scale each), integer dot products
    with the nibbles; per group float16 scales and offsets, 0.625 byte per weight resident and read
    (a GGUF's Q4_0 matrix, symmetric, stores no offsets: 0.5625, `kernels.int4_symmetric`), or in
    the super-block layout 8-bit codes of float16 factors shared by 8 groups, 0.578
    (`kernels.int4_super`; with quant.INT4_SUPER_BLOCKS: float weights whose inputs are a multiple
    of 256, a GGUF's Q4_K)."""

    fmt = "int4"
    calls_kernels = True
    row_invariant = True

    def __init__(self, w, bias, splits, qpacked: torch.Tensor, source: str | None = None):
        super().__init__(w, None if bias is None else bias.float(), splits)
        self.register_buffer("qpacked", qpacked)
        self.source = source

    def _mm(self, x2):
        return kernels.blocked_mm_int4(x2.float(), self.qpacked, self.bias, self.out_features)

    def dequantized(self, dtype):
        return _int4_weight(*kernels.unpack_int4(self.qpacked, self.out_features), dtype)

    def _read(self):
        return [self.qpacked]

    def _describe(self):
        return "int4" + (f" from {self.source}" if self.source else "") + " (quickdraft's blocked kernel)"


class Int4TorchLinear(_Quantised):
    """`int4` on PyTorch's CPU kernel (`torch._weight_int4pack_mm_for_cpu`, bf16 activations),
    where quickdraft's does not run (or a scale passes float16's range); dequantised per call on
    other devices. From (q, scale, zero), w ~ (q - 8) * scale + zero as `int4_quantize` gives (or
    a GGUF's 4-bit blocks as they are: `source`)."""

    fmt = "int4"
    embeds_weights = True  # Inductor turns the kernel's group size into constants of its own

    def __init__(self, w, bias, splits, q, scale, zero, source=None):
        super().__init__(w, bias, splits)
        self.source = source
        cpu = w.device.type == "cpu"
        self.kernel = cpu and has_kernel("_weight_int4pack_mm_for_cpu", w.device)
        # unpacked copy for dense (prefill) matmuls: w = q * scale + offset per group, bf16 scales
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("offset", (zero - 8 * scale).to(torch.bfloat16))
        if cpu:
            packed, sz = _int4_cpu_pack(q, scale, zero)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", sz)

    def _dense(self, rows):
        return not self.kernel or super()._dense(rows)

    def _kernel_mm(self, x2):
        out = torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.packed, INT4_GROUP,
                                                self.scales_and_zeros)[:, :self.out_features].to(x2.dtype)
        return out if self.bias is None else out + self.bias

    def dequantized(self, dtype):
        return _int4_weight(self.q, self.scale, self.offset, dtype)

    def _read(self):
        return [self.packed, self.scales_and_zeros] if self.kernel else [self.q, self.scale, self.offset]

    def _describe(self):
        return ("int4" + (f" from {self.source}" if self.source else "")
                + ("" if self.kernel else " (dequantised per call: no int4 kernel on this device)"))


def _int4_weight(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w = q * scale + offset per group of INT4_GROUP inputs, (out, in) in `dtype`."""
    qg = q.unflatten(1, (-1, INT4_GROUP)).to(dtype)
    return (qg * scale.to(dtype)[..., None] + offset.to(dtype)[..., None]).flatten(1)  # 3x addcmul's speed
