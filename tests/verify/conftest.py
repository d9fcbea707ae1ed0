"""The sampling and verifier tests on both paths: quickdraft's kernels (the draw and the sampled
verifiers in one call each, where the kernels run) and their tensor versions (QUICKDRAFT_KERNELS=0:
CPUs without the kernels, and GPUs)."""

from __future__ import annotations

import contextlib

import pytest

from quickdraft import kernels

PATHS = ["kernel", "tensor"]


@contextlib.contextmanager
def _on(path: str):
    with pytest.MonkeyPatch.context() as m:
        if path == "tensor":
            m.setenv("QUICKDRAFT_KERNELS", "0")
        elif not kernels.available():
            pytest.skip("quickdraft's kernels are not available here")
        yield path


@pytest.fixture(scope="module", params=PATHS)
def verify_path(request):
    """Every test of a module (pytestmark usefixtures) on each path."""
    with _on(request.param) as path:
        yield path


@pytest.fixture(params=PATHS)
def draw_path(request):
    """One test on each path."""
    with _on(request.param) as path:
        yield path
