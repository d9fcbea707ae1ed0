"""quickdraft's own CPU kernels, compiled once on the machine that runs them.

`blocked_mm.cpp`: the matmul of small row counts that a verify step needs (k + 1 rows), over
float32, int8 or group-wise int4 weights (`blocked_mm`, `blocked_mm_int8`, `blocked_mm_int4`),
streaming each weight once for all rows, with float32 activations; PyTorch's stock CPU paths (MKL sgemm, oneDNN) cost 1.5-2.9x a one-row step at 2-8 rows
(benchmarks/results/small_m_gemm_cpu.json, verify_cost_*_cpu.json). See the source's header for
the layout and the numerics. And `attend`: attention over the cache for up to 12 query rows
(decode, verify and tree steps), each kv head's keys read once for several query rows, where
PyTorch's flash attention reads a one-query step through one-row BLAS calls.

The library is built with PyTorch's C++ extension builder (a C++ compiler and ninja) the
first time a model needs it, about 15 s, and cached under `<cache>/kernels/`
(`QUICKDRAFT_CACHE`, else ~/.cache/quickdraft; `QUICKDRAFT_KERNEL_CACHE` names another folder
for the kernels alone); later processes only load it. Where it
cannot be built (no compiler) `available()` is False, with one warning naming the reason, and
float32 weights keep PyTorch's own kernel (`quickdraft.model.quant`). `QUICKDRAFT_KERNELS=0`
turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

log = logging.getLogger("quickdraft")

SOURCE = Path(__file__).with_name("blocked_mm.cpp")
BLOCK = 64  # outputs per column block of the packed layout (blocked_mm.cpp's NB)
GROUP = 32  # int4: inputs per group (blocked_mm.cpp's QG)
# -fopenmp: at::parallel_for splits the blocks over PyTorch's threads only when the kernel is
# compiled for OpenMP (without it the pragma is ignored and the kernel runs on one thread:
# measured 1.5x MKL's time at 2 threads). The OpenMP runtime is PyTorch's own (libgomp, loaded
# with libtorch_cpu), so the library is not linked to a second one.
CFLAGS = ["-O3", "-fopenmp"]


def _build_dir() -> Path:
    from ..model.sources import cache_dir  # late: model.sources imports nothing of ours back

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]
    tag = f"torch{torch.__version__.split('+')[0]}-{digest}"
    base = os.environ.get("QUICKDRAFT_KERNEL_CACHE")
    path = (Path(base) if base else cache_dir() / "kernels") / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def available() -> bool:
    """Whether `torch.ops.quickdraft.blocked_mm` runs here (building the library if needed);
    False while QUICKDRAFT_KERNELS=0."""
    return os.environ.get("QUICKDRAFT_KERNELS", "1") != "0" and _load()


@functools.lru_cache(maxsize=1)
def _load() -> bool:
    if hasattr(torch.ops, "quickdraft") and hasattr(torch.ops.quickdraft, "blocked_mm"):
        _register_fake()
        return True
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the `ninja` package's binary sits beside this Python
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        build = _build_dir()  # named by the source and flags: a library there is up to date
        if (build / "qd_kernels.so").exists() and not (build / "lock").exists():  # (lock: another process building)
            torch.ops.load_library(str(build / "qd_kernels.so"))  # 0.05 s; the builder's checks take 0.4
        else:
            log.warning("quickdraft: building its CPU matmul kernel (once, about 15 s) in %s", build)
            cpp_extension.load(name="qd_kernels", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                               build_directory=str(build), is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: PyTorch's kernels instead
        warnings.warn(f"quickdraft's CPU matmul kernel could not be built ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}); float32 weights use PyTorch's own "
                      "kernels, and verify steps of several tokens cost more", stacklevel=2)
        return False
    _register_fake()
    _export_c_symbols()
    return True


# AOTInductor's declarations of the C entry points (blocked_mm.cpp's end), for `aoti_config`
_SHIMS = {
    "blocked_mm": "AOTITorchError aoti_torch_cpu_blocked_mm(AtenTensorHandle x, AtenTensorHandle packed, "
                  "AtenTensorHandle* bias, int64_t n, AtenTensorHandle* ret0)",
    "blocked_mm_int8": "AOTITorchError aoti_torch_cpu_blocked_mm_int8(AtenTensorHandle x, AtenTensorHandle packed, "
                       "AtenTensorHandle scale, AtenTensorHandle* bias, int64_t n, AtenTensorHandle* ret0)",
    "blocked_mm_int4": "AOTITorchError aoti_torch_cpu_blocked_mm_int4(AtenTensorHandle x, AtenTensorHandle packed, "
                       "AtenTensorHandle* bias, int64_t n, AtenTensorHandle* ret0)",
    "attend": "AOTITorchError aoti_torch_cpu_attend(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, "
              "AtenTensorHandle mask, double scale, AtenTensorHandle* ret0)",
}


def aoti_config() -> dict:
    """Inductor settings that make an AOT package call the kernels' C entry points directly."""
    return {"aot_inductor.custom_ops_to_c_shims": {getattr(torch.ops.quickdraft, name).default: [decl]
                                                   for name, decl in _SHIMS.items()}}


def _export_c_symbols() -> None:
    """Make the library's C entry points visible to packages loaded later (dlopen RTLD_GLOBAL)."""
    import ctypes

    lib = _build_dir() / "qd_kernels.so"
    if lib.exists():
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


