"""quickdraft's small-M float32 CPU kernel (quickdraft/kernels/blocked_mm.cpp, issue 19): the
matmul it computes, every row independent of the others (decode and verify rows get the same
bits), the layout, its errors, and the `blocked` weight format built on it."""

from __future__ import annotations

import pytest
import torch

from quickdraft import kernels
from quickdraft.model.formats import Int4BlockedLinear, Int4TorchLinear, Int8BlockedLinear
from quickdraft.model.quant import blocked_supported, make_linear, row_invariant, weight_format

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel library could not be built here")


@pytest.fixture(params=kernels.cpu_isas() if kernels.available() else ["none"])
def isa(request):
    """The test runs on each kernel path this CPU has (AVX-512, AVX2 + FMA, portable)."""
    with kernels.use_isa(request.param):
        yield request.param


def case(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g) / k ** 0.5, torch.randn(n, generator=g)


@pytest.mark.parametrize("k,n", [(64, 64), (100, 70), (576, 960), (33, 200), (1, 5)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 40])
def test_blocked_mm_is_the_matmul(m, k, n, isa):
    x, w, b = case(m, k, n)
    packed = kernels.pack(w)
    assert packed.shape == (-(-n // 64), k, 64) and torch.equal(kernels.unpack(packed, n), w)
    want = x.double() @ w.double()
    got = kernels.blocked_mm(x, packed, None, n)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * (want.abs().max() + 1)
    got_b = kernels.blocked_mm(x, packed, b, n)
    assert (got_b.double() - (want + b.double())).abs().max() <= 1e-5 * (want.abs().max() + 1)


@pytest.mark.parametrize("m", [2, 3, 5, 8, 17])
def test_each_row_gets_the_bits_it_gets_alone(m, isa):
    """The property that makes a verify row's matmuls equal the decode step's for the same input:
    a row's sums do not depend on how many rows come with it, or on the thread count."""
    x, w, b = case(m, 96, 300, seed=m)
    packed = kernels.pack(w)
    together = kernels.blocked_mm(x, packed, b, 300)
    alone = torch.cat([kernels.blocked_mm(x[i:i + 1], packed, b, 300) for i in range(m)])
    assert torch.equal(together, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(kernels.blocked_mm(x, packed, b, 300), together)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_and_no_rows():
    x, w, _ = case(6, 80, 130)
    packed = kernels.pack(w)
    wide = torch.randn(6, 200)
    wide[:, 10:90] = x
    view = wide[:, 10:90]  # rows 200 floats apart
    assert torch.equal(kernels.blocked_mm(view, packed, None, 130), kernels.blocked_mm(x, packed, None, 130))
    assert kernels.blocked_mm(x[:0], packed, None, 130).shape == (0, 130)


def test_bad_operands_are_one_clear_error():
    x, w, _ = case(2, 32, 64)
    packed = kernels.pack(w)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.blocked_mm(x.double(), packed, None, 64)
    with pytest.raises(RuntimeError, match="x has 31 columns, the weight 32 rows"):
        kernels.blocked_mm(x[:, :31], packed, None, 64)
    with pytest.raises(RuntimeError, match="n does not match"):
        kernels.blocked_mm(x, packed, None, 65)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.blocked_mm(x, packed, torch.zeros(3), 64)


def test_traceable_shape():
    x, w, b = case(3, 40, 90)
    packed = kernels.pack(w)
    f = torch.compile(lambda x: kernels.blocked_mm(x, packed, b, 90) * 2, backend="eager", fullgraph=True)
    assert torch.equal(f(x), kernels.blocked_mm(x, packed, b, 90) * 2)


def test_the_float32_cpu_format_and_its_switch(monkeypatch):
    cpu = torch.device("cpu")
    want = "blocked" if blocked_supported() else "transposed"
    assert weight_format(cpu, torch.float32, None) == want
    lin = torch.nn.Linear(48, 100)
    fast = make_linear([lin], "blocked")
    x = torch.randn(4, 48)
    assert (fast(x) - lin(x)).abs().max() <= 1e-5
    assert torch.equal(fast.dequantized(torch.float32), lin.weight.detach())
    assert fast.bytes_read() == (2 * 64 * 48 + 100) * 4  # two padded blocks and the bias
    monkeypatch.setenv("QUICKDRAFT_KERNELS", "0")
    assert weight_format(cpu, torch.float32, None) == "transposed"


@pytest.mark.parametrize("k,n", [(64, 64), (100, 70), (576, 960), (1, 5)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 13])
def test_int8_blocks_are_the_scaled_matmul_and_rows_stay_independent(m, k, n, isa):
    x, _, b = case(m, k, n, seed=k + m)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    scale = torch.rand(n) / 100
    packed = kernels.pack_int8(q)
    assert packed.dtype == torch.int8 and packed.shape == (-(-n // 64), -(-k // 32) * 8, 256)
    assert torch.equal(kernels.unpack_int8(packed, n, k), q)
    w = q.double() * scale.double()[:, None]
    # the dequantised weights times the dequantised (int8 per group of 32, the row zero-padded to
    # whole groups) activations, in float64: only the kernel's float32 roundings differ
    kp = -(-k // 32) * 32
    xa = int4_activations(torch.nn.functional.pad(x, (0, kp - k)))[:, :k]
    want = xa @ w.t() + b.double()
    got = kernels.blocked_mm_int8(x, packed, scale, b, n)
    assert got.shape == (m, n) and (got.double() - want).abs().max() <= 1e-5 * (want.abs().max() + 1)
    no_bias = kernels.blocked_mm_int8(x, packed, scale, None, n)
    assert (no_bias.double() - (want - b.double())).abs().max() <= 1e-5 * (want.abs().max() + 1)
    # against float activations: the activations' int8 rounding (half a step of amax / 127 per
    # input) alone; measured here at most 0.8% of the largest output (random weights, Gaussian x)
    exact = x.double() @ w.t() + b.double()
    assert (got.double() - exact).abs().max() <= 2e-2 * (exact.abs().max() + 1)
    alone = torch.cat([kernels.blocked_mm_int8(x[i:i + 1], packed, scale, b, n) for i in range(m)])
    assert torch.equal(alone, got)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(kernels.blocked_mm_int8(x, packed, scale, b, n), got)
    finally:
        torch.set_num_threads(threads)


def test_int8_pack_puts_four_inputs_of_one_output_in_each_32_bit_lane():
    n, k = 70, 40
    q = (torch.arange(n * k) % 251 - 125).to(torch.int8).view(n, k)
    packed = kernels.pack_int8(q)
    assert packed.shape == (2, 16, 256)
    assert packed[1, 2, 4 * 5:4 * 5 + 4].tolist() == q[64 + 5, 8:12].tolist()  # block 1, quad 2, output 69
    assert (packed[1, :, 4 * 6:] == 0).all() and (packed[0, 10:] == 0).all()  # past n, past k


def test_int8_activations_that_are_not_finite_give_nan_rows(isa):
    q = torch.randint(-127, 128, (64, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed, scale = kernels.pack_int8(q), torch.rand(64) / 100
    x = torch.randn(3, 64)
    x[1, 40] = float("inf")
    x[2] = 1e-40  # subnormal: quantised to zeros
    got = kernels.blocked_mm_int8(x, packed, scale, None, 64)
    assert got[1].isnan().all() and not got[0].isnan().any() and torch.equal(got[2], torch.zeros(64))


def test_int8_bad_operands_are_one_clear_error():
    packed = kernels.pack_int8(torch.zeros(64, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="x has 96 columns, the weight 64"):
        kernels.blocked_mm_int8(torch.randn(2, 96), packed, torch.ones(64), None, 64)
    with pytest.raises(RuntimeError, match="int8"):
        kernels.blocked_mm_int8(torch.randn(2, 64), packed.view(torch.uint8), torch.ones(64), None, 64)
    with pytest.raises(ValueError, match="int8"):
        kernels.pack_int8(torch.zeros(64, 64))


def test_int8_format_uses_the_kernel_with_int8_activations():
    lin = torch.nn.Linear(64, 96)
    fast = make_linear([lin], "int8")
    if not blocked_supported():
        pytest.skip("no vector path (AVX-512, AVX2) here: int8 keeps PyTorch's kernel")
    assert isinstance(fast, Int8BlockedLinear) and "blocked kernel" in repr(fast)
    x = torch.randn(5, 2, 64)
    exact = x @ fast.dequantized(torch.float32).t() + lin.bias
    want = (int4_activations(x.view(10, 64)) @ fast.dequantized(torch.float64).t() + lin.bias.double()).view(5, 2, 96)
    assert (fast(x).double() - want).abs().max() <= 1e-5 * want.abs().max()  # int8 activations, float32 sums
    assert (fast(x) - exact).abs().max() <= 2e-2 * exact.abs().max()  # what their rounding costs
    with pytest.raises(RuntimeError, match="scale must be"):
        kernels.blocked_mm_int8(x[0], fast.qpacked, fast.scales[:3], None, 96)


def int4_case(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) / 50
    offset = -8 * scale + torch.randn(n, k // 32, generator=g) / 1000
    return q, scale, offset


def assert_rows_alone_and_two_threads_give(got: torch.Tensor, mm, x: torch.Tensor) -> None:
    """`mm` of each row of x alone, and of all of x on 2 threads, gives `got`'s bits."""
    assert torch.equal(torch.cat([mm(x[i:i + 1]) for i in range(len(x))]), got)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(mm(x), got)
    finally:
        torch.set_num_threads(threads)


def int4_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int4 kernel quantises it (blocked_core.h's int4 section): per row and group of 32,
    d = amax / 127, a = rne(x * (1 / d)) in float32; returned dequantised (a * d) in float64."""
    xg = x.view(x.shape[0], -1, 32)
    d = xg.abs().amax(dim=2, keepdim=True) / 127
    inv = torch.where(d >= torch.finfo(torch.float32).tiny, 1 / d, torch.zeros_like(d))
    a = torch.round(xg * inv).clamp(-127, 127)
    return (a.double() * d.double()).view_as(x)


@pytest.mark.parametrize("k,n", [(32, 64), (96, 70), (576, 960), (1536, 200), (64, 1)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16])
def test_int4_blocks_are_the_group_wise_matmul_and_rows_stay_independent(m, k, n, isa):
    q, scale, offset = int4_case(n, k, seed=k + n)
    packed = kernels.pack_int4(q, scale, offset)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-n // 64), k // 32, 1280)
    q2, s2, o2 = kernels.unpack_int4(packed, n)
    assert torch.equal(q2, q) and torch.equal(s2, scale.half()) and torch.equal(o2, offset.half())
    w = (q.double().view(n, -1, 32) * s2.double()[..., None] + o2.double()[..., None]).view(n, k)
    x, _, b = case(m, k, n, seed=m)
    # the dequantised weights times the dequantised (int8 per group of 32) activations
    want = int4_activations(x) @ w.t() + b.double()
    got = kernels.blocked_mm_int4(x, packed, b, n)
    assert got.shape == (m, n) and (got.double() - want).abs().max() <= 1e-5 * (want.abs().max() + 1)
    no_bias = kernels.blocked_mm_int4(x, packed, None, n)
    assert (no_bias.double() - (want - b.double())).abs().max() <= 1e-5 * (want.abs().max() + 1)
    # against float activations: the int8 rounding (half a step of amax / 127 per input) alone
    exact = x.double() @ w.t() + b.double()
    assert (got.double() - exact).abs().max() <= 2e-2 * (exact.abs().max() + 1)
    assert_rows_alone_and_two_threads_give(got, lambda rows: kernels.blocked_mm_int4(rows, packed, b, n), x)


@pytest.mark.parametrize("k,n", [(96, 70), (576, 200), (64, 1)])
def test_int4_symmetric_layout_is_the_offsets_minus_8_scales_stored(k, n, isa):
    """A symmetric int4 weight (a GGUF's Q4_0: w = (q - 8) * scale) packs without its offsets,
    1152 bytes a group instead of 1280, and gives the bits of the offsets -8 * scale stored, at
    every row count; its scales are float16 already, as a GGUF's are (-8 * scale is then the
    same float16 whichever way it is rounded)."""
    q, scale, _ = int4_case(n, k, seed=k + n)
    scale = scale.half().float()
    sym, stored = kernels.pack_int4(q, scale, None), kernels.pack_int4(q, scale, -8 * scale)
    assert sym.shape == (-(-n // 64), k // 32, 1152) and kernels.int4_symmetric(sym)
    assert not kernels.int4_symmetric(stored) and torch.equal(sym, stored[..., :1152])
    q2, s2, o2 = kernels.unpack_int4(sym, n)
    assert torch.equal(q2, q) and torch.equal(s2, scale.half()) and torch.equal(o2, (-8 * scale).half())
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for m in (1, 2, 3, 4, 5, 7, 16, 65):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        for b in (bias, None):
            assert torch.equal(kernels.blocked_mm_int4(x, sym, b, n), kernels.blocked_mm_int4(x, stored, b, n)), m
    # control: any other offset changes the result
    other = kernels.pack_int4(q, scale, -7.5 * scale)
    assert not torch.equal(kernels.blocked_mm_int4(x, sym, None, n), kernels.blocked_mm_int4(x, other, None, n))


def int4_super_exact_case(n, k, seed=0):
    """Super-block operands whose scales and offsets (codes times factors) are float16 values:
    power-of-two factors."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    codes_s = torch.randint(0, 256, (n, k // 32), generator=g)
    codes_o = torch.randint(-128, 128, (n, k // 32), generator=g)
    factors = [2.0 ** torch.randint(-14, -6, (n, k // 256), generator=g).float() for _ in range(2)]
    return q, codes_s, codes_o, *factors


# 4-6-row groups (5-6 in blocks under 64 groups) take the AVX-512 kernel that runs a block's halves in turn (on AMD)
@pytest.mark.parametrize("k,n", [(256, 64), (512, 70), (1536, 200), (2048, 130), (256, 1)])
def test_int4_super_block_layout_is_the_scales_and_offsets_its_codes_make(k, n, isa):
    """The super-block layout (per 8 groups a float16 scale and offset factor per output, per group
    8-bit codes) reads 1184 bytes a group where the float16 layout reads 1280, and gives the bits
    of that layout holding code * factor (here float16 values) at every row count, with and
    without a bias; unpacked, the same nibbles, scales and offsets."""
    q, cs, co, fs, fo = int4_super_exact_case(n, k, seed=k + n)
    sup = kernels.pack_int4_super(q, cs, co, fs, fo)
    assert sup.shape == (-(-n // 64), k // 256, 9472) and kernels.int4_super(sup) and not kernels.int4_symmetric(sup)
    scale, offset = cs * fs.repeat_interleave(8, 1), co * fo.repeat_interleave(8, 1)
    stored = kernels.pack_int4(q, scale, offset)
    q2, s2, o2 = kernels.unpack_int4(sup, n)
    assert torch.equal(q2, q) and torch.equal(s2, scale) and torch.equal(o2, offset)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 16, 65):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        for b in (bias, None):
            assert torch.equal(kernels.blocked_mm_int4(x, sup, b, n), kernels.blocked_mm_int4(x, stored, b, n)), m
    # control: another offset code changes the result
    co2 = co.clone()
    co2[0, -1] = co2[0, -1] + (1 if co2[0, -1] < 127 else -1)
    other = kernels.pack_int4_super(q, cs, co2, fs, fo)
    assert not torch.equal(kernels.blocked_mm_int4(x, sup, None, n), kernels.blocked_mm_int4(x, other, None, n))


@pytest.mark.parametrize("m", [1, 3, 6, 9])
def test_int4_super_block_layout_is_the_group_wise_matmul(m, isa):
    """Factors that are any float16 values: codes times factors in float32 (exact), the
    dequantised weights times the dequantised activations; rows independent; any thread count."""
    from test_neon import int4_super_case

    n, k = 200, 2048
    q, cs, co, fs, fo = int4_super_case(n, k, torch.Generator().manual_seed(3))
    sup = kernels.pack_int4_super(q, cs, co, fs, fo)
    w = (q.double().view(n, -1, 32) * (cs * fs.repeat_interleave(8, 1)).double()[..., None]
         + (co * fo.repeat_interleave(8, 1)).double()[..., None]).view(n, k)
    x, _, b = case(m, k, n, seed=m)
    want = int4_activations(x) @ w.t() + b.double()
    got = kernels.blocked_mm_int4(x, sup, b, n)
    assert (got.double() - want).abs().max() <= 1e-5 * (want.abs().max() + 1)
    assert_rows_alone_and_two_threads_give(got, lambda rows: kernels.blocked_mm_int4(rows, sup, b, n), x)


def test_int4_super_block_bad_operands_are_clear_errors():
    q, cs, co, fs, fo = int4_super_exact_case(64, 512)
    with pytest.raises(ValueError, match="in % 256"):
        kernels.pack_int4_super(q[:, :288], cs[:, :9], co[:, :9], fs[:, :1], fo[:, :1])
    with pytest.raises(ValueError, match="codes must be"):
        kernels.pack_int4_super(q, cs + 1, co, fs, fo)  # a scale code of 256
    with pytest.raises(ValueError, match="float16 values"):
        kernels.pack_int4_super(q, cs, co, fs * (1 + 1e-6), fo)
    with pytest.raises(ValueError, match="float16 values"):
        kernels.pack_int4_super(q, cs, co, fs * 1e9, fo)
    sup = kernels.pack_int4_super(q, cs, co, fs, fo)
    with pytest.raises(RuntimeError, match="9472"):
        kernels.blocked_mm_int4(torch.randn(2, 512), sup[..., :9000], None, 64)


def test_int4_quantize_super_covers_each_group_within_half_its_step():
    """int4_quantize_super: codes in range, every group's step (scale code * D) covering it from
    its offset (code * O <= its least weight), so no weight is clipped: each lands within half a
    step; and its error is near the float16 layout's (the factors cost about 1%)."""
    from quickdraft.model.formats import int4_quantize, int4_quantize_super

    g = torch.Generator().manual_seed(0)
    w = torch.randn(192, 1024, generator=g) * 0.02
    w[:, 5] *= 30  # an outlier input column
    w[7] = 0.0  # a row of zeros
    q, cs, co, fs, fo = int4_quantize_super(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and cs.dtype == torch.uint8 and co.dtype == torch.int8
    assert torch.equal(fs, fs.half().float()) and torch.equal(fo, fo.half().float())
    step = (cs.float() * fs.repeat_interleave(8, 1))[..., None]
    offset = (co.float() * fo.repeat_interleave(8, 1))[..., None]
    wg = w.view(192, -1, 32)
    assert bool((offset <= wg.amin(-1, keepdim=True)).all()) and bool((offset + 15 * step >= wg.amax(-1, keepdim=True) - 1e-7).all())
    deq = q.float().view(192, -1, 32) * step + offset
    assert bool(((deq - wg).abs() <= step / 2 * (1 + 1e-5) + 1e-9).all())
    assert torch.equal(deq[7], torch.zeros_like(deq[7]))
    q4, s4, z4 = int4_quantize(w)
    ref = (q4.float().view(192, -1, 32) - 8) * s4.half().float()[..., None] + (z4 - 8 * s4).half().float()[..., None]
    err, err_ref = (deq - wg).pow(2).mean().sqrt(), (ref - wg).pow(2).mean().sqrt()
    assert err <= 1.05 * err_ref, (err, err_ref)


def test_int4_format_takes_the_super_block_layout_where_inputs_are_multiples_of_256(monkeypatch):
    """With quant.INT4_SUPER_BLOCKS (off by default: the float16 layout everywhere)."""
    if not blocked_supported():
        pytest.skip("no vector path (AVX-512, AVX2) here: int4 keeps PyTorch's kernel")
    from quickdraft.model import quant

    torch.manual_seed(0)
    wide, narrow = torch.nn.Linear(512, 96), torch.nn.Linear(288, 96)
    assert not kernels.int4_super(make_linear([wide], "int4").qpacked)  # the default
    monkeypatch.setattr(quant, "INT4_SUPER_BLOCKS", True)
    fast, slow = make_linear([wide], "int4"), make_linear([narrow], "int4")
    assert kernels.int4_super(fast.qpacked) and fast.qpacked.shape == (2, 2, 9472)
    assert not kernels.int4_super(slow.qpacked) and slow.qpacked.shape == (2, 9, 1280)
    assert fast.bytes_read() == 2 * 2 * 9472 + 96 * 4  # 4.625 bits a weight, and the bias
    x = torch.randn(3, 512)
    with torch.no_grad():
        w = fast.dequantized(torch.float32)
        assert (w - wide.weight).abs().max() <= (wide.weight.abs().max() * 2 / 15) / 2 * 1.01  # half a step
        got = fast(x)
        assert (got - (x @ w.t() + wide.bias)).abs().max() <= 0.02 * got.abs().max()  # the int8 activations' rounding
    assert torch.equal(got, torch.cat([fast(x[i:i + 1]) for i in range(3)]))


def test_int4_pack_puts_four_inputs_of_one_output_in_each_32_bit_lane():
    n, k = 64, 32
    q = (torch.arange(n)[:, None] * 3 + torch.arange(k)[None]) % 16
    packed = kernels.pack_int4(q.to(torch.uint8), torch.ones(n, 1), torch.zeros(n, 1))
    byte = packed[0, 0]
    for c, h, i, j in [(0, 0, 0, 0), (1, 0, 5, 2), (7, 1, 15, 3), (3, 1, 0, 1)]:
        lo, hi = int(byte[128 * c + 64 * h + 4 * i + j]) & 15, int(byte[128 * c + 64 * h + 4 * i + j]) >> 4
        assert (lo, hi) == (int(q[32 * h + i, 4 * c + j]), int(q[32 * h + 16 + i, 4 * c + j]))


def test_int4_activations_that_are_not_finite_give_nan_rows_and_tiny_ones_zeros(isa):
    q, scale, offset = int4_case(70, 96)
    packed = kernels.pack_int4(q, scale, offset)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    x[3] = 1e-39  # below amax / 127 >= FLT_MIN: quantised to zeros
    got = kernels.blocked_mm_int4(x, packed, None, 70)
    assert torch.isfinite(got[0]).all() and torch.isnan(got[1]).all() and torch.isnan(got[2]).all()
    assert torch.equal(got[3], torch.zeros(70))
    assert torch.equal(got[0], kernels.blocked_mm_int4(x[:1], packed, None, 70)[0])


def test_int4_bad_operands_are_one_clear_error():
    q, scale, offset = int4_case(64, 64)
    packed = kernels.pack_int4(q, scale, offset)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x has 63 columns, the weight 64 rows"):
        kernels.blocked_mm_int4(x[:, :63], packed, None, 64)
    with pytest.raises(RuntimeError, match="uint8"):
        kernels.blocked_mm_int4(x, packed.float(), None, 64)
    with pytest.raises(RuntimeError, match="1280 or 1152"):
        kernels.blocked_mm_int4(x, packed[..., :1200], None, 64)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.blocked_mm_int4(x, packed, torch.zeros(65), 64)
    with pytest.raises(ValueError, match="float16's range"):
        kernels.pack_int4(q, scale * 1e7, offset)
    with pytest.raises(ValueError, match="in % 32"):
        kernels.pack_int4(q[:, :40], scale[:, :1], offset[:, :1])


def test_int4_format_uses_the_kernel_and_keeps_only_its_blocks():
    lin = torch.nn.Linear(64, 96)
    fast = make_linear([lin], "int4")
    if not blocked_supported():
        pytest.skip("no vector path (AVX-512, AVX2) here: int4 keeps PyTorch's kernel")
    assert isinstance(fast, Int4BlockedLinear) and "blocked kernel" in repr(fast)
    assert fast.bytes_read() == 2 * 2 * 1280 + 96 * 4  # two blocks of two groups, and the bias
    assert fast.weight_bytes() == fast.bytes_read()  # no unpacked copy resident
    x = torch.randn(5, 2, 64)
    w = fast.dequantized(torch.float32).double()
    with torch.no_grad():
        want = (int4_activations(x.view(10, 64)) @ w.t() + lin.bias.double()).view(5, 2, 96)
        exact = x.double() @ w.t() + lin.bias.double()
        got = fast(x).double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # int8 activations, float32 sums
    assert (got - exact).abs().max() <= 2e-2 * exact.abs().max()  # (measured 0.7% here: the activations' rounding)
    huge = torch.nn.Linear(64, 64)
    with torch.no_grad():
        huge.weight.mul_(1e6)
    assert isinstance(make_linear([huge], "int4"), Int4TorchLinear)  # scales past float16: PyTorch's kernel


@pytest.mark.parametrize("fmt", ["blocked", "int8", "int4"])
def test_kernel_formats_are_row_invariant_at_every_row_count(fmt, monkeypatch):
    """On quickdraft's kernels a row's bits are its own at any row count (past 16 rows, where
    PyTorch's int8 / int4 kernels switch to a dense GEMM, and past 64, where ours once did):
    verify rows equal decode rows, a request ignores its batch. PyTorch's are not."""
    if not blocked_supported():
        pytest.skip("no vector path (AVX-512, AVX2) here: PyTorch's kernels")
    torch.manual_seed(0)
    model = torch.nn.Sequential(make_linear([torch.nn.Linear(64, 96)], fmt))
    assert row_invariant(model)
    big = torch.randn(300, 64)
    alone = torch.cat([model(big[i:i + 1]) for i in range(300)])
    assert torch.equal(model(big), alone) and torch.equal(model(big[:80]), alone[:80])
    if fmt != "blocked":
        monkeypatch.setattr("quickdraft.model.quant.blocked_supported", lambda: False)
        torch_kernel = torch.nn.Sequential(make_linear([torch.nn.Linear(64, 96)], fmt))
        assert not row_invariant(torch_kernel)
        assert not torch.equal(torch_kernel(big), torch.cat([torch_kernel(big[i:i + 1]) for i in range(300)]))


def test_model_attention_gives_every_query_row_its_own_bits(isa):
    """Many query rows in one call (a prompt padded beside longer ones, a large tree; past the 12
    rows where the kernel once handed them to PyTorch's attention): each row has the bits of a
    one-row call."""
    from quickdraft.model.transformer import attention

    ATTEND_ROWS = 12
    q, k, v, mask = _attention_case(2, 8, 4, 2 * ATTEND_ROWS + 5, 300, 64)
    with torch.no_grad():
        got = attention(q, k, v, mask)
        assert got.shape == q.shape and got.transpose(1, 2).is_contiguous()
        for t in (0, ATTEND_ROWS, 2 * ATTEND_ROWS + 4):
            assert torch.equal(attention(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1])[:, :, 0], got[:, :, t])
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                            enable_gqa=True)
    assert (got.double() - want).abs().max() < 1e-5


def test_the_kernel_folder_follows_its_own_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("QUICKDRAFT_KERNEL_CACHE", str(tmp_path / "k"))
    assert kernels._build_dir().parent == tmp_path / "k"
    monkeypatch.delenv("QUICKDRAFT_KERNEL_CACHE")
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "c"))
    assert kernels._build_dir().parent == tmp_path / "c" / "kernels"


def _attention_case(B, H, Hkv, T, L, D, seed=0):
    """q (B, H, T, D) as the model makes it (a transposed view), k / v views of a larger cache,
    and a causal mask of random positions per row."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    k = torch.randn(B + 1, Hkv, L + 9, D, generator=g)[:B, :, :L]
    v = torch.randn(B + 1, Hkv, L + 9, D, generator=g)[:B, :, :L]
    pos = torch.randint(L // 2, L, (B, T), generator=g)
    return q, k, v, (torch.arange(L) <= pos[..., None])[:, None]


@pytest.mark.parametrize("B,H,Hkv,T,L,D", [(1, 8, 4, 1, 300, 64), (3, 9, 3, 5, 77, 64), (2, 4, 4, 11, 40, 128),
                                           (1, 8, 1, 12, 200, 64), (2, 6, 2, 3, 1, 32), (1, 9, 3, 1, 100, 64)])
def test_attend_is_attention_and_rows_stay_independent(B, H, Hkv, T, L, D, isa):
    q, k, v, mask = _attention_case(B, H, Hkv, T, L, D)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                            enable_gqa=H != Hkv)
    got = kernels.attend(q, k, v, mask, D ** -0.5)
    assert got.shape == (B, H, T, D) and got.transpose(1, 2).is_contiguous()  # stored (B, T, H, D)
    assert (got.double() - want).abs().max() < 1e-5
    # each query row alone, and on two threads: the same bits (a verify row = the decode row)
    for t in range(T):
        alone = kernels.attend(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], D ** -0.5)
        assert torch.equal(alone[:, :, 0], got[:, :, t])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(kernels.attend(q, k, v, mask, D ** -0.5), got)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("pos,gap,rows", [(37, 1, 1), (300, 3, 2), (16, 2, 5), (200, 16, 14), (5, 40, 13)])
def test_a_tree_node_gets_the_bits_of_its_chain_position(pos, gap, rows, isa):
    """A token tree's node at position `pos` whose own key sits `gap` slots later (its siblings'
    keys between, unseen) attends to the same keys in the same order as that token in a chain
    (or a decode step): it gets the chain's bits, so a tree step's accepted path carries the KV
    and hidden states plain decoding computes (a key's lane in the softmax's total is its rank
    among the keys the row sees, not its slot). Several query rows per call: passes of 1-16 rows."""
    g = torch.Generator().manual_seed(pos)
    H, Hkv, D = 6, 3, 64
    L = pos + 1 + gap + 7
    q = torch.randn(1, rows, H, D, generator=g).transpose(1, 2)
    k, v = torch.randn(1, Hkv, L, D, generator=g), torch.randn(1, Hkv, L, D, generator=g)
    kt, vt = k.clone(), v.clone()
    kt[:, :, pos + gap], vt[:, :, pos + gap] = k[:, :, pos], v[:, :, pos]  # the node's own key, later
    kt[:, :, pos:pos + gap] = torch.randn(1, Hkv, gap, D, generator=g)  # its siblings' keys
    slots = torch.arange(L)
    chain = (slots <= pos).expand(1, 1, rows, L)
    tree = ((slots < pos) | (slots == pos + gap)).expand(1, 1, rows, L)
    got = kernels.attend(q, kt, vt, tree, D ** -0.5)
    assert torch.equal(got, kernels.attend(q, k, v, chain, D ** -0.5))
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=chain,
                                                            enable_gqa=True)
    assert (got.double() - want).abs().max() < 1e-5


def test_attend_takes_a_prefill_on_the_kernel_and_masks_by_row(isa):
    q, k, v, mask = _attention_case(2, 8, 4, 100, 300, 64)  # 100 query rows: the kernel, 4 rows a pass
    got = kernels.attend(q, k, v, mask, 0.125)
    for t in (0, 11, 12, 13, 57, 99):  # each row's bits are a one-row call's (past 12: once PyTorch's)
        assert torch.equal(kernels.attend(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], 0.125)[:, :, 0], got[:, :, t])
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                            enable_gqa=True, scale=0.125)
    assert (got.double() - want).abs().max() < 1e-5
    q, k, v, mask = _attention_case(1, 4, 2, 3, 50, 40)  # a head size the kernel does not take: PyTorch's
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.125)
    assert torch.equal(kernels.attend(q, k, v, mask, 0.125), want)
    q, k, v, mask = _attention_case(1, 4, 2, 2, 50, 64)
    shared = mask[:1, :, :1].expand(1, 1, 2, 50)  # a broadcast mask (stride 0) reads as its values
    assert torch.equal(kernels.attend(q, k, v, shared, 0.125), kernels.attend(q, k, v, shared.contiguous(), 0.125))
    with pytest.raises(RuntimeError, match="mask must be bool"):
        kernels.attend(q, k, v, mask.float(), 0.125)
    with pytest.raises(RuntimeError, match="do not match"):
        kernels.attend(q, k[:, :, :10], v, mask, 0.125)


def test_model_attention_runs_the_kernel_for_inference_only():
    """The model's attention takes the kernel for a CPU float32 inference step and PyTorch's
    attention under autograd (training needs its gradient)."""
    from quickdraft.model.transformer import attention

    q, k, v, mask = _attention_case(1, 4, 2, 3, 40, 64)
    with torch.no_grad():
        assert torch.equal(attention(q, k, v, mask), kernels.attend(q, k, v, mask, 0.125))
    qg = q.detach().clone().requires_grad_()
    out = attention(qg, k, v, mask)
    out.sum().backward()
    assert qg.grad is not None and torch.allclose(out, kernels.attend(q, k, v, mask, 0.125), atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_many_rows_run_in_tiles_and_each_row_keeps_its_bits(fmt, isa):
    """A prefill-sized call (past the integer kernels' 48-row tiles: 150 rows = 3 tiles + 6, and a
    9-block matrix, which tasks of (block, tile) split evenly over threads) gives every row the
    bits it gets alone, on one thread and on two, and is the dequantised matmul."""
    k, n, m = 576, 576, 150
    x, _, b = case(m, k, n, seed=3)
    g = torch.Generator().manual_seed(5)
    if fmt == "int8":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        scale = torch.rand(n, generator=g) / 100
        packed = kernels.pack_int8(q)
        mm = lambda rows: kernels.blocked_mm_int8(rows, packed, scale, b, n)  # noqa: E731
        w = q.double() * scale.double()[:, None]
    else:
        q, scale, offset = int4_case(n, k, seed=5)
        packed = kernels.pack_int4(q, scale, offset)
        mm = lambda rows: kernels.blocked_mm_int4(rows, packed, b, n)  # noqa: E731
        _, s2, o2 = kernels.unpack_int4(packed, n)
        w = (q.double().view(n, -1, 32) * s2.double()[..., None] + o2.double()[..., None]).view(n, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mm(x)
        torch.set_num_threads(2)
        two = mm(x)
    finally:
        torch.set_num_threads(threads)
    alone = torch.cat([mm(x[i:i + 1]) for i in range(m)])
    assert torch.equal(one, alone) and torch.equal(two, alone)
    want = int4_activations(x) @ w.t() + b.double()
    assert (one.double() - want).abs().max() <= 1e-5 * (want.abs().max() + 1)
