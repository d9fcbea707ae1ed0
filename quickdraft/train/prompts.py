"""Code-completion prompts from held-out files: the opening lines of functions and classes.

Used to measure a draft's acceptance (distill) and by the default-pair benchmark. Held-out
files are never trained on, so these prompts are unseen by target and draft alike.
"""

from __future__ import annotations

import hashlib
import re

from .corpus import Document

_OPENING = re.compile(r"^[ \t]*(async[ \t]+def|def|class)[ \t]+\w+")


def opening_prompts(docs: list[Document], n: int, lines: int = 2, max_chars: int = 300) -> list[str]:
    """Up to `n` prompts: a `def` / `class` line and the `lines - 1` lines after it, spread
    over the files in a fixed pseudo-random order (a hash of path and line number) so the
    set does not depend on which file happens to sort first."""
    found: list[tuple[bytes, str]] = []
    for rel, text in docs:
        rows = text.splitlines(keepends=True)
        for i, row in enumerate(rows):
            if _OPENING.match(row):
                prompt = "".join(rows[i:i + lines])
                if 10 <= len(prompt) <= max_chars:
                    found.append((hashlib.sha256(f"{rel}:{i}".encode()).digest(), prompt))
    found.sort()
    return [p for _, p in found[:n]]
