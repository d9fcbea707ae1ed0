"""Inference weight formats: fused projections, CPU-packed layouts, int8 and int4 weight-only.

`prepare(model, quantization)` turns a loaded model into its inference form, in place:
- q/k/v and gate/up projections are fused into one matmul each (`qkv_proj`, `gate_up_proj`);
  the checkpoint's names are what was loaded, the fusion happens after loading;
- every linear layer (lm_head included) becomes a `formats.FastLinear`: one class per format
  and kernel, chosen once by `make_linear`, in the format that streams the weights fastest on the
  model's device and dtype, measured with benchmarks/cpu_kernels.py (results in
  benchmarks/results/cpu_kernels_*.json):

  | format | where | kernel | decode (1 row) | verify (k+1 rows), prefill |
  |---|---|---|---|---|
  | `dense` | not CPU; float16 | F.linear | the device's GEMM | same |
  | `blocked` | CPU float32 with AVX-512 or AVX2 + FMA | quickdraft's own (`quickdraft.kernels`): W in 64-column blocks, each streamed once for all rows | as MKL's sgemv | k+1 = 2-3 rows cost ~1 row, 4-6 rows ~1.15 (MKL: 1.5-1.9); prefill as MKL |
  | `transposed` | CPU float32 without it (or the kernel could not be built) | `x @ W[in, out]` (MKL sgemm) | streams ~25% faster than F.linear | same kernel |
  | `blocked_bf16` | CPU bfloat16 with AVX-512 or AVX2 + FMA (native bf16 or not) | quickdraft's blocked kernel, bf16 blocks widened to float32 in registers (exact), float32 sums | half of `blocked`'s bytes (SmolLM2's lm_head: 0.47x its time at 1 row) | as `blocked`; prefill on the kernel |
  | `onednn` | CPU bfloat16 with native bf16 where quickdraft's kernels do not run | oneDNN's packed bf16 GEMM (AMX / AVX512-BF16) | as F.linear or better | k+1 rows cost ~1 row; prefill on AMX (not row-invariant) |
  | `int8` | any | per-channel scales; CPU with AVX-512 or AVX2: quickdraft's blocked kernel (activations quantised to int8 per group of 32 as int4's, integer dot products (VNNI where the CPU has it), the scales applied once per output), else `torch._weight_int8pack_mm` (bf16 activations on CPU) | 1 byte/weight | blocked: k+1 rows ~1 row, the kernel at every row count; PyTorch's: past 16 rows dequantised to bf16, dense GEMM |
  | `int4` | CPU | groups of 32, asymmetric; CPU with AVX-512 or AVX2: quickdraft's blocked kernel (activations quantised to int8 per group of 32, integer dot products (VNNI where the CPU has it), float16 scales and offsets; a GGUF's Q4_0 without offsets; with INT4_SUPER_BLOCKS, where inputs are a multiple of 256, super-blocks: per 8 groups a float16 scale and offset factor per output, per group 8-bit codes, a GGUF's Q4_K as it is), else `torch._weight_int4pack_mm_for_cpu` (bf16) | 0.625 byte/weight (Q4_0: 0.5625; super-blocks 0.578) | blocked: k+1 rows ~1 row, the kernel at every row count (as int8); PyTorch's: past 16 rows from an unpacked uint8 copy (1 byte/weight more resident) to bf16, dense GEMM |

  Where PyTorch has no such kernel for the device (int8 on CUDA, int4 everywhere but CPU) the
  matmul dequantises per call (a fallback, labelled as such in its repr).

Every format on quickdraft's kernels (`blocked`, `blocked_bf16`, int8, int4 where they run) is
row-invariant (`row_invariant`): a row's bits never depend on the rows beside it, so a verify
step's rows are the decode steps' and a request's output does not depend on its batch.

Quantisation changes the model: speculative output follows the quantised target exactly
(lossless with respect to it). A quantised draft only changes how often it is accepted.
Training never sees these modules: `prepare` is applied by `LLM` after loading.

`quantized_copy` makes a self-draft (`LLM(draft="self")`): the loaded target's linears in int4
or int8, every other tensor shared with the target.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import itertools
from collections.abc import Iterator

import torch
from torch import nn

from .. import kernels
from ..errors import QuickdraftError
from .formats import (INT4_GROUP, INT4_SUPER, BlockedBF16Linear, BlockedLinear, DenseLinear, FastLinear, Int4BlockedLinear,
                      Int4TorchLinear, Int8BlockedLinear, Int8TorchLinear, OneDNNLinear, TransposedLinear, int4_quantize,
                      int4_quantize_super, int4_zero_form)

QUANTIZATIONS = ("none", "int8", "int4")
# True: int4 in the kernel's super-block layout (4.625 bits a weight, against the float16 layout's 5) where a
# layer's inputs are a multiple of 256, and a GGUF's Q4_K with its own codes. Off by default: on an AMD EPYC
# Zen 4 it decodes 4-7% faster (fewer bytes) but its multi-row kernels are slower from DRAM: verify steps of
# 5 / 6 rows (k = 4 / 5) took 1.37x / 1.26x the float16 layout's time on SmolLM2-1.7B's shape
# (benchmarks/results/verify_table_int4_super_zen4_cpu.md), and with the halves kernel's prefetch stream its
# calls of 3-9 rows still 1.05-1.11x (AVX2: no faster at one row; blocked_rows_dram_prefetch_zen4_cpu.md);
# benchmarks turn it on to compare (int4_layouts.py, llamacpp.py's int4-super-q4_0, verify_table.py's and
# perplexity.py's int4-super)
INT4_SUPER_BLOCKS = False


@contextlib.contextmanager
def int4_super_blocks(on: bool) -> Iterator[None]:
    """INT4_SUPER_BLOCKS set to `on` inside the block (models prepared there), then as it was."""
    global INT4_SUPER_BLOCKS
    before, INT4_SUPER_BLOCKS = INT4_SUPER_BLOCKS, on
    try:
        yield
    finally:
        INT4_SUPER_BLOCKS = before


def onednn_bf16_supported() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def blocked_supported() -> bool:
    """Whether CPU weights (float32, int8, int4) take quickdraft's own small-M kernels: the kernel
    library builds or is built, and it runs a vector path (AVX-512 or AVX2 + FMA, the CPU's best or
    QUICKDRAFT_ISA's; its portable path is for correctness, not speed)."""
    return kernels.available() and kernels.isa() in kernels.VECTOR_ISAS


def float_weight(p: torch.Tensor) -> torch.Tensor:
    """A linear layer's float weight; a GGUF matrix whose dequantisation was deferred
    (`gguf.load_gguf_model`) is read now."""
    read = getattr(p, "gguf_deferred", None)
    return read() if read is not None else p.detach()


def make_linear(linears: list[nn.Linear], fmt: str) -> FastLinear:
    """`linears` fused along the output dimension into one layer of format `fmt` (see the module
    doc), on the kernel that runs it here: the one place a format's class is chosen."""
    splits = [lin.out_features for lin in linears]
    native = [getattr(lin.weight, "gguf_int4", None) for lin in linears]
    if fmt == "int4" and all(n is not None for n in native):  # a GGUF's 4-bit blocks, as they are
        w = linears[0].weight.new_zeros(()).expand(sum(splits), linears[0].in_features)  # (the shape only)
    else:
        parts = [float_weight(lin.weight) for lin in linears]
        w = torch.cat(parts) if len(parts) > 1 else parts[0]
    biases = [lin.bias for lin in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else w.new_zeros(n) for b, n in zip(biases, splits)])
    blocked = w.device.type == "cpu" and blocked_supported()
    if fmt == "dense":
        return DenseLinear(w.clone() if len(linears) == 1 else w, bias, splits)
    if fmt == "transposed":
        return TransposedLinear(w, bias, splits)
    if fmt == "blocked":
        return BlockedLinear(w, bias, splits)
    if fmt == "onednn":
        return OneDNNLinear(w, bias, splits)
    if fmt == "blocked_bf16":
        return BlockedBF16Linear(w, bias, splits)
    if fmt == "int8":
        return Int8BlockedLinear(w, bias, splits) if blocked else Int8TorchLinear(w, bias, splits)
    if fmt == "int4":
        source = "GGUF blocks" if all(n is not None for n in native) else None
        if source is None and any(getattr(lin.weight, "gguf_wide", False) for lin in linears):
            # a GGUF keeps this matrix wider than 4 bits (SmolLM2's Q8_0 lm_head, a Q4_K_M's Q6_K
            # layers): not rounded to 4 bits a second time, int8 as llama.cpp's 8-bit dot products
            return make_linear(linears, "int8")
        if source:  # a GGUF's Q4_0 / Q4_1 / Q4_K blocks, as they are: no second rounding
            native = [n() if callable(n) else n for n in native]  # (a GGUF's, read now: gguf_state_dict)
            if blocked and INT4_SUPER_BLOCKS and all(len(n) == 5 for n in native):  # Q4_K's codes and factors
                packed = _pack_super([torch.cat(parts) for parts in zip(*native)])
                if packed is not None:
                    return Int4BlockedLinear(w, bias, splits, packed, source)
            q, scale, zero = (torch.cat(parts) for parts in zip(*[int4_zero_form(n) for n in native]))
        else:
            if blocked and INT4_SUPER_BLOCKS and w.shape[1] % (INT4_GROUP * INT4_SUPER) == 0:  # 4.625 bits a weight
                packed = _pack_super(int4_quantize_super(w))
                if packed is not None:
                    return Int4BlockedLinear(w, bias, splits, packed, source)
            q, scale, zero = int4_quantize(w)
        offset = zero - 8 * scale
        if blocked:
            # symmetric blocks (every zero 0: a GGUF's Q4_0) store no offsets: 4.5 bits a weight, not 5
            symmetric = not bool(zero.any())
            try:
                qpacked = kernels.pack_int4(q, scale, None if symmetric else offset)  # float16 scales (and offsets)
            except ValueError:  # beyond float16's range: PyTorch's kernel, bfloat16 scales
                pass
            else:
                return Int4BlockedLinear(w, bias, splits, qpacked, source)
        return Int4TorchLinear(w, bias, splits, q, scale, zero, source)
    raise QuickdraftError(f"unknown weight format {fmt!r}")


