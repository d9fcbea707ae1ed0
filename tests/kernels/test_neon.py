"""The ARM NEON path really runs: tests/kernels/neon_harness.cpp (the kernels of blocked_core.h
without PyTorch) is cross-compiled for AArch64 with Debian's aarch64-linux-gnu-g++ and run under
qemu-user, and its outputs equal the x86 library's (torch.ops.quickdraft) bit for bit, for every
kernel (float32, bfloat16, int8, int4 matmuls and attend), at row counts past each point where a
path changes its row grouping, on odd shapes, with the work split into one or several pieces
(threads). The same harness built natively runs the x86 paths, a check of the harness itself.
Skips, saying why, where the cross compiler or qemu-aarch64 is missing (.ci/run installs both)."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from quickdraft import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel library could not be built here")

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("neon_harness.cpp")
FLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", f"-I{ROOT}"]  # (-ffp-contract=off: as the library)
CROSS, QEMU, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu"
ROWS = [1, 2, 3, 4, 5, 6, 7, 9, 16, 17, 65]  # NEON: 1 row; groups of 3 and 2 (+1); int8 / int4: 4s, then 3, 2, 1


def _build(compiler: str, out: Path) -> Path:
    done = subprocess.run([compiler, *FLAGS, str(HARNESS), "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{compiler} failed on the harness:\n{done.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def neon(tmp_path_factory):
    """A function running the AArch64 harness under qemu on the NEON path."""
    missing = [tool for tool in (CROSS, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the NEON path cannot run here "
                    "(apt-get install g++-aarch64-linux-gnu qemu-user)")
    exe = _build(CROSS, tmp_path_factory.mktemp("neon") / "neon_harness")
    return lambda *args, path="neon": _run([QEMU, "-L", SYSROOT, str(exe), path, *args])


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A function running the harness built for this machine, on a path named first."""
    compiler = next(filter(shutil.which, ("g++", "c++", "clang++")), None)
    if compiler is None:
        pytest.skip("no native C++ compiler")
    exe = _build(compiler, tmp_path_factory.mktemp("native") / "harness")
    return lambda path, *args: _run([str(exe), path, *args])


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}: exit {done.returncode}\n{done.stderr[-2000:]}"


def _case_file(path: Path, dims: list[int], scale: float, arrays: list[torch.Tensor]) -> Path:
    blob = struct.pack("<8q", *(dims + [0] * (8 - len(dims)))) + struct.pack("<d", scale)
    blob += b"".join(a.contiguous().view(torch.uint8).numpy().tobytes() for a in arrays)
    path.write_bytes(blob)
    return path


def _harness(run, tmp_path: Path, kernel: str, dims: list[int], scale: float, arrays: list[torch.Tensor],
             shape: tuple[int, ...], path: str | None = None) -> torch.Tensor:
    src = _case_file(tmp_path / "in.bin", dims, scale, arrays)
    out = tmp_path / "out.bin"
    out.unlink(missing_ok=True)
    if path is None:
        run(kernel, str(src), str(out))
    else:
        run(path, kernel, str(src), str(out))
    return torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.float32).view(shape)


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    assert torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32)), \
        f"{what}: differs by {(got - want).abs().max().item()} at {int((got != want).sum())} places"


