"""The engine's user-facing error types (the bottom layer: imports nothing of ours)."""

from __future__ import annotations


class QuickdraftError(ValueError):
    """A user-facing error: bad input, a missing file, an unsupported option.

    Subclasses ValueError so callers that validate input the usual way catch it.
    The CLI prints its message on one line and exits with code 2.
    """


class UnsupportedModelError(QuickdraftError):
    """The checkpoint uses an architecture or option this engine does not implement."""


class EngineFailure(QuickdraftError):
    """The engine cannot go on at all (e.g. a tensor-parallel rank died or timed out): every
    request it holds fails, and a server exits non-zero rather than answering 503 forever."""