@functools.lru_cache(maxsize=1)
def _register_fake() -> None:
    """Shapes for tracing (torch.export, torch.compile): (M, n) float32 like x."""

    @torch.library.register_fake("quickdraft::blocked_mm")
    def _(x, packed, bias, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("quickdraft::blocked_mm_int8")
    def _(x, packed, scale, bias, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("quickdraft::blocked_mm_int4")
    def _(x, packed, bias, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("quickdraft::attend")
    def _(q, k, v, mask, scale):
        B, H, T, D = q.shape
        return q.new_empty((B, T, H, D)).transpose(1, 2)


def blocked_mm_int8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    n: int) -> torch.Tensor:
    """x (M, in) float32 @ (Q * scale) + bias -> (M, n): Q int8 (in, out) given `pack`ed, scale (n,)
    per output; the sums of x * Q are exact products accumulated in float32, scaled at the end."""
    return torch.ops.quickdraft.blocked_mm_int8.default(x, packed, scale, bias, n)


def pack(weight_t: torch.Tensor) -> torch.Tensor:
    """W (in, out) -> the kernel's layout (ceil(out / 64), in, 64), zero-padded past `out`."""
    k, n = weight_t.shape
    blocks = -(-n // BLOCK)
    padded = weight_t.new_zeros(k, blocks * BLOCK)
    padded[:, :n] = weight_t
    return padded.view(k, blocks, BLOCK).transpose(0, 1).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack`: W (in, out)."""
    return packed.transpose(0, 1).reshape(packed.shape[1], -1)[:, :n]


def blocked_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x (M, in) float32 @ W + bias -> (M, n), W given `pack`ed."""
    return torch.ops.quickdraft.blocked_mm.default(x, packed, bias, n)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Group-wise 4-bit weights in the int4 kernel's layout. q (out, in) in 0..15, scale and offset
    (out, in / 32): w = q * scale + offset over each group of 32 inputs. Returns uint8
    (ceil(out / 64), in / 32, 1280): per 64-output block and group, 32 rows of 32 bytes (byte j of
    row k: q[j][k] | q[j + 32][k] << 4), then the 64 scales and the 64 offsets as float16.
    Raises ValueError where a scale or offset does not fit float16."""
    n, k = q.shape
    if k % GROUP or scale.shape != (n, k // GROUP) or offset.shape != scale.shape:
        raise ValueError(f"int4 blocks need in % {GROUP} == 0 and (out, in / {GROUP}) scales; got q {tuple(q.shape)}, "
                         f"scale {tuple(scale.shape)}, offset {tuple(offset.shape)}")
    half = [t.to(torch.float16) for t in (scale, offset)]
    if not all(bool(torch.isfinite(h).all()) for h in half):
        raise ValueError("int4 scales or offsets beyond float16's range")
    blocks, groups = -(-n // BLOCK), k // GROUP
    pad = blocks * BLOCK - n
    qp = torch.cat([q.to(torch.uint8), q.new_zeros(pad, k, dtype=torch.uint8)]) if pad else q.to(torch.uint8)
    # (blocks, 64 out, groups, 32 in) -> (blocks, groups, 32 in, 64 out)
    qb = qp.view(blocks, BLOCK, groups, GROUP).permute(0, 2, 3, 1)
    nibbles = (qb[..., :BLOCK // 2] | (qb[..., BLOCK // 2:] << 4)).reshape(blocks, groups, GROUP * BLOCK // 2)

    def per_output(h: torch.Tensor) -> torch.Tensor:  # (out, groups) float16 -> (blocks, groups, 128) bytes
        h = torch.cat([h, h.new_zeros(pad, groups)]) if pad else h
        return h.view(blocks, BLOCK, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([nibbles, per_output(half[0]), per_output(half[1])], dim=2).contiguous()


def unpack_int4(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int4`: (q (n, in) uint8, scale, offset (n, in / 32) float16)."""
    blocks, groups, _ = packed.shape
    nib = packed[..., :GROUP * BLOCK // 2].reshape(blocks, groups, GROUP, BLOCK // 2)
    qb = torch.cat([nib & 15, nib >> 4], dim=3)  # (blocks, groups, 32 in, 64 out)
    q = qb.permute(0, 3, 1, 2).reshape(blocks * BLOCK, groups * GROUP)[:n]

    def per_output(lo: int) -> torch.Tensor:
        h = packed[..., lo:lo + 2 * BLOCK].contiguous().view(torch.float16)  # (blocks, groups, 64)
        return h.transpose(1, 2).reshape(blocks * BLOCK, groups)[:n]

    size = GROUP * BLOCK // 2
    return q, per_output(size), per_output(size + 2 * BLOCK)


def blocked_mm_int4(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x (M, in) float32 @ W^T + bias -> (M, n), W the `pack_int4`ed weight: per group, exact
    products x * q summed in float32, then scaled, plus the offset times the inputs' sum."""
    return torch.ops.quickdraft.blocked_mm_int4.default(x, packed, bias, n)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale where mask) v for a few query rows over the cache: q (B, H, T, D),
    k / v (B, H_kv, L, D) (grouped-query heads), mask bool (B or 1, 1, T, L); (B, H, T, D) out,
    stored as (B, T, H, D). More than 12 query rows, or no AVX-512, run PyTorch's attention.
    See blocked_mm.cpp's attention section for the numerics (row-invariant)."""
    return torch.ops.quickdraft.attend.default(q, k, v, mask, scale)