def _pack_super(parts) -> torch.Tensor | None:
    """(q, scale codes, offset codes, scale factors, offset factors) in the int4 kernel's super-block
    layout, or None where a factor is beyond float16's range (the float16 layout's path decides)."""
    try:
        return kernels.pack_int4_super(*parts)
    except ValueError:
        return None


def weight_format(device: torch.device, dtype: torch.dtype, quantization: str | None) -> str:
    """The format `prepare` gives a model's linear layers (see the module doc)."""
    if quantization not in (None, "none"):
        if quantization not in QUANTIZATIONS:
            raise QuickdraftError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
        return quantization
    if device.type != "cpu":
        return "dense"
    if dtype == torch.float32:
        return "blocked" if blocked_supported() else "transposed"
    if dtype == torch.bfloat16:  # exact (row-invariant) first; oneDNN's GEMM where our kernels do not run
        return "blocked_bf16" if blocked_supported() else "onednn" if onednn_bf16_supported() else "dense"
    return "dense"


def prepare(model: nn.Module, quantization: str | None = None, fmt: str | None = None) -> nn.Module:
    """The model's inference form, in place: fused projections, every linear in `fmt`
    (default: the fastest for its device, dtype and `quantization`). Returns the model."""
    p = next(model.parameters())
    fmt = fmt or weight_format(p.device, p.dtype, quantization)
    for module in model.modules():
        if hasattr(module, "fuse_projections"):
            module.fuse_projections(lambda linears: make_linear(linears, fmt))
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, make_linear([child], fmt))
    for module in model.modules():  # a deferred GGUF matrix left outside a linear layer: read it now
        for name, param in list(module.named_parameters(recurse=False)):
            if getattr(param, "gguf_deferred", None) is not None:
                setattr(module, name, nn.Parameter(float_weight(param), requires_grad=False))
    if p.device.type == "cpu":
        return_freed_memory()
    return model


