"""quickdraft's own CPU kernels, compiled once on the machine that runs them.

`blocked_mm.cpp`: the matmul of small row counts that a verify step needs (k + 1 rows), over
float32 or int8 weights (`blocked_mm`, `blocked_mm_int8`), streaming each weight once for all
rows; PyTorch's stock CPU paths (MKL sgemm, oneDNN) cost 1.5-2.9x a one-row step at 2-8 rows
(benchmarks/results/small_m_gemm_cpu.json, verify_cost_*_cpu.json). See the source's header for
the layout and the numerics.

The library is built with PyTorch's C++ extension builder (a C++ compiler and ninja) the
first time a model needs it, about 15 s, and cached under `<cache>/kernels/`
(`QUICKDRAFT_CACHE`, else ~/.cache/quickdraft); later processes only load it. Where it
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
# -fopenmp: at::parallel_for splits the blocks over PyTorch's threads only when the kernel is
# compiled for OpenMP (without it the pragma is ignored and the kernel runs on one thread:
# measured 1.5x MKL's time at 2 threads). The OpenMP runtime is PyTorch's own (libgomp, loaded
# with libtorch_cpu), so the library is not linked to a second one.
CFLAGS = ["-O3", "-fopenmp"]


def _build_dir() -> Path:
    from ..model.sources import cache_dir  # late: model.sources imports nothing of ours back

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]
    tag = f"torch{torch.__version__.split('+')[0]}-{digest}"
    path = cache_dir() / "kernels" / tag
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
