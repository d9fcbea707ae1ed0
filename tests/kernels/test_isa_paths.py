"""The kernels' instruction-set paths (AVX-512, AVX2 + FMA, portable C++) give the same bits (the
ARM NEON path: test_neon.py, under qemu):
every matmul format and `attend`, at every row count past each point where a path changes its
row grouping, on odd shapes and on one and two threads; and QUICKDRAFT_ISA picks the path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from quickdraft import kernels
from quickdraft.errors import QuickdraftError

from test_blocked_mm import _attention_case, int4_activations

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel library could not be built here")

PATHS = kernels.cpu_isas() if kernels.available() else ()
# 1..16: every row grouping of every path (1 row; 2-3 rows; groups of 3, 4 and 6 and their
# remainders); 17, 24, 40 and 65: past PyTorch's int8 / int4 switch (DENSE_ROWS 16) and 64 (where ours once switched)
ROWS = list(range(1, 17)) + [17, 24, 40, 65]


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def on_every_path(f, threads, vnni=(True,)) -> dict:
    """f() on each path this CPU has, on one and on two threads (and with int4's VNNI on and off
    where `vnni` says): {(path, threads, vnni): result}."""
    out = {}
    for isa in PATHS:
        with kernels.use_isa(isa):
            for on in vnni:
                with kernels.use_vnni(on):
                    for t in (1, 2):
                        threads(t)
                        out[isa, t, on] = f()
    return out


def assert_all_equal(results: dict, what: str) -> None:
    (ref_key, ref), *rest = results.items()
    for key, got in rest:
        assert torch.equal(got, ref), f"{what}: {key} differs from {ref_key} by {(got - ref).abs().max().item()}"


def test_the_paths_this_cpu_runs():
    assert PATHS[-1] == "portable" and set(PATHS) <= set(kernels.ISAS)
    chosen = os.environ.get("QUICKDRAFT_ISA", "").lower() or PATHS[0]  # the best, unless the variable says
    assert kernels.isa() == chosen
    with kernels.use_isa("portable"):
        assert kernels.isa() == "portable"
    assert kernels.isa() == chosen
    with pytest.raises(QuickdraftError, match="not one of"):
        with kernels.use_isa("sse9"):
            pass


def _x(m, k, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k,n", [(33, 200), (577, 323), (1, 5), (64, 64)])
def test_float32_and_int8_matmuls_are_the_same_bits_on_every_path(k, n, threads):
    g = torch.Generator().manual_seed(k * n)
    w = torch.randn(k, n, generator=g) / k ** 0.5
    packed = kernels.pack(w)
    qpacked = kernels.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
    scale, bias = torch.rand(n, generator=g) / 100, torch.randn(n, generator=g)
    for m in ROWS:
        x = _x(m, k, m)
        assert_all_equal(on_every_path(lambda: kernels.blocked_mm(x, packed, bias, n), threads), f"float32 m={m}")
        assert_all_equal(on_every_path(lambda: kernels.blocked_mm(x, packed, None, n), threads), f"float32 m={m}")
        for b in (bias, None):  # (with and without the integer dot-product instructions)
            assert_all_equal(on_every_path(lambda: kernels.blocked_mm_int8(x, qpacked, scale, b, n), threads,
                                           (True, False)), f"int8 m={m}")


@pytest.mark.parametrize("symmetric", [False, True])
# 4-6-row groups (5-6 in blocks under 64 groups) take the AVX-512 kernel that runs a block's halves in
# turn where one read stream is the choice (AMD; test_row_streams.py runs it on any CPU)
@pytest.mark.parametrize("k,n", [(32, 70), (96, 323), (576, 200), (64, 1), (2048, 130)])
def test_int4_matmuls_are_the_same_bits_on_every_path(k, n, symmetric, threads):
    g = torch.Generator().manual_seed(k + n)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) / 50
    offset = None if symmetric else -8 * scale + torch.randn(n, k // 32, generator=g) / 1000
    packed = kernels.pack_int4(q, scale, offset)
    bias = torch.randn(n, generator=g)
    for m in ROWS:
        x = _x(m, k, m)
        for b in (bias, None):
            assert_all_equal(on_every_path(lambda: kernels.blocked_mm_int4(x, packed, b, n), threads, (True, False)),
                             f"int4 m={m}")


@pytest.mark.parametrize("k,n", [(256, 70), (512, 323), (2048, 130), (256, 1)])
def test_int4_super_block_matmuls_are_the_same_bits_on_every_path(k, n, threads):
    from test_neon import int4_super_case

    packed = kernels.pack_int4_super(*int4_super_case(n, k, torch.Generator().manual_seed(k + n)))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for m in ROWS:
        x = _x(m, k, m)
        for b in (bias, None):
            assert_all_equal(on_every_path(lambda: kernels.blocked_mm_int4(x, packed, b, n), threads, (True, False)),
                             f"int4 super-block m={m}")


def _awkward_groups() -> torch.Tensor:
    """Rows of one group of 32 inputs each, chosen where a quantiser could round or branch another
    way: ties (amax 127, so d = 1 and x * (1 / d) lands on halves: round half to even), the clamp's
    edge, signed zeros, subnormal and tiny groups (d under FLT_MIN: zeros), the largest floats,
    NaN and infinities (the row's group NaN), and random groups over many magnitudes."""
    g = torch.Generator().manual_seed(7)
    halves = torch.arange(-16, 16, dtype=torch.float32) + 0.5
    rows = [torch.cat([torch.tensor([127.0]), halves[1:]]), torch.cat([torch.tensor([-127.0]), -halves[1:]]),
            torch.full((32,), 127.0), torch.zeros(32), -torch.zeros(32), torch.full((32,), 1e-40),
            torch.full((32,), 1e-38), torch.tensor([3.4e38] + [1.0] * 31), torch.tensor([3.4e38, -3.4e38] * 16)]
    for bad in (float("nan"), float("inf"), -float("inf")):
        r = torch.randn(32, generator=g)
        r[5] = bad
        rows.append(r)
    for e in range(-30, 31, 6):
        rows.append(torch.randn(32, generator=g) * 2.0 ** e)
        rows.append(torch.randint(-300, 300, (32,), generator=g).float() / 2 ** (e % 5))
    return torch.stack(rows)


def test_the_activation_quantisers_are_the_same_bits_on_every_path(threads):
    """Every path's int8 activations and scales (the vector quantisers follow the portable one's
    operations) on awkward groups, read back through one-hot int4 weights: with scale 1 and
    offset 0 output j is a_j * d exactly, and with scale 0 and offset 1 it is d * sum_k a_k; and
    they are the formula's (int4_activations). The int8 kernel on the same rows agrees across paths."""
    x = _awkward_groups()

    def marked(y):  # NaN positions marked (NaN != NaN), the rest as they are
        return torch.cat([y.isnan().float(), y.nan_to_num(0.0)])

    eye = torch.eye(32, dtype=torch.uint8)
    pick = kernels.pack_int4(eye, torch.ones(32, 1), torch.zeros(32, 1))
    total = kernels.pack_int4(eye, torch.zeros(32, 1), torch.ones(32, 1))
    for m in (1, 6, len(x)):  # (one row on one thread, and rows split over two)
        rows = x[:m]
        picked = on_every_path(lambda: marked(kernels.blocked_mm_int4(rows, pick, None, 32)), threads)
        assert_all_equal(picked, f"int4 activations m={m}")
        assert_all_equal(on_every_path(lambda: marked(kernels.blocked_mm_int4(rows, total, None, 32)), threads),
                         f"int4 activation sums m={m}")
    mask, got = next(iter(picked.values())).chunk(2)
    finite = torch.isfinite(x).all(dim=1)
    want = int4_activations(x[finite]).float()  # a * d: one float32 rounding of an exact product
    assert torch.equal(got[finite], want) and mask[~finite].all() and not mask[finite].any()
    halves_to_even = [-14.0, -14, -12, -12, -10, -10, -8, -8, -6, -6, -4, -4, -2, -2, 0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10,
                      12, 12, 14, 14, 16]  # (x = -14.5, -13.5, ..., 15.5 with d = 1)
    assert torch.equal(got[0, 1:], torch.tensor(halves_to_even))
    q8 = kernels.pack_int8(torch.eye(32, dtype=torch.int8) * 127)
    assert_all_equal(on_every_path(lambda: marked(kernels.blocked_mm_int8(x, q8, torch.ones(32), None, 32)), threads,
                                   (True, False)), "int8 on awkward rows")


def test_int4_uses_vnni_where_the_cpu_has_it():
    """vpdpbusd runs where the CPU has it (so the comparisons above cover both instructions; int8
    makes int4's choice)."""
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    for isa, flag in (("avx512", "avx512_vnni"), ("avx2", "avx_vnni")):
        if isa in PATHS:
            with kernels.use_isa(isa):
                assert kernels.int4_uses_vnni() == kernels.int8_uses_vnni() == (flag in flags), isa
                with kernels.use_vnni(False):
                    assert not kernels.int4_uses_vnni()
    with kernels.use_isa("portable"):
        assert not kernels.int4_uses_vnni()


@pytest.mark.parametrize("B,H,Hkv,T,L,D", [(1, 8, 4, 1, 300, 64), (3, 9, 3, 5, 77, 64), (2, 4, 4, 11, 40, 128),
                                           (1, 8, 1, 12, 200, 64), (2, 6, 2, 3, 1, 32), (1, 9, 3, 7, 33, 16),
                                           (1, 3, 3, 2, 517, 48), (1, 9, 3, 20, 1100, 64), (2, 6, 3, 7, 300, 32),
                                           (1, 4, 1, 4, 150, 128)])
def test_attend_is_the_same_bits_on_every_path(B, H, Hkv, T, L, D, threads):
    q, k, v, mask = _attention_case(B, H, Hkv, T, L, D, seed=T * L)
    mask[..., 0, :3] = False  # a row that skips the first keys (and, where L <= 3, sees none: zeros)
    assert_all_equal(on_every_path(lambda: kernels.attend(q, k, v, mask, D ** -0.5), threads), "attend")
    # scores that make exp underflow and hit its clamp (a large spread), on every path alike
    assert_all_equal(on_every_path(lambda: kernels.attend(q * 30, k, v, mask, D ** -0.5), threads), "attend x30")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,T,L,D", [(1, 9, 3, 1, 300, 64), (2, 8, 4, 6, 77, 64), (1, 8, 1, 12, 200, 64),
                                           (1, 4, 2, 20, 129, 128), (2, 6, 3, 3, 17, 32), (1, 3, 3, 2, 517, 48)])
