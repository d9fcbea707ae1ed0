"""The engine's user-facing error types (the bottom layer: imports nothing of ours)."""

from __future__ import annotations


class QuickdraftError(ValueError):
    """A user-facing error: bad input, a missing file, an unsupported option.

    Subclasses ValueError so callers that validate input the usual way catch it.
    The CLI prints its message on one line and exits with code 2.
    """


class UnsupportedModelError(QuickdraftError):
    """The checkpoint uses an architecture or option this engine does not implement."""
