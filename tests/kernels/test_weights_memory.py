"""Packed weights in memory advised for 2 MiB pages (kernels.weights_memory): the same values,
private anonymous mappings with MADV_HUGEPAGE, several weights per mapping, and plain
contiguous tensors where it does not apply."""

import gc
import mmap
import re
import sys

import pytest
import torch

from quickdraft import kernels


def _mapping(t: torch.Tensor) -> dict:
    """/proc/self/smaps's entry for the mapping holding t's first byte: its range and VmFlags."""
    addr, found = t.data_ptr(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                lo, hi = int(m[1], 16), int(m[2], 16)
                found = {"range": (lo, hi)} if lo <= addr < hi else None
            elif found is not None and line.startswith("VmFlags:"):
                found["flags"] = line.split()[1:]
                return found
    raise AssertionError("no mapping holds the tensor")


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="madvise(MADV_HUGEPAGE) and /proc/self/smaps are Linux's")


@linux_only
def test_packed_weights_are_private_huge_page_memory_shared_by_weights(monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_HUGE_PAGES", "1")
    monkeypatch.setattr(kernels, "_arena", None)  # a mapping of this test's own (earlier tests' weights may live on)
    w = [torch.randn(576, 1000), torch.randn(1536, 576)]
    packed = [kernels.pack(t) for t in w]
    for t, p in zip(w, packed):
        assert p.is_contiguous() and torch.equal(kernels.unpack(p, t.shape[1]), t)
        m = _mapping(p)
        assert "hg" in m["flags"], m  # advised for huge pages
        assert "sh" not in m["flags"], m  # private: shmem gets no huge pages, a fork's writes stay its own
    assert _mapping(packed[0])["range"] == _mapping(packed[1])["range"]  # one after another in one mapping
    q = torch.randint(-127, 128, (300, 256), dtype=torch.int8)
    assert "hg" in _mapping(kernels.pack_int8(q))["flags"]
    assert torch.equal(kernels.unpack_int8(kernels.pack_int8(q), 300, 256), q)
    # a mapping goes with its last tensor
    ref = _mapping(packed[0])["range"]
    del packed, p
    gc.collect()
    with open("/proc/self/maps") as f:
        assert not any(line.startswith(f"{ref[0]:x}-") for line in f)


@linux_only
def test_without_huge_pages_weights_are_torch_tensors(monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_HUGE_PAGES", "0")
    p = kernels.pack(torch.randn(576, 1000))
    assert "hg" not in _mapping(p)["flags"]
    monkeypatch.setenv("QUICKDRAFT_HUGE_PAGES", "1")
    small = kernels.weights_memory(torch.randn(64, 64))  # under 64 KiB: not worth a page of its own
    assert "hg" not in _mapping(small)["flags"]
