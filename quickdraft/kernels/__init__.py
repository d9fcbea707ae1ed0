"""quickdraft's own CPU kernels, compiled once on the machine that runs them.

`blocked_mm.cpp`: the matmul of small row counts that a verify step needs (k + 1 rows), over
float32, bfloat16, int8 or group-wise int4 weights (`blocked_mm`, `blocked_mm_bf16` (widened to
float32 in registers, on every CPU), `blocked_mm_int8`, `blocked_mm_int4`),
streaming each weight once for all rows, with float32 activations (int8 and int4: quantised to
int8 per group of 32 inside the kernel, for integer dot products); PyTorch's stock CPU paths (MKL sgemm, oneDNN) cost 1.5-2.9x a one-row step at 2-8 rows
(benchmarks/results/small_m_gemm_cpu.json, verify_cost_*_cpu.json). See the source's header for
the layout and the numerics. And `attend`: attention over the cache for any number of query
rows (decode, verify, tree and prefill steps), each kv head's keys read once for up to 16 query
rows (4 on the portable and NEON paths), where PyTorch's flash attention reads a one-query step
through one-row BLAS calls.
And `rms_norm`: RMSNorm in one call (PyTorch's CPU rms_norm is several operations: a tenth of
an eager SmolLM2 decode step).

Every kernel has four paths: AVX-512, AVX2 + FMA, ARM NEON (AArch64) and portable C++, which give
the same bits (one numeric contract: a row's result does not depend on the other rows, the thread
count or the path; tests/kernels/test_neon.py runs the NEON path under qemu against the x86
library). The best the CPU has runs, or the one `QUICKDRAFT_ISA` (`avx512`, `avx2`, `neon`, `portable`)
names; it is read once, when the library loads, and naming one the CPU lacks is an error
(`QuickdraftError`), not a quiet fallback. `isa()` says which path runs; `use_isa` switches it
for a block of code (tests and benchmarks compare the paths in one process with it).

The library is built with PyTorch's C++ extension builder (a C++ compiler and ninja) the
first time a model needs it, about 15-40 s, and cached under `<cache>/kernels/`
(`QUICKDRAFT_CACHE`, else ~/.cache/quickdraft; `QUICKDRAFT_KERNEL_CACHE` names another folder
for the kernels alone); later processes only load it. A build runs in a private temporary folder
and renames the library into place, under a lock file that names its process: a lock whose
process is gone, or older than BUILD_LOCK_STALE_S, is taken over (one line says so), so a build
killed halfway never leaves later processes waiting. A cache folder that another user owns or
that others can write to, or a library file that is, is refused (one warning; the kernels are then not
available; `quickdraft.paths.unsafe_to_load`, the check AOT packages get too). Where the
library cannot be built (no compiler) `available()` is False, with one warning naming the
reason, and float32 weights keep PyTorch's own kernel (`quickdraft.model.quant`).
`QUICKDRAFT_KERNELS=0` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import mmap
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Iterator

import torch

from ..cache import anonymous
from ..errors import QuickdraftError
from ..paths import cache_dir, unsafe_to_load

log = logging.getLogger("quickdraft")

SOURCE = Path(__file__).with_name("blocked_mm.cpp")  # the PyTorch ops; it includes:
CORE = Path(__file__).with_name("blocked_core.h")  # the kernels themselves (no PyTorch: a harness runs them alone)
AMX = Path(__file__).with_name("blocked_amx.h")  # int8 and int4 on AMX tiles (included by blocked_core.h)
SOURCES = (SOURCE, CORE, AMX)  # what the library is built from (its cache folder is named by their bytes)
LIBRARY = "qd_kernels.so"
BLOCK = 64  # outputs per column block of the packed layout (blocked_mm.cpp's NB)
GROUP = 32  # int4: inputs per group (blocked_mm.cpp's QG)
SUPER = 8  # int4's super-block layout: groups per super group (blocked_core.h's QSG)
SUPER_BYTES = 4 * BLOCK + SUPER * (GROUP * BLOCK // 2 + 2 * BLOCK)  # its bytes per block and super group (QSB)
# -fopenmp: at::parallel_for splits the blocks over PyTorch's threads only when the kernel is
# compiled for OpenMP (without it the pragma is ignored and the kernel runs on one thread:
# measured 1.5x MKL's time at 2 threads). The OpenMP runtime is PyTorch's own (libgomp, loaded
# with libtorch_cpu), so the library is not linked to a second one. -ffp-contract=off: the
# compiler never fuses a separate multiply and add into an FMA, which would change the bits of
# one path and not the others.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# The kernels' paths, by blocked_mm.cpp's index (its enum Isa), and the ones whose matmuls are
# fast: the portable path is for correctness (and machines with neither), not speed.
ISAS = ("portable", "avx2", "avx512", "neon")
VECTOR_ISAS = ("avx2", "avx512", "neon")
_ISA_NAMES = {"portable": "portable C++", "avx2": "AVX2 + FMA (+ F16C)", "avx512": "AVX-512", "neon": "ARM NEON (AArch64)"}
BUILD_LOCK_STALE_S = 600  # a build lock this old is taken over (builds take 15-40 s, a few minutes on a loaded machine)
_LOCK = "build.lock"


def _kernel_root() -> Path:
    base = os.environ.get("QUICKDRAFT_KERNEL_CACHE")
    return Path(base).expanduser() if base else cache_dir() / "kernels"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """The kernels' sources and flags, hashed (names the built library; a change of layout or
    numerics changes it, so caches keyed by it, the library's and the measured step costs', are
    not reused across it). Builds nothing."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(CFLAGS).encode()).hexdigest()[:12]


