"""The engine's user-facing error types (the bottom layer: imports nothing of ours)."""

from __future__ import annotations


class QuickdraftError(ValueError):
    """A user-facing error: bad input, a missing file, an unsupported option.

    Subclasses ValueError so callers that validate input the usual way catch it.
    The CLI prints its message on one line and exits with code 2. `field`: the request field
    the error is about (a SamplingParams or add_request name: "temperature", "prompt",
    "num_speculative_tokens"), None when it is about no single one; str(exc) is the message alone.
    """

    def __init__(self, *args, field: str | None = None):
        super().__init__(*args)
        self.field = field


class UnsupportedModelError(QuickdraftError):
    """The checkpoint uses an architecture or option this engine does not implement."""


class ContextLengthError(QuickdraftError):
    """A request does not fit the model's context length: its prompt alone (field "prompt"),
    or the prompt and max_tokens together (field "max_tokens")."""


class EngineFailure(QuickdraftError):
    """The engine cannot go on at all (e.g. a tensor-parallel rank died or timed out): every
    request it holds fails, and a server exits non-zero rather than answering 503 forever."""


class PrefixCacheMismatch(RuntimeError):
    """The prefix cache's debug check (prefix_cache_check="raise") found a hit whose KV differs
    from a fresh prefill's: a bug, never the user's input."""
