"""The int8 and int4 kernels on AMX tiles (quickdraft/kernels/blocked_amx.h) give the bits of the
vector paths (AVX-512 with and without VNNI, AVX2, portable C++): at every row count 1..20 (AMX
forced onto every call, and from its own thresholds), past the thresholds and the 16-row tiles
(31, 32, 33, 40: a last tile overlapping the one before), on odd shapes and SmolLM2's, on one and
two threads; each row the bits it gets alone. And the switch: QUICKDRAFT_AMX=0, kernels.use_amx.
Skips, saying why, on a CPU (or kernel) without AMX-INT8."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from quickdraft import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel library could not be built here")

ROWS = list(range(1, 21)) + [31, 32, 33, 40]


def _amx_here() -> bool:
    if "avx512" not in kernels.cpu_isas():
        return False
    with kernels.use_isa("avx512"), kernels.use_amx(True):
        return kernels.amx_rows() > 0


needs_amx = pytest.mark.skipif(not kernels.available() or not _amx_here(),
                               reason="no AMX here: the CPU lacks AMX-INT8 or the OS does not lend the tiles")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _int8(k: int, n: int):
    g = torch.Generator().manual_seed(k * n)
    packed = kernels.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
    scale, bias = torch.rand(n, generator=g) / 100, torch.randn(n, generator=g)
    return lambda x, b=True: kernels.blocked_mm_int8(x, packed, scale, bias if b else None, n)


def _int4(k: int, n: int, symmetric: bool = False):
    g = torch.Generator().manual_seed(k + n)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) / 50
    offset = None if symmetric else -8 * scale + torch.randn(n, k // 32, generator=g) / 1000
    packed = kernels.pack_int4(q, scale, offset)
    bias = torch.randn(n, generator=g)
    return lambda x, b=True: kernels.blocked_mm_int4(x, packed, bias if b else None, n)


def _amx_against_the_vector_paths(mm, k: int, threads, rows=ROWS, portable: bool = True) -> None:
    """mm's result on AMX (every call; from its thresholds) equals AVX-512 VNNI's, AVX-512 BW's,
    AVX2's and (where `portable`) the portable path's, at every row count, on 1 and 2 threads."""
    paths = [p for p in ("avx2", "portable") if p in kernels.cpu_isas() and (portable or p != "portable")]
    x_all = torch.randn(max(rows), k, generator=torch.Generator().manual_seed(k))
    for m in rows:
        x = x_all[:m]
        for b in (True, False):
            with kernels.use_isa("avx512"), kernels.use_amx(False):
                want = mm(x, b)
                with kernels.use_vnni(False):
                    assert torch.equal(mm(x, b), want), f"m={m}: AVX-512 BW differs from VNNI"
            for p in paths:
                with kernels.use_isa(p):
                    assert torch.equal(mm(x, b), want), f"m={m}: {p} differs from AVX-512"
            for t in (1, 2):
                threads(t)
                with kernels.use_isa("avx512"):
                    for every in (True, False):
                        with kernels.use_amx(True, every_call=every):
                            got = mm(x, b)
                        assert torch.equal(got, want), \
                            f"m={m} threads={t} every_call={every}: AMX differs by {(got - want).abs().max().item()}"
            threads(1)


@needs_amx
@pytest.mark.parametrize("k,n", [(33, 200), (577, 323), (64, 1), (576, 130), (32, 64)])
def test_int8_on_amx_is_the_vector_paths_bits(k, n, threads):
    _amx_against_the_vector_paths(_int8(k, n), k, threads)


@needs_amx
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k,n", [(32, 70), (96, 323), (576, 200), (64, 1), (2048, 130)])
def test_int4_on_amx_is_the_vector_paths_bits(k, n, symmetric, threads):
    _amx_against_the_vector_paths(_int4(k, n, symmetric), k, threads)


@needs_amx
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("k,n", [(576, 960), (576, 576), (576, 3072), (1536, 576)])  # SmolLM2-135M's (qkv, o, gate_up, down)
def test_smollm2_shapes_on_amx(fmt, k, n, threads):
    mm = (_int8 if fmt == "int8" else _int4)(k, n)
    _amx_against_the_vector_paths(mm, k, threads, rows=[1, 2, 7, 8, 9, 16, 17, 20, 33], portable=False)


@needs_amx
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_each_row_on_amx_gets_the_bits_it_gets_alone(fmt):
    mm = (_int8 if fmt == "int8" else _int4)(160, 100)
    x = torch.randn(40, 160, generator=torch.Generator().manual_seed(5))
    with kernels.use_isa("avx512"):
        alone = torch.cat([mm(x[i:i + 1]) for i in range(40)])  # (one row: VNNI)
        with kernels.use_amx(True, every_call=True):
            assert torch.equal(torch.cat([mm(x[i:i + 1]) for i in range(40)]), alone)
        for m in (8, 16, 17, 24, 40):
            assert torch.equal(mm(x[:m]), alone[:m]), f"{fmt} m={m}"


@needs_amx
def test_amx_rows_and_the_switches():
    with kernels.use_isa("avx512"):
        assert kernels.amx_rows() == kernels.amx_rows(int4=True) == 17
        with kernels.use_amx(True, every_call=True):
            assert kernels.amx_rows() == kernels.amx_rows(int4=True) == 1
        with kernels.use_amx(False):
            assert kernels.amx_rows() == kernels.amx_rows(int4=True) == 0
    for isa in ("avx2", "portable"):  # AMX is the AVX-512 path's
        with kernels.use_isa(isa):
            assert kernels.amx_rows() == 0


def test_the_amx_variable_turns_it_off():
    code = "from quickdraft import kernels\nprint(kernels.amx_rows(), kernels.amx_rows(int4=True))"
    env = {k: v for k, v in os.environ.items() if k != "QUICKDRAFT_ISA"}
    off = subprocess.run([sys.executable, "-c", code], env=dict(env, QUICKDRAFT_AMX="0"), capture_output=True,
                         text=True, timeout=300)
    assert off.stdout.split() == ["0", "0"], off
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert on.stdout.split() == (["17", "17"] if _amx_here() and kernels.isa() == "avx512" else ["0", "0"]), on