def _build_dir(prefix: str = "", digest: str | None = None) -> Path:
    """The folder of a library (the kernels', else `prefix`'s), named by its sources' `digest`
    (default: the kernels' source_digest()) and PyTorch's version, created private (0700) where missing."""
    tag = f"{prefix}torch{torch.__version__.split('+')[0]}-{digest or source_digest()}"
    root = _kernel_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = root / tag
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def available() -> bool:
    """Whether `torch.ops.quickdraft.blocked_mm` runs here (building the library if needed);
    False while QUICKDRAFT_KERNELS=0. Raises QuickdraftError where QUICKDRAFT_ISA names a path
    that does not exist or that this CPU lacks."""
    if os.environ.get("QUICKDRAFT_KERNELS", "1") == "0" or not _load():
        return False
    _apply_isa_variable()
    return True


def isa() -> str | None:
    """The path the kernels run: "avx512", "avx2", "neon" or "portable" (None where they are not available)."""
    return ISAS[_lib().quickdraft_isa()] if available() else None


def cpu_isas() -> tuple[str, ...]:
    """The paths this CPU can run, best first (empty where the kernels are not available)."""
    return _cpu_isas() if available() else ()


def _cpu_isas() -> tuple[str, ...]:
    # (the loaded library asked directly: available() applies QUICKDRAFT_ISA, whose error names these)
    return tuple(name for i, name in reversed(list(enumerate(ISAS))) if _lib().quickdraft_cpu_has(i))


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Run the kernels on path `name` inside the block (process-wide: every thread's calls), then
    go back. For tests and benchmarks; a user's switch is QUICKDRAFT_ISA."""
    if not available():
        raise QuickdraftError("quickdraft's CPU kernels are not available here")
    lib = _lib()
    before = lib.quickdraft_isa()
    _set_isa(name, "use_isa")
    try:
        yield
    finally:
        lib.quickdraft_set_isa(before)


def _set_isa(name: str, where: str) -> None:
    if name not in ISAS:
        raise QuickdraftError(f"{where}: {name!r} is not one of {', '.join(ISAS)} (the kernels' paths)")
    if _lib().quickdraft_set_isa(ISAS.index(name)) != 0:
        raise QuickdraftError(f"{where}: this CPU has no {_ISA_NAMES[name]}; it runs {', '.join(_cpu_isas())}")


@functools.lru_cache(maxsize=1)
def _apply_isa_variable() -> None:
    """QUICKDRAFT_ISA, read once (an error is raised again at each call until it is fixed)."""
    if os.environ.get("QUICKDRAFT_VNNI", "1").strip() == "0":  # int8 and int4 without VNNI (the same bits)
        _lib().quickdraft_set_vnni(0)
    if os.environ.get("QUICKDRAFT_AMX", "1").strip() == "0":  # int8 and int4 without AMX (the same bits)
        _lib().quickdraft_set_amx(0)
    name = os.environ.get("QUICKDRAFT_ISA", "").strip().lower()
    if name:
        _set_isa(name, f"QUICKDRAFT_ISA={name}")  # (an error is not cached: every call raises it)


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    """The loaded library's C entry points, made visible to packages loaded later (RTLD_GLOBAL:
    AOT packages call them). Opening the file torch loaded returns that same library."""
    return ctypes.CDLL(str(_build_dir() / LIBRARY), mode=ctypes.RTLD_GLOBAL)


@functools.lru_cache(maxsize=1)
def _load() -> bool:
    if hasattr(torch.ops, "quickdraft") and hasattr(torch.ops.quickdraft, "blocked_mm"):
        _register_fake()
        return True
    try:
        build = _build_dir()  # named by the source and flags: a library there is up to date
        problem = unsafe_to_load(_kernel_root(), build, build / LIBRARY)
        if problem:
            warnings.warn(f"quickdraft's CPU kernels are not loaded from a folder or file others can change: {problem}; "
                          "PyTorch's kernels run instead, and verify steps of several tokens cost more", stacklevel=2)
            return False
        if not (build / LIBRARY).exists():
            _build(build)
        torch.ops.load_library(str(build / LIBRARY))  # 0.05 s; the builder's checks take 0.4
    except Exception as exc:  # no compiler, no ninja, a read-only cache: PyTorch's kernels instead
        warnings.warn(f"quickdraft's CPU matmul kernel could not be built ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}); float32 weights use PyTorch's own "
                      "kernels, and verify steps of several tokens cost more", stacklevel=2)
        return False
    _register_fake()
    _lib()
    return True


def _build(build: Path, library: str = LIBRARY, source: Path = SOURCE, what: str = "CPU kernels") -> None:
    """Compile `source` into `build`/`library` unless another process does: under `build`/build.lock
    (created exclusively, naming its host, process and time), in a private temporary folder, the
    result renamed into place in one step, so the library is always whole."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the `ninja` package's binary sits beside this Python
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    lock, lib = build / _LOCK, build / library
    waiting = announced = False
    while not lib.exists():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            stale = _stale(lock)
            if stale:
                log.warning("quickdraft: the build lock in %s is stale (%s): removed; building the %s again "
                            "(about 15-40 s)", build, stale, what)
                lock.unlink(missing_ok=True)
                announced = True
            else:
                if not waiting:
                    log.warning("quickdraft: waiting for another process's build of the %s in %s (at most %d s)",
                                what, build, BUILD_LOCK_STALE_S)
                    waiting = True
                time.sleep(0.5)
            continue
        try:
            os.write(fd, f"{socket.gethostname()} {os.getpid()} {time.time():.0f}\n".encode())
            os.close(fd)
            for old in build.glob("build-*"):  # a killed build's folder (the lock's holder alone builds)
                shutil.rmtree(old, ignore_errors=True)
            if lib.exists():
                return
            if not announced:
                log.warning("quickdraft: building its %s (once, about 15-40 s) in %s", what, build)
            tmp = Path(tempfile.mkdtemp(prefix="build-", dir=build))
            try:
                cpp_extension.load(name=Path(library).stem, sources=[str(source)], extra_cflags=CFLAGS,
                                   build_directory=str(tmp), is_python_module=False, verbose=False)
                os.replace(tmp / library, lib)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            lock.unlink(missing_ok=True)


def _stale(lock: Path) -> str | None:
    """Why a build lock is stale (its process is gone, it is older than BUILD_LOCK_STALE_S), or None."""
    try:
        age = time.time() - lock.stat().st_mtime
        fields = lock.read_text().split()
    except FileNotFoundError:
        return None  # released meanwhile
    if age > BUILD_LOCK_STALE_S:
        return f"held for {age:.0f} s"
    if len(fields) != 3:
        return "unreadable" if age > 10 else None  # (a lock is written right after it is created)
    host, pid = fields[0], int(fields[1]) if fields[1].isdigit() else -1
    if host == socket.gethostname() and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"its process {pid} is gone"
        except PermissionError:
            pass  # alive, another user's
    return None


RUNNER_SOURCE = Path(__file__).with_name("aot_runner.cpp")  # AOT packages called without holding the GIL
RUNNER_LIBRARY = "aot_runner.so"


@functools.lru_cache(maxsize=1)
def aot_package_class():
    """quickdraft's loader of AOT packages, `torch.classes.quickdraft_aot.AotPackage` (aot_runner.cpp:
    PyTorch's package loader, whose calls release the GIL), its library built once where missing
    (about 15 s, cached beside the kernels' and locked like theirs); None where it cannot be built
    or loaded here (one warning: AOT steps then hold the GIL while they run) or while
    QUICKDRAFT_AOT_RUNNER=0."""
    if os.environ.get("QUICKDRAFT_AOT_RUNNER", "1").strip() == "0":
        return None
    try:
        digest = hashlib.sha256(RUNNER_SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]
        build = _build_dir("aot-runner-", digest)
        problem = unsafe_to_load(_kernel_root(), build, build / RUNNER_LIBRARY)
        if problem:
            raise QuickdraftError(f"not loaded from a folder or file others can change: {problem}")
        if not (build / RUNNER_LIBRARY).exists():
            _build(build, RUNNER_LIBRARY, RUNNER_SOURCE, "AOT package runner")
        torch.ops.load_library(str(build / RUNNER_LIBRARY))
        return torch.classes.quickdraft_aot.AotPackage
    except Exception as exc:  # noqa: BLE001 - another PyTorch's loader API, no compiler: PyTorch's binding instead
        log.warning("quickdraft: its AOT package runner is not available (%s: %s); AOT steps run through "
                    "PyTorch's loader, which holds the GIL while a step runs (a server's streams wait on "
                    "long steps)", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


# AOTInductor's declarations of the C entry points (blocked_mm.cpp's end), for `aoti_config`
_SHIMS = {
    "blocked_mm": "AOTITorchError aoti_torch_cpu_blocked_mm(AtenTensorHandle x, AtenTensorHandle packed, "
                  "AtenTensorHandle* bias, int64_t n, AtenTensorHandle* ret0)",
    "blocked_mm_int8": "AOTITorchError aoti_torch_cpu_blocked_mm_int8(AtenTensorHandle x, AtenTensorHandle packed, "
                       "AtenTensorHandle scale, AtenTensorHandle* bias, int64_t n, AtenTensorHandle* ret0)",
    "blocked_mm_bf16": "AOTITorchError aoti_torch_cpu_blocked_mm_bf16(AtenTensorHandle x, AtenTensorHandle packed, "
                       "AtenTensorHandle* bias, int64_t n, AtenTensorHandle* ret0)",
    "blocked_mm_int4": "AOTITorchError aoti_torch_cpu_blocked_mm_int4(AtenTensorHandle x, AtenTensorHandle packed, "
                       "AtenTensorHandle* bias, int64_t n, AtenTensorHandle* ret0)",
    "attend": "AOTITorchError aoti_torch_cpu_attend(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, "
              "AtenTensorHandle mask, double scale, AtenTensorHandle* ret0)",
    "rms_norm": "AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle x, AtenTensorHandle weight, double eps, "
                "AtenTensorHandle* ret0)",
}


def aoti_config() -> dict:
    """Inductor settings that make an AOT package call the kernels' C entry points directly."""
    return {"aot_inductor.custom_ops_to_c_shims": {getattr(torch.ops.quickdraft, name).default: [decl]
                                                   for name, decl in _SHIMS.items()}}


@functools.lru_cache(maxsize=1)
def _register_fake() -> None:
    """Shapes for tracing (torch.export, torch.compile): (M, n) float32 like x."""

    @torch.library.register_fake("quickdraft::blocked_mm")
    def _(x, packed, bias, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("quickdraft::blocked_mm_int8")
    def _(x, packed, scale, bias, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("quickdraft::blocked_mm_bf16")
    def _(x, packed, bias, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("quickdraft::blocked_mm_int4")
    def _(x, packed, bias, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("quickdraft::attend")
    def _(q, k, v, mask, scale):
        B, H, T, D = q.shape
        return q.new_empty((B, T, H, D)).transpose(1, 2)

    @torch.library.register_fake("quickdraft::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("quickdraft::draw")
    def _(weights, u):
        return u.new_empty(u.shape, dtype=torch.long)

    @torch.library.register_fake("quickdraft::rejection_sample")
    def _(tokens, target_probs, draft_probs, uniform, final):
        B, k = tokens.shape
        return tokens.new_empty((B, k + 1)), tokens.new_empty((B,))

    @torch.library.register_fake("quickdraft::tree_rejection_sample")
    def _(tokens, parents, target_probs, draft_probs, uniform, final):
        return tokens.new_empty(tokens.shape[:1]), tokens.new_empty(tokens.shape[:1])


HUGE_PAGE = 2 << 20  # x86-64's and AArch64's (4 KiB base pages) transparent huge page
ARENA_BYTES = 64 << 20  # packed weights are placed one after another in mappings of this size (or the weight's)
_arena: tuple[weakref.ref, int] | None = None  # (the mapping being filled, its next free offset)
_arena_lock = threading.Lock()


def huge_pages() -> bool:
    """Whether packed weights go to memory advised for 2 MiB pages (`weights_memory`):
    QUICKDRAFT_HUGE_PAGES=0 turns it off; only where the OS has madvise(MADV_HUGEPAGE)."""
    return os.environ.get("QUICKDRAFT_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def _new_arena(size: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping of at least `size` bytes from its first 2 MiB boundary on (the
    offset returned), advised for huge pages there."""
    buf = anonymous(size + HUGE_PAGE)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, (len(buf) - start) // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages, as torch's own memory
        pass
    return buf, start


def weights_memory(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the CPU tensor t in memory the OS may back with 2 MiB pages, packed
    weights one after another in common private mappings (a mapping is freed when the last
    tensor in it goes). The matmul kernels stream every weight once a token; on 4 KiB pages a core's
    hardware prefetchers stop at every page and each page costs a TLB walk: a SmolLM2 float32
    decode step took 10-17% less time on 2 MiB pages on one AMD EPYC (Zen 4) core, where Linux's
    transparent huge pages are `madvise` (the default of many distributions; PyTorch's allocator
    does not advise them). Elsewhere (another device, a tensor under 64 KiB, huge_pages() off)
    `t.contiguous()`."""
    global _arena
    size = t.numel() * t.element_size()
    if t.device.type != "cpu" or size < 64 << 10 or not huge_pages():
        return t.contiguous()
    with _arena_lock:
        buf, used = (_arena[0](), _arena[1]) if _arena else (None, 0)
        if buf is None or used + size > len(buf):
            buf, used = _new_arena(max(ARENA_BYTES, size))
        out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=used).view(t.shape)
        _arena = (weakref.ref(buf), used + -(-size // 4096) * 4096)
    return out.copy_(t)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights q (out, in) in the int8 kernel's layout: int8 (ceil(out / 64), 8 ceil(in / 32), 256),
    per 64-output block and quad c of 4 inputs (in zero-padded to whole groups of 32), bytes 4i .. 4i + 3
    the inputs 4c .. 4c + 3 of output i (each 32-bit lane four inputs of one output, as integer
    dot-product instructions take them); zero past `out` and `in`."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"int8 blocks are made from an int8 (out, in) tensor, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    blocks, kp = -(-n // BLOCK), -(-k // GROUP) * GROUP
    padded = q.new_zeros(blocks * BLOCK, kp)
    padded[:n, :k] = q
    # (blocks, 64 out, quads, 4 in) -> (blocks, quads, 64 out, 4 in)
    return weights_memory(padded.view(blocks, BLOCK, kp // 4, 4).transpose(1, 2).reshape(blocks, kp // 4, 4 * BLOCK))


def unpack_int8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack_int8`: q (n, k) int8."""
    blocks, quads, _ = packed.shape
    return packed.view(blocks, quads, BLOCK, 4).transpose(1, 2).reshape(blocks * BLOCK, 4 * quads)[:n, :k]


def blocked_mm_int8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    n: int) -> torch.Tensor:
    """x (M, in) float32 @ (Q * scale)^T + bias -> (M, n), Q int8 (n, in) given `pack_int8`ed, scale
    (n,) per output. x is quantised per row and group of 32 inputs to int8 with one float32 scale d
    (int4's formula: d = amax / 127, round to nearest even); per group, the exact integer sum of
    the int8 activations times Q, times d, summed over the groups in order, then times the scale,
    plus the bias: the dequantised weights times the dequantised activations (llama.cpp's Q8_0
    numerics, one scale per output). blocked_core.h's int8 section has the formula and the order of
    operations (the same bits on every path, at any row count)."""
    return torch.ops.quickdraft.blocked_mm_int8.default(x, packed, scale, bias, n)


def pack(weight_t: torch.Tensor) -> torch.Tensor:
    """W (in, out) -> the kernel's layout (ceil(out / 64), in, 64), zero-padded past `out`."""
    k, n = weight_t.shape
    blocks = -(-n // BLOCK)
    padded = weight_t.new_zeros(k, blocks * BLOCK)
    padded[:, :n] = weight_t
    return weights_memory(padded.view(k, blocks, BLOCK).transpose(0, 1))


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack`: W (in, out)."""
    return packed.transpose(0, 1).reshape(packed.shape[1], -1)[:, :n]


def blocked_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x (M, in) float32 @ W + bias -> (M, n), W given `pack`ed."""
    return torch.ops.quickdraft.blocked_mm.default(x, packed, bias, n)


def pack_bf16(weight_t: torch.Tensor) -> torch.Tensor:
    """W (in, out) -> the bf16 kernel's layout: `pack`'s (ceil(out / 64), in, 64), as bfloat16
    (a float32 W is rounded to nearest even, as `.to(torch.bfloat16)` does)."""
    return pack(weight_t.to(torch.bfloat16))


def blocked_mm_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x (M, in) float32 @ W + bias -> (M, n), W bfloat16 given `pack_bf16`ed: the weights are
    widened to float32 in registers (exact), so the result is `blocked_mm`'s on W.float(), bit
    for bit, reading half its bytes."""
    return torch.ops.quickdraft.blocked_mm_bf16.default(x, packed, bias, n)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """Group-wise 4-bit weights in the int4 kernel's layout. q (out, in) in 0..15, scale and offset
    (out, in / 32): w = q * scale + offset over each group of 32 inputs. Returns uint8
    (ceil(out / 64), in / 32, 1280): per 64-output block and group, 8 quads of 4 inputs, each two
    64-byte chunks h = 0, 1 whose byte 4i + j is q[32h + i][4c + j] | q[32h + 16 + i][4c + j] << 4
    (quad c, i < 16, j < 4: each 32-bit lane four inputs of one output, as integer dot-product
    instructions take them), then the 64 scales and the 64 offsets as float16.
    offset None: the symmetric layout, w = (q - 8) * scale (a GGUF's Q4_0), 1152 bytes a group
    without the offsets (the kernel takes -8 * scale: the same bits as the offsets stored).
    Raises ValueError where a scale or offset does not fit float16."""
    n, k = q.shape
    if k % GROUP or scale.shape != (n, k // GROUP) or (offset is not None and offset.shape != scale.shape):
        raise ValueError(f"int4 blocks need in % {GROUP} == 0 and (out, in / {GROUP}) scales; got q {tuple(q.shape)}, "
                         f"scale {tuple(scale.shape)}, offset {None if offset is None else tuple(offset.shape)}")
    half = [t.to(torch.float16) for t in (scale, offset) if t is not None]
    if not all(bool(torch.isfinite(h).all()) for h in half):
        raise ValueError("int4 scales or offsets beyond float16's range")
    blocks, groups = -(-n // BLOCK), k // GROUP
    pad = blocks * BLOCK - n
    qp = torch.cat([q.to(torch.uint8), q.new_zeros(pad, k, dtype=torch.uint8)]) if pad else q.to(torch.uint8)
    # (blocks, 64 out = (h, hi, i), groups, 32 in = (c, j)) -> (blocks, groups, c, h, i, j, hi)
    qb = qp.view(blocks, 2, 2, 16, groups, 8, 4).permute(0, 4, 5, 1, 3, 6, 2)
    nibbles = (qb[..., 0] | (qb[..., 1] << 4)).reshape(blocks, groups, GROUP * BLOCK // 2)

    def per_output(h: torch.Tensor) -> torch.Tensor:  # (out, groups) float16 -> (blocks, groups, 128) bytes
        h = torch.cat([h, h.new_zeros(pad, groups)]) if pad else h
        return h.view(blocks, BLOCK, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return weights_memory(torch.cat([nibbles, *map(per_output, half)], dim=2))


def pack_int4_super(q: torch.Tensor, scale_codes: torch.Tensor, offset_codes: torch.Tensor,
                    scale_factors: torch.Tensor, offset_factors: torch.Tensor) -> torch.Tensor:
    """Group-wise 4-bit weights in the int4 kernel's super-block layout (a GGUF's Q4_K as it is;
    `quant.INT4_SUPER_BLOCKS` turns it on for models):
    q (out, in) in 0..15 as for `pack_int4`; per output and group of 32 inputs a scale code in
    0..255 and an offset code in -128..127 (out, in / 32); per output and super group of 8 groups
    (256 inputs) a scale factor D and an offset factor O (out, in / 256), float16 values. Over
    each group w = q * (scale code * D) + offset code * O (both products exact in float32).
    Returns uint8 (ceil(out / 64), in / 256, 9472): per 64-output block and super group, the 64 D
    then the 64 O as float16, then per group its nibbles as `pack_int4`'s and per half of the
    outputs (32 each) their 32 scale codes then their 32 offset codes: 4.625 bits a weight.
    Raises ValueError on other shapes, codes out of range, or a factor that is not a finite
    float16."""
    n, k = q.shape
    groups = k // GROUP
    if (k % (GROUP * SUPER) or scale_codes.shape != (n, groups) or offset_codes.shape != (n, groups)
            or scale_factors.shape != (n, groups // SUPER) or offset_factors.shape != scale_factors.shape):
        raise ValueError(f"the int4 super-block layout needs in % {GROUP * SUPER} == 0, (out, in / {GROUP}) codes "
                         f"and (out, in / {GROUP * SUPER}) factors; got q {tuple(q.shape)}, codes "
                         f"{tuple(scale_codes.shape)} / {tuple(offset_codes.shape)}, factors "
                         f"{tuple(scale_factors.shape)} / {tuple(offset_factors.shape)}")
    if (int(scale_codes.min()) < 0 or int(scale_codes.max()) > 255 or int(offset_codes.min()) < -128
            or int(offset_codes.max()) > 127):
        raise ValueError("int4 super-block codes must be 0..255 (scales) and -128..127 (offsets)")
    half = [f.to(torch.float16) for f in (scale_factors, offset_factors)]
    if not all(bool(torch.isfinite(h).all()) and torch.equal(h.float(), f.float())
               for h, f in zip(half, (scale_factors, offset_factors))):
        raise ValueError("int4 super-block factors must be finite float16 values")
    grouped = pack_int4(q, torch.zeros(n, groups), torch.zeros(n, groups))  # (blocks, groups, 1280): the nibbles
    blocks, supers, pad = grouped.shape[0], groups // SUPER, grouped.shape[0] * BLOCK - n

    def per_output(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # (out, cols) -> (blocks, cols, 64 x dtype) bytes
        t = t.to(dtype)
        t = torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t
        return t.view(blocks, BLOCK, -1).transpose(1, 2).contiguous().view(torch.uint8)

    codes = torch.stack([per_output(scale_codes, torch.uint8).view(blocks, groups, 2, 32),
                         per_output(offset_codes, torch.int8).view(blocks, groups, 2, 32)], dim=3)  # (.., half, kind, 32)
    pieces = torch.cat([grouped[..., :GROUP * BLOCK // 2], codes.reshape(blocks, groups, 2 * BLOCK)], dim=2)  # 1152
    header = torch.cat([per_output(h, torch.float16) for h in half], dim=2)  # (blocks, supers, 256)
    out = torch.cat([header, pieces.view(blocks, supers, -1)], dim=2)
    return weights_memory(out)


def int4_super(packed: torch.Tensor) -> bool:
    """Whether a packed int4 weight is in the super-block layout (`pack_int4_super`)."""
    return packed.shape[-1] == SUPER_BYTES


def int4_symmetric(packed: torch.Tensor) -> bool:
    """Whether a `pack_int4`ed weight is in the symmetric layout (no offsets: w = (q - 8) * scale)."""
    return packed.shape[-1] == GROUP * BLOCK // 2 + 2 * BLOCK


def unpack_int4(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int4`: (q (n, in) uint8, scale, offset (n, in / 32) float16); the
    symmetric layout's offset is -8 * scale; the super-block layout's scale and offset are float32
    (codes times factors, exact)."""
    if int4_super(packed):
        blocks, supers, _ = packed.shape
        header = packed[..., :4 * BLOCK].contiguous().view(torch.float16).float()  # (blocks, supers, 128)
        pieces = packed[..., 4 * BLOCK:].reshape(blocks, supers * SUPER, -1)  # (blocks, groups, 1152)
        size = GROUP * BLOCK // 2
        q, _, _ = unpack_int4(torch.cat([pieces[..., :size], pieces.new_zeros(blocks, supers * SUPER, 4 * BLOCK)], 2), n)

        def per_output(t: torch.Tensor) -> torch.Tensor:  # (blocks, cols, 64) -> (n, cols)
            return t.transpose(1, 2).reshape(blocks * BLOCK, -1)[:n]

        codes = pieces[..., size:].reshape(blocks, supers * SUPER, 2, 2, 32)  # (.., half, kind, 32)
        codes_s = per_output(codes[..., 0, :].reshape(blocks, supers * SUPER, BLOCK)).float()
        codes_o = per_output(codes[..., 1, :].reshape(blocks, supers * SUPER, BLOCK).contiguous().view(torch.int8)).float()
        factor_s = per_output(header[..., :BLOCK]).repeat_interleave(SUPER, dim=1)
        factor_o = per_output(header[..., BLOCK:]).repeat_interleave(SUPER, dim=1)
        return q, codes_s * factor_s, codes_o * factor_o
    blocks, groups, _ = packed.shape
    nib = packed[..., :GROUP * BLOCK // 2].reshape(blocks, groups, 8, 2, 16, 4)  # (blocks, groups, c, h, i, j)
    qb = torch.stack([nib & 15, nib >> 4], dim=-1)  # (..., c, h, i, j, hi)
    q = qb.permute(0, 3, 6, 4, 1, 2, 5).reshape(blocks * BLOCK, groups * GROUP)[:n]

    def per_output(lo: int) -> torch.Tensor:
        h = packed[..., lo:lo + 2 * BLOCK].contiguous().view(torch.float16)  # (blocks, groups, 64)
        return h.transpose(1, 2).reshape(blocks * BLOCK, groups)[:n]

    size = GROUP * BLOCK // 2
    scale = per_output(size)
    return q, scale, -8 * scale if int4_symmetric(packed) else per_output(size + 2 * BLOCK)


def blocked_mm_int4(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x (M, in) float32 @ W^T + bias -> (M, n), W the `pack_int4`ed weight. x is quantised per row
    and group of 32 inputs to int8 with one float32 scale d (d = amax / 127, round to nearest
    even); per group, the exact integer sum of the int8 activations times the nibbles, scaled
    (times d, then the group's scale), plus the offset times d * (the sum of the int8
    activations): the dequantised weights times the dequantised activations. blocked_core.h's
    int4 section has the formula and the order of operations (the same bits on every path)."""
    return torch.ops.quickdraft.blocked_mm_int4.default(x, packed, bias, n)


def int4_uses_vnni() -> bool:
    """Whether the int4 kernel runs vpdpbusd here (AVX-512 VNNI or AVX-VNNI, on the chosen path)."""
    return available() and bool(_lib().quickdraft_int4_vnni())


def int8_uses_vnni() -> bool:
    """Whether the int8 kernel runs the integer dot-product instruction here (vpdpbusd, NEON's sdot):
    the int4 kernel's choice (the same CPU features and the same switch, `use_vnni`)."""
    return int4_uses_vnni()


def amx_rows(int4: bool = False) -> int:
    """The smallest int8 (int4 where `int4`) call, in rows, that runs on AMX tiles here, 0 where none
    does: AMX takes the AVX-512 path's calls of that many rows or more where the CPU has AMX-INT8 and
    Linux lends this process the tile registers (blocked_amx.h); fewer rows, and every call elsewhere,
    run the vector kernels (the same bits)."""
    return int(_lib().quickdraft_amx_rows(int(int4))) if available() else 0


@contextlib.contextmanager
def use_amx(on: bool, every_call: bool = False) -> Iterator[None]:
    """int8 and int4 with (True: where the CPU has it, from `amx_rows()` rows; with `every_call`,
    one-row calls too) or without (False) AMX inside the block, process-wide; the bits are the same
    either way. For tests and benchmarks; a user's switch is QUICKDRAFT_AMX=0."""
    if not available():
        raise QuickdraftError("quickdraft's CPU kernels are not available here")
    before = _lib().quickdraft_set_amx(0 if not on else 2 if every_call else 1)
    try:
        yield
    finally:
        _lib().quickdraft_set_amx(before)


@contextlib.contextmanager
def use_attend_split(mode: str) -> Iterator[None]:
    """attend split over the threads by keys and outputs ("auto": where a call's passes, one per kv
    head and batch row for a few query rows, are too few for the threads and its keys many; "off";
    "always": every call, on one thread too) inside the block, process-wide; the bits are the same
    either way. For tests and benchmarks."""
    if not available():
        raise QuickdraftError("quickdraft's CPU kernels are not available here")
    before = _lib().quickdraft_set_attend_split({"off": 0, "auto": 1, "always": 2}[mode])
    try:
        yield
    finally:
        _lib().quickdraft_set_attend_split(before)


@contextlib.contextmanager
def use_vnni(on: bool) -> Iterator[None]:
    """int8 and int4 with (True: where the CPU has them) or without (False: maddubs + madd) the integer
    dot-product instructions (AVX-512 VNNI, AVX-VNNI) inside the block, process-wide; the bits are
    the same either way (exact integer sums). For tests and benchmarks; a user's switch is
    QUICKDRAFT_VNNI=0."""
    if not available():
        raise QuickdraftError("quickdraft's CPU kernels are not available here")
    before = _lib().quickdraft_set_vnni(int(on))
    try:
        yield
    finally:
        _lib().quickdraft_set_vnni(before)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale where mask) v for a few query rows over the cache: q (B, H, T, D),
    k / v (B, H_kv, L, D) (grouped-query heads), mask bool (B or 1, 1, T, L); (B, H, T, D) out,
    stored as (B, T, H, D); any number of query rows, each with the bits of a one-row call. D not
    a multiple of 16, or another dtype, runs PyTorch's attention. See blocked_mm.cpp's attention section for the numerics (row-invariant, the same
    bits on every path)."""
    return torch.ops.quickdraft.attend.default(q, k, v, mask, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in one call, float32: (x * r) * weight, r = 1 / sqrt(mean(x^2)
    + eps), the mean's sum in one fixed order (blocked_core.h's norm section): a row's bits depend on
    that row alone, on every path and thread count."""
    return torch.ops.quickdraft.rms_norm.default(x, weight, eps)


def runs_sampling(float32: tuple, float64: tuple = ()) -> bool:
    """Whether a sampling call (sampling.draw, the sampled chain and tree verifiers) runs as one call
    of these kernels: CPU tensors, the `float32` ones float32 (None: an absent operand) and the
    `float64` ones float64, not inside a graph being compiled (the tensor ops trace there), the
    kernels built here (QUICKDRAFT_KERNELS=0: the tensor versions)."""
    return (float32[0].device.type == "cpu" and all(t is None or t.dtype == torch.float32 for t in float32)
            and all(t.dtype == torch.float64 for t in float64) and not torch.compiler.is_compiling()
            and available())


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sampling.draw in one call on a CPU: weights (..., V) float32 >= 0, u (...) float64 U[0, 1) ->
    (...) int64 indices. The same algorithm (float64 running sums in two levels, the threshold
    below the total, the block's last positive weight past its sum, 0 without a positive total); the
    block sums in one fixed order of their own (blocked_mm.cpp's sampling section), so where a
    threshold falls within rounding of a block's end the index can differ from the tensor version's."""
    return torch.ops.quickdraft.draw.default(weights, u)


def rejection_sample(tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniform: torch.Tensor, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verify.rejection_sample (k >= 1) in one call on a CPU, each row on its own: tokens (B, k) int64,
    target_probs (B, k + 1, V) and draft_probs (B, k, V) or None float32, uniform (B, k) float32, final
    (B,) float64 -> (emitted (B, k + 1), num_accepted (B,)). The same float32 arithmetic, and the last
    token drawn as `draw` draws it: the same tokens as the tensor version beside the kernels' draw."""
    return torch.ops.quickdraft.rejection_sample.default(tokens, target_probs, draft_probs, uniform, final)


def tree_rejection_sample(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                          draft_probs: torch.Tensor | None, uniform: torch.Tensor,
                          final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verify.tree_rejection_sample's walk in one call on a CPU, each row on its own: tokens, parents
    (B, N) int64, target_probs (B, N + 1, V) and draft_probs (B, N, V) or None float32, uniform
    (B, N) float32, final (B,) float64 -> (the accepted node (B,), -1 for none; the last token (B,)).
    The same rule; a residual's mass summed in float64 in an order of its own (blocked_mm.cpp's
    sampling section) and the last token drawn as `draw` draws it."""
    return torch.ops.quickdraft.tree_rejection_sample.default(tokens, parents, target_probs, draft_probs,
                                                               uniform, final)
