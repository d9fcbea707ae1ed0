"""The kernels' read streams (QUICKDRAFT_ROW_STREAMS, read once when the library loads): one to
three rows take one, two or four adjacent blocks at a time (by default one on AMD, where two
streams from DRAM ran at half the speed, four or two on Intel; the AVX2 integer kernels two for
up to five (int4) or six (int8) rows there); and their software prefetch
(QUICKDRAFT_PREFETCH, bytes ahead: 0 by default on AMD, where the hardware's prefetchers alone
streamed faster, save AVX2's panels of a few rows, which then stream the next chunk evenly over
their passes, 2-3 float32 rows in four passes rather than two; 4096 on Intel). int8's groups of 4-6
rows (5-6 on AMD) and, with one stream or (Intel) in blocks of up to 64 groups, int4's of 4-6 rows
(5-6 in short blocks) run on AVX-512 a block's two halves in turn (blocked_core.h's
block_rows_q8_halves, block_rows_q4_halves), streaming the next block evenly over both passes;
QUICKDRAFT_HALVES=0 / 1 turns them off / on for both.
The AVX-512 int8 kernel takes calls of 4-12 rows (on Intel, by default) in chunks of the inputs whose
activations fit L1, every block over one chunk before the next (QUICKDRAFT_KSPLIT: bytes, 0 for
whole blocks, on any CPU).
Every setting must give the same bits, on every path and in every weight format, so each is run
here whatever the CPU's default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from quickdraft import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel library could not be built here")

# Runs in a fresh process (the setting is read once per process): every path, format and row count
# of one setting, saved for the parent to compare.
_CHILD = r"""
import sys, torch
from quickdraft import kernels
K, N = 2048, 600  # 64 groups of 32 inputs; 10 blocks of 64 outputs, the last one partial
g = torch.Generator().manual_seed(0)
x = torch.randn(9, K, generator=g)
w = torch.randn(K, N, generator=g) / K ** 0.5
bias = torch.randn(N, generator=g)
q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
s8 = torch.rand(N, generator=g) / 100
q4 = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
s4 = torch.rand(N, K // 32, generator=g) / 50
ops = {
    "f32": (lambda p: lambda x: kernels.blocked_mm(x, p, bias, N))(kernels.pack(w)),
    "bf16": (lambda p: lambda x: kernels.blocked_mm_bf16(x, p, bias, N))(kernels.pack_bf16(w)),
    "int8": (lambda p: lambda x: kernels.blocked_mm_int8(x, p, s8, bias, N))(kernels.pack_int8(q8)),
    "int4": (lambda p: lambda x: kernels.blocked_mm_int4(x, p, bias, N))(kernels.pack_int4(q4, s4, s4 / 3)),
    "int4-symmetric": (lambda p: lambda x: kernels.blocked_mm_int4(x, p, bias, N))(kernels.pack_int4(q4, s4, None)),
    "int4-super": (lambda p: lambda x: kernels.blocked_mm_int4(x, p, bias, N))(kernels.pack_int4_super(
        q4, torch.randint(0, 256, (N, K // 32), generator=g), torch.randint(-128, 128, (N, K // 32), generator=g),
        *[2.0 ** torch.randint(-14, -6, (N, K // 256), generator=g).float() for _ in range(2)])),
}
# a short block too (18 groups: SmolLM2's K), where int4's halves kernel runs from 5 rows
k = 576
w4 = torch.randint(0, 16, (N, k), dtype=torch.uint8, generator=g), torch.rand(N, k // 32, generator=g) / 50
ops["int4-576"] = (lambda p: lambda x: kernels.blocked_mm_int4(x[:, :k], p, bias, N))(kernels.pack_int4(w4[0], w4[1], w4[1] / 3))
out = {}
for isa in kernels.cpu_isas():
    with kernels.use_isa(isa):
        for fmt, f in ops.items():
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9):
                out[isa, fmt, m] = f(x[:m]).clone()
torch.save(out, sys.argv[1])
"""


def _run(streams: int, path, prefetch: int = 4096, halves: str | None = None, ksplit: int | None = None) -> dict:
    env = dict(os.environ, QUICKDRAFT_ROW_STREAMS=str(streams), QUICKDRAFT_PREFETCH=str(prefetch))
    env.pop("QUICKDRAFT_HALVES", None)
    env.pop("QUICKDRAFT_KSPLIT", None)
    if halves is not None:
        env["QUICKDRAFT_HALVES"] = halves
    if ksplit is not None:
        env["QUICKDRAFT_KSPLIT"] = str(ksplit)
    subprocess.run([sys.executable, "-c", _CHILD, str(path)], env=env, check=True, timeout=300)
    return torch.load(path)


def test_every_read_stream_setting_gives_the_same_bits(tmp_path):
    runs = {s: _run(s, tmp_path / f"streams{s}.pt") for s in (1, 2, 4)}
    runs["no prefetch"] = _run(1, tmp_path / "none.pt", prefetch=0)
    runs["far prefetch"] = _run(2, tmp_path / "far.pt", prefetch=16384)
    runs["no halves"] = _run(1, tmp_path / "no_halves.pt", halves="0")
    runs["halves"] = _run(4, tmp_path / "halves.pt", halves="1")
    # int8's inputs in chunks of 8 groups from four rows (2,048 inputs: 8 chunks; 576: 8 + 8 + 2), and never
    runs["k chunks"] = _run(4, tmp_path / "k_chunks.pt", ksplit=1)
    runs["whole blocks"] = _run(4, tmp_path / "whole.pt", ksplit=0)
    keys = runs[1].keys()
    assert keys and all(run.keys() == keys for run in runs.values())
    for key in keys:
        isa, fmt, m = key
        for s in (2, 4, "no prefetch", "far prefetch", "no halves", "halves", "k chunks", "whole blocks"):
            assert torch.equal(runs[s][key], runs[1][key]), (s, key)
        # and a row's bits do not depend on the rows beside it (a second row group included)
        assert torch.equal(runs[1][key], runs[1][isa, fmt, 9][:m]), key
