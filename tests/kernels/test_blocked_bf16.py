"""The bfloat16 blocked matmul (`blocked_mm_bf16`, issue 36): weights widened to float32 in
registers, so on every path it gives `blocked_mm`'s bits on the widened weights, at every row
count past each point where a path changes its row grouping, on odd shapes and on one and two
threads; each row gets the bits it gets alone; its errors and its registrations."""

from __future__ import annotations

import ctypes

import pytest
import torch

from quickdraft import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel library could not be built here")

PATHS = kernels.cpu_isas() if kernels.available() else ()
ROWS = list(range(1, 17)) + [17, 65]  # every row grouping of every path, then past DENSE_ROWS / BLOCKED_DENSE_ROWS


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _weights(k, n, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(k, n, generator=g) / k ** 0.5).to(torch.bfloat16)
    return w, torch.randn(n, generator=g)


@pytest.mark.parametrize("k,n", [(33, 200), (577, 323), (1, 5), (64, 64), (96, 1)])
def test_bf16_is_the_float32_kernel_on_the_widened_weights_on_every_path(k, n, threads):
    w, bias = _weights(k, n, k * n)
    packed, wide = kernels.pack_bf16(w), kernels.pack(w.float())
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-n // 64), k, 64)
    assert torch.equal(kernels.unpack(packed, n), w)
    for isa in PATHS:
        with kernels.use_isa(isa):
            for t in (1, 2):
                threads(t)
                for m in ROWS:
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                    for b in (bias, None):
                        got = kernels.blocked_mm_bf16(x, packed, b, n)
                        want = kernels.blocked_mm(x, wide, b, n)
                        assert got.shape == (m, n) and got.dtype == torch.float32
                        assert torch.equal(got, want), f"{isa}, {t} threads, m={m}, bias={b is not None}"
    # and one path's bits are every path's (blocked_mm's own cross-path test covers the float32 side)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    results = []
    for isa in PATHS:
        with kernels.use_isa(isa):
            results.append(kernels.blocked_mm_bf16(x, packed, bias, n))
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_bf16_is_the_matmul():
    w, bias = _weights(300, 130, 3)
    x = torch.randn(5, 300)
    want = x.double() @ w.double() + bias.double()
    got = kernels.blocked_mm_bf16(x, kernels.pack_bf16(w), bias, 130)
    assert (got.double() - want).abs().max() <= 1e-5 * (want.abs().max() + 1)


def test_pack_bf16_rounds_float32_weights_to_nearest_even():
    w = torch.randn(40, 70)
    assert torch.equal(kernels.unpack(kernels.pack_bf16(w), 70), w.to(torch.bfloat16))


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("m", [2, 3, 5, 8, 17])
def test_each_bf16_row_gets_the_bits_it_gets_alone(m, isa, threads):
    w, bias = _weights(96, 300, m)
    packed = kernels.pack_bf16(w)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    with kernels.use_isa(isa):
        threads(1)
        together = kernels.blocked_mm_bf16(x, packed, bias, 300)
        alone = torch.cat([kernels.blocked_mm_bf16(x[i:i + 1], packed, bias, 300) for i in range(m)])
        assert torch.equal(together, alone)
        threads(2)
        assert torch.equal(kernels.blocked_mm_bf16(x, packed, bias, 300), together)


def test_bf16_strided_rows_and_no_rows():
    w, _ = _weights(80, 130, 0)
    packed = kernels.pack_bf16(w)
    x = torch.randn(6, 80)
    wide = torch.randn(6, 200)
    wide[:, 10:90] = x
    assert torch.equal(kernels.blocked_mm_bf16(wide[:, 10:90], packed, None, 130),
                       kernels.blocked_mm_bf16(x, packed, None, 130))
    assert kernels.blocked_mm_bf16(x[:0], packed, None, 130).shape == (0, 130)


def test_bad_bf16_operands_are_one_clear_error():
    w, _ = _weights(32, 64, 0)
    packed = kernels.pack_bf16(w)
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="blocked_mm_bf16: packed must be bfloat16"):
        kernels.blocked_mm_bf16(x, kernels.pack(w.float()), None, 64)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.blocked_mm_bf16(x.bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="x has 31 columns, the weight 32 rows"):
        kernels.blocked_mm_bf16(x[:, :31], packed, None, 64)
    with pytest.raises(RuntimeError, match="n does not match"):
        kernels.blocked_mm_bf16(x, packed, None, 65)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.blocked_mm_bf16(x, packed, torch.zeros(64, dtype=torch.bfloat16), 64)


def test_bf16_traces_and_has_its_aot_entry_point():
    w, bias = _weights(40, 90, 1)
    packed = kernels.pack_bf16(w)
    x = torch.randn(3, 40)
    f = torch.compile(lambda x: kernels.blocked_mm_bf16(x, packed, bias, 90) * 2, backend="eager", fullgraph=True)
    assert torch.equal(f(x), kernels.blocked_mm_bf16(x, packed, bias, 90) * 2)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fx, fp = mode.from_tensor(x), mode.from_tensor(packed)
        assert kernels.blocked_mm_bf16(fx, fp, None, 90).shape == (3, 90)
    shims = kernels.aoti_config()["aot_inductor.custom_ops_to_c_shims"]
    decl = shims[torch.ops.quickdraft.blocked_mm_bf16.default][0]
    assert "aoti_torch_cpu_blocked_mm_bf16(" in decl
    assert isinstance(kernels._lib().aoti_torch_cpu_blocked_mm_bf16, ctypes._CFuncPtr)