def return_freed_memory() -> None:
    """Give the C heap's free memory back to the OS (glibc's malloc_trim; nothing elsewhere).
    Loading frees the checkpoint's tensors and the unpacked weights; glibc keeps much of that
    resident for later allocations, and the packed weights live in their own mappings
    (kernels.weights_memory), so nothing would reuse it: SmolLM2 float32 held 1.29 GB after
    loading, 0.95 GB after this."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator's own policy
        pass


def quantized_copy(model: nn.Module, quantization: str) -> nn.Module:
    """A self-draft: a copy of a loaded model (before `prepare`) whose linear layers (lm_head
    included) are prepared in `quantization` ("int8" or "int4"), sharing every other tensor with
    it: the embedding table, the norms, the rotary tables. Nothing is read from disk again;
    call it before `prepare(model)`, which replaces the float linears the copy quantises from."""
    if quantization not in ("int8", "int4"):
        raise QuickdraftError(f"a self-draft's weights are int8 or int4, got {quantization!r}")
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return prepare(copy.deepcopy(model, shared), quantization)


def row_invariant(model: nn.Module) -> bool:
    """Whether every linear layer of `model` gives a row the same bits whatever the rows beside it
    (quickdraft's kernels: `blocked`, int8 and int4 where they run): what makes speculative output
    equal plain output, and a seeded request independent of its batch, at any batch size."""
    return all(m.row_invariant for m in model.modules() if isinstance(m, FastLinear))


def quantised_layers(model: nn.Module) -> bool:
    """Whether `model`'s decoder layers run int8 or int4 weights (a quantization, a GGUF's Q4 / Q8
    blocks); an int8 lm_head alone does not count (config.AUTO_QUANTISED_KV_CACHE_DTYPE)."""
    layers = getattr(getattr(model, "model", model), "layers", model)
    return any(m.fmt in ("int8", "int4") for m in layers.modules() if isinstance(m, FastLinear))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers resident for inference (tied tensors counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = id(t) if t.is_mkldnn else t.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def bytes_read_per_token(model: nn.Module) -> int:
    """Weight bytes one decode step of batch 1 reads: every linear's kernel operands, the norms,
    and one row of the embedding table. Divided by the machine's read bandwidth this is the
    memory roofline: the least time a token can take."""
    total, seen = 0, set()
    for m in model.modules():
        if isinstance(m, FastLinear):
            total += m.bytes_read()
            seen.update(id(t) for t in list(m.parameters()) + list(m.buffers()))
    embed = model.model.embed_tokens.weight
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embed:
            linear_head = isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is embed
            total += p.numel() * p.element_size() if linear_head else p.shape[1] * p.element_size()
        elif p.dim() == 2 or p.dim() == 1:
            total += p.numel() * p.element_size()
    return total