def test_attend_reads_a_16_bit_cache_as_its_float32_copy_on_every_path(B, H, Hkv, T, L, D, dtype, threads):
    """kv_cache_dtype float16 / bfloat16: keys and values widened as they are read (exact), so every
    path gives the bits of the float32 kernel on the widened copies, whole or as a slice of a bigger
    cache (the engine's view: rows and positions past the request's)."""
    q, k, v, mask = _attention_case(B, H, Hkv, T, L, D, seed=T * L + 1)
    kh, vh = (k * 4).to(dtype), v.to(dtype)
    big_k = torch.randn(B + 1, Hkv, L + 9, D).to(dtype)
    big_v = torch.randn(B + 1, Hkv, L + 9, D).to(dtype)
    big_k[:B, :, :L], big_v[:B, :, :L] = kh, vh
    got = on_every_path(lambda: kernels.attend(q, kh, vh, mask, D ** -0.5), threads)
    assert_all_equal(got, f"attend {dtype}")
    ref = next(iter(got.values()))
    for isa in PATHS:
        with kernels.use_isa(isa):
            assert torch.equal(kernels.attend(q, kh.float(), vh.float(), mask, D ** -0.5), ref), isa
            assert torch.equal(kernels.attend(q, big_k[:B, :, :L], big_v[:B, :, :L], mask, D ** -0.5), ref), isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,T,L,D", [(1, 9, 3, 1, 1300, 64), (1, 9, 3, 5, 700, 64), (2, 8, 4, 4, 333, 128),
                                           (1, 3, 3, 2, 517, 48), (1, 8, 2, 3, 9, 64), (1, 9, 3, 1, 1, 16)])