def int4_super_case(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random operands of `kernels.pack_int4_super`: nibbles, every scale and offset code, float16 factors."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    codes_s = torch.randint(0, 256, (n, k // 32), generator=g)
    codes_o = torch.randint(-128, 128, (n, k // 32), generator=g)
    factors = [(torch.rand(n, k // 256, generator=g) / 2000 + 1e-6).half().float() for _ in range(2)]
    return q, codes_s, codes_o, *factors


def _matmul_cases(kernel: str, k: int, n: int):
    """(name, args for the library, harness dims prefix, harness arrays) per row count."""
    g = torch.Generator().manual_seed(k * n + len(kernel))
    bias = torch.randn(n, generator=g)
    if kernel == "f32":
        packed = kernels.pack(torch.randn(k, n, generator=g) / k ** 0.5)
        lib, extra = lambda x, b: kernels.blocked_mm(x, packed, b, n), []
    elif kernel == "bf16":
        packed = kernels.pack_bf16(torch.randn(k, n, generator=g) / k ** 0.5)
        lib, extra = lambda x, b: kernels.blocked_mm_bf16(x, packed, b, n), []
    elif kernel == "int8":
        packed = kernels.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
        scale = torch.rand(n, generator=g) / 100
        lib, extra = lambda x, b: kernels.blocked_mm_int8(x, packed, scale, b, n), [scale]
    elif kernel == "int4-super":  # the super-block layout: codes and float16 factors
        packed = kernels.pack_int4_super(*int4_super_case(n, k, g))
        lib, extra = lambda x, b: kernels.blocked_mm_int4(x, packed, b, n), []
    else:  # int4, int4-sym (the symmetric layout: no offsets)
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        s = torch.rand(n, k // 32, generator=g) / 50
        offset = None if kernel == "int4-sym" else -8 * s + torch.randn(n, k // 32, generator=g) / 1000
        packed = kernels.pack_int4(q, s, offset)
        lib, extra = lambda x, b: kernels.blocked_mm_int4(x, packed, b, n), []
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        b = bias if m % 2 else None  # with and without a bias, alternately
        pieces = 1 if m < 5 else 3
        arrays = [x, packed, *extra] + ([b] if b is not None else [])
        dims = [m, k, n, int(b is not None), pieces] + ([{"int4-sym": 1, "int4-super": 2}.get(kernel, 0)]
                                                         if kernel.startswith("int4") else [])
        yield f"{kernel} {k}x{n} m={m} bias={b is not None} pieces={pieces}", lib(x, b), dims, arrays


MATMULS = [("f32", 33, 200), ("f32", 577, 323), ("f32", 1, 5), ("bf16", 33, 200), ("bf16", 577, 323), ("bf16", 2, 64),
           ("int8", 33, 200), ("int8", 577, 323), ("int8", 64, 1), ("int8", 576, 130), ("int4", 32, 70), ("int4", 96, 323),
           ("int4", 576, 200), ("int4", 64, 1), ("int4", 2048, 130), ("int4-sym", 96, 323), ("int4-sym", 576, 70),
           ("int4-super", 256, 70), ("int4-super", 512, 323), ("int4-super", 2048, 130)]


@pytest.mark.parametrize("kernel,k,n", MATMULS)
def test_neon_matmuls_are_the_x86_librarys_bits(kernel, k, n, neon, tmp_path):
    # int8 and int4: with sdot (qemu's CPU has the dot-product extension) and without (vmull + vpadal)
    for path in ("neon", "neon-novnni") if kernel.startswith("int") else ("neon",):
        for what, want, dims, arrays in _matmul_cases(kernel, k, n):
            got = _harness(lambda *a: neon(*a, path=path), tmp_path, kernel.split("-")[0], dims, 0.0, arrays,
                           tuple(want.shape))
            _same_bits(got, want, f"{path} {what}")


def test_neon_activation_quantiser_is_the_x86_librarys_bits(neon, tmp_path):
    """NEON's quantiser on awkward groups (ties, signed zeros, subnormal, huge, NaN and infinite
    inputs: test_isa_paths), read through one-hot int4 weights (output j = a_j * d) and an int8
    identity: the x86 library's bits."""
    from test_isa_paths import _awkward_groups

    x = _awkward_groups()
    eye = torch.eye(32, dtype=torch.uint8)
    pick = kernels.pack_int4(eye, torch.ones(32, 1), torch.zeros(32, 1))
    q8, scale = kernels.pack_int8(torch.eye(32, dtype=torch.int8) * 127), torch.ones(32)
    for path in ("neon", "neon-novnni"):
        for m in (1, 6, len(x)):
            want = kernels.blocked_mm_int4(x[:m], pick, None, 32)
            got = _harness(lambda *a: neon(*a, path=path), tmp_path, "int4", [m, 32, 32, 0, 3], 0.0, [x[:m], pick],
                           (m, 32))
            _same_bits(got, want, f"{path} int4 activations m={m}")
            want = kernels.blocked_mm_int8(x[:m], q8, scale, None, 32)
            got = _harness(lambda *a: neon(*a, path=path), tmp_path, "int8", [m, 32, 32, 0, 3], 0.0,
                           [x[:m], q8, scale], (m, 32))
            _same_bits(got, want, f"{path} int8 activations m={m}")


def _attention_case(B, H, Hkv, T, L, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    pos = torch.randint(L // 2, L, (B, T), generator=g)
    mask = (torch.arange(L) <= pos[..., None])[:, None]
    mask[..., 0, :3] = False  # a row that skips the first keys (and, where L <= 3, sees none: zeros)
    if T > 1 and L > 2:  # a row with a hole among its keys (a token tree's node): keys ranked, not slotted
        mask[..., T - 1, L // 2 - 1] = False
    return q, k, v, mask


ATTENTION = [(1, 8, 4, 1, 300, 64), (3, 9, 3, 5, 77, 64), (2, 4, 4, 11, 40, 128), (1, 8, 1, 12, 200, 64),
             (2, 6, 2, 3, 1, 32), (1, 9, 3, 7, 33, 16), (1, 3, 3, 2, 517, 48), (1, 6, 2, 17, 70, 64)]


def _attend(run, tmp_path, B, H, Hkv, T, L, D, path=None):
    q, k, v, mask = _attention_case(B, H, Hkv, T, L, D, seed=T * L)
    for spread in (1.0, 30.0):  # 30: scores that make exp underflow and hit its clamp
        want = kernels.attend(q * spread, k, v, mask, D ** -0.5).transpose(1, 2)  # (B, T, H, D)
        dims = [B, H, Hkv, T, L, D, B, 1 + (B * Hkv) % 3]
        got = _harness(run, tmp_path, "attend", dims, D ** -0.5, [q * spread, k, v, mask], (B, T, H, D), path)
        _same_bits(got, want, f"{path or 'NEON'} attend {(B, H, Hkv, T, L, D)} x{spread:g}")
    # a 16-bit KV cache's keys and values (NEON widens them before its pass, the x86 paths as they load)
    for name, dtype in (("attend-f16", torch.float16), ("attend-bf16", torch.bfloat16)):
        kh, vh = (k * 3).to(dtype), v.to(dtype)
        want = kernels.attend(q, kh, vh, mask, D ** -0.5).transpose(1, 2)
        dims = [B, H, Hkv, T, L, D, B, 2]
        got = _harness(run, tmp_path, name, dims, D ** -0.5, [q, kh, vh, mask], (B, T, H, D), path)
        _same_bits(got, want, f"{path or 'NEON'} {name} {(B, H, Hkv, T, L, D)}")
    # one mask row for every batch row (broadcast)
    want = kernels.attend(q, k, v, mask[:1], D ** -0.5).transpose(1, 2)
    got = _harness(run, tmp_path, "attend", [B, H, Hkv, T, L, D, 1, 2], D ** -0.5, [q, k, v, mask[:1]], (B, T, H, D), path)
    _same_bits(got, want, f"{path or 'NEON'} attend {(B, H, Hkv, T, L, D)} broadcast mask")


@pytest.mark.parametrize("B,H,Hkv,T,L,D", ATTENTION)
def test_neon_attend_is_the_x86_librarys_bits(B, H, Hkv, T, L, D, neon, tmp_path):
    _attend(neon, tmp_path, B, H, Hkv, T, L, D)


@pytest.mark.parametrize("kernel,k,n", MATMULS[::2])
def test_the_native_harness_gives_the_librarys_bits_on_every_x86_path(kernel, k, n, native, tmp_path):
    """The harness's reading, splitting and writing, checked where no emulator is involved."""
    paths = kernels.cpu_isas() + tuple(f"{p}-novnni" for p in kernels.cpu_isas() if kernel.startswith("int"))
    for path in paths:  # (int8 and int4 with and without the integer dot-product instructions)
        for what, want, dims, arrays in _matmul_cases(kernel, k, n):
            _same_bits(_harness(native, tmp_path, kernel.split("-")[0], dims, 0.0, arrays, tuple(want.shape), path),
                       want, f"{path} {what}")


def test_the_native_harness_attends_as_the_library(native, tmp_path):
    for path in kernels.cpu_isas():
        _attend(native, tmp_path, 3, 9, 3, 5, 77, 64, path)
        _attend(native, tmp_path, 1, 3, 3, 2, 517, 48, path)


def test_the_harness_refuses_a_path_this_build_lacks(native, tmp_path):
    src = _case_file(tmp_path / "in.bin", [1, 1, 1, 0, 1], 0.0, [torch.zeros(1), torch.zeros(1, 1, 64)])
    lacking = next(p for p in kernels.ISAS if p not in kernels.cpu_isas())  # neon on x86, avx2 / avx512 on ARM
    with pytest.raises(AssertionError, match=f"has no {lacking} path"):
        native(lacking, "f32", str(src), str(tmp_path / "out.bin"))