def test_attend_split_over_the_threads_keeps_every_rows_bits(B, H, Hkv, T, L, D, dtype, threads):
    """A call whose passes are too few for the threads is split by keys (scores), rows (softmax)
    and outputs (weighted sums): every row keeps the bits of a whole pass, on every path, one and
    two threads, for 1-3 rows and the wide passes of 12 and more (4-5 tokens x 3 query heads),
    16-bit caches, a row that sees no key and a tree's holes in the mask."""
    q, k, v, mask = _attention_case(B, H, Hkv, T, L, D, seed=T * L + 2)
    k, v = k.to(dtype), v.to(dtype)
    mask[..., 0, :min(L, 20)] = False  # the first row skips the first keys (L = 1: it sees none)
    if T > 2 and L > 40:
        mask[..., T - 1, L - T - 30:L - T - 5] = False  # holes mid-row, as a token tree's
    with kernels.use_attend_split("off"):
        threads(1)
        with kernels.use_isa("portable"):
            ref = kernels.attend(q, k, v, mask, D ** -0.5)
    for mode in ("always", "auto"):
        with kernels.use_attend_split(mode):
            got = on_every_path(lambda: kernels.attend(q, k, v, mask, D ** -0.5), threads)
        for key, out in got.items():
            assert torch.equal(out, ref), f"{mode} {key}: {(out - ref).abs().max().item()}"


def test_an_unknown_isa_variable_is_one_clear_error():
    env = dict(os.environ, QUICKDRAFT_ISA="sse9")
    code = "from quickdraft import kernels\ntry:\n    kernels.available()\nexcept Exception as e:\n    print(type(e).__name__, e)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "QuickdraftError QUICKDRAFT_ISA=sse9: 'sse9' is not one of portable, avx2, avx512, neon" in out.stdout, out


@pytest.mark.parametrize("isa", ["avx2", "portable", "avx512", "neon"])
def test_the_isa_variable_picks_the_path(isa):
    env = dict(os.environ, QUICKDRAFT_ISA=isa.upper())
    code = ("from quickdraft import kernels\nfrom quickdraft.model.quant import blocked_supported\n"
            "try:\n    print(kernels.isa(), blocked_supported())\nexcept Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if isa in PATHS:
        assert out.stdout.split() == [isa, str(isa != "portable")], out
    else:  # a path this CPU lacks: an error, not another path
        assert f"QuickdraftError QUICKDRAFT_ISA={isa}: this CPU has no" in out.stdout, out


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_chunk_and_panel_boundaries_keep_each_rows_bits(fmt):
    """AVX2 / AVX-512 take several rows through a block in 16 KB chunks (64 block rows of float32,
    128 of bfloat16) and panels of 16 rows: K on each side of a chunk boundary and row counts on
    each side of a panel give every path's bits, and each row the bits it gets alone. (int8 has its
    own kernels, on int8 activations: test_blocked_mm's int8 tests.)"""
    n = 70  # a full block and a partial one
    for k in (63, 64, 65, 127, 128, 129, 255, 256, 257):
        g = torch.Generator().manual_seed(k)
        bias = torch.randn(n, generator=g)
        if fmt == "bf16":
            packed = kernels.pack_bf16(torch.randn(k, n, generator=g).to(torch.bfloat16))
            mm = lambda x: kernels.blocked_mm_bf16(x, packed, bias, n)  # noqa: E731
        else:
            packed = kernels.pack(torch.randn(k, n, generator=g))
            mm = lambda x: kernels.blocked_mm(x, packed, bias, n)  # noqa: E731
        x = _x(33, k, k)
        with kernels.use_isa("portable"):
            want = torch.cat([mm(x[i:i + 1]) for i in range(33)])
        for isa in PATHS:
            with kernels.use_isa(isa):
                for m in (2, 3, 4, 6, 7, 9, 16, 17, 33):
                    assert torch.equal(mm(x[:m]), want[:m]), f"{fmt} {isa} k={k} m={m}"


@pytest.mark.parametrize("k", [576, 7, 16, 100, 2048])
def test_rms_norm_is_the_same_bits_on_every_path_and_close_to_pytorchs(k, threads):
    """One call per RMSNorm (PyTorch's CPU rms_norm is several operations): every path and thread
    count give the same bits, each row its bits alone (K past and short of whole 16-float pieces),
    within float32 rounding of PyTorch's; zeros stay zeros (eps), a NaN stays in its row."""
    g = torch.Generator().manual_seed(k)
    w = torch.randn(k, generator=g)
    x = torch.randn(3, 67, k, generator=g) * 3
    x[0, 1] = 0
    x[1, 2, k // 2] = float("nan")
    got = on_every_path(lambda: kernels.rms_norm(x, w, 1e-5), threads)
    assert_all_equal({key: y.nan_to_num(7.0) for key, y in got.items()}, f"rms_norm k={k}")
    ref = next(iter(got.values()))
    rows = x.view(-1, k)
    alone = torch.cat([kernels.rms_norm(rows[i:i + 1], w, 1e-5) for i in range(0, rows.shape[0], 13)])
    assert torch.equal(alone.nan_to_num(7.0), ref.view(-1, k)[::13].nan_to_num(7.0))
    assert torch.equal(ref[0, 1], torch.zeros(k)) and ref[1, 2].isnan().all() and not ref[1, 3].isnan().any()
    finite = ~x.isnan().any(-1)
    torch.testing.assert_close(ref[finite], F.rms_norm(x, (k,), w, 1e-5)[finite], rtol=2e-6, atol=2e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(x, w[1:], 1e-5)
