"""Built-in benchmark workloads over held-out files (never trained on).

- `code_completion`: the opening lines of functions and classes; the model writes the body.
- `editing`: input-grounded editing. The prompt holds an excerpt of a held-out file, then
  the start of a lightly edited copy of it (one identifier renamed throughout), so most of
  the continuation repeats text already in the prompt: the case prompt lookup and suffix
  decoding are built for (code edits, summaries quoting their source, agent loops).
"""

from __future__ import annotations

import collections
import json
import hashlib
import keyword
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import QuickdraftError
from ..train.corpus import Document
from ..train.prompts import opening_prompts

_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b")
_BUILTINS = {"self", "None", "True", "False", "print", "len", "range", "isinstance", "return", "import"}


@dataclass(frozen=True)
class EditPrompt:
    text: str  # what the model sees
    expected: str  # the rest of the edited copy (what a perfect copier would write)
    renamed: tuple[str, str]  # (old, new) identifier


def code_completion(docs: list[Document], n: int) -> list[str]:
    return opening_prompts(docs, n)


def editing(docs: list[Document], n: int, excerpt_chars: int = 900, lead_fraction: float = 0.25) -> list[EditPrompt]:
    """Up to `n` editing prompts, one per file, files in a fixed pseudo-random order."""
    order = sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).digest())
    out: list[EditPrompt] = []
    for _, text in order:
        excerpt = _excerpt(text, excerpt_chars)
        if excerpt is None:
            continue
        common = rename_candidates(excerpt)
        if not common:
            continue
        old = common[0]
        edited = rename(excerpt, old)
        # cut inside a line, right after its first word: the last tokens are then distinctive,
        # as mid-edit (never after a space: BPE merges a space with the word after it)
        line = edited.find("\n", int(len(edited) * lead_fraction)) + 1
        word = re.compile(r"[ \t]*\S+").match(edited, line)
        cut = word.end() if line > 0 and word else -1
        if cut <= 0:
            continue
        out.append(EditPrompt(excerpt + "\n\n" + edited[:cut], edited[cut:], (old, new_name(old))))
        if len(out) == n:
            break
    return out


def rename_candidates(text: str) -> list[str]:
    """Identifiers used at least twice in `text`, most frequent first."""
    counts = collections.Counter(w for w in _IDENT.findall(text) if not keyword.iskeyword(w) and w not in _BUILTINS)
    return [w for w, c in counts.most_common() if c >= 2]


def new_name(old: str) -> str:
    return old + "_v2" if old.islower() or "_" in old else old + "V2"


def rename(text: str, old: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new_name(old), text)


def _excerpt(text: str, chars: int) -> str | None:
    """Whole lines from the first top-level def/class on, about `chars` long, or None."""
    m = re.search(r"^(def|class) ", text, re.M)
    if m is None:
        return None
    body = text[m.start():]
    if len(body) < chars:
        return None
    end = body.rfind("\n", 0, chars)
    excerpt = body[: end + 1] if end > 0 else None
    if excerpt is None or excerpt.count("\n") < 8:
        return None
    return excerpt


def read_prompts(path: Path) -> list:
    """Prompts from a JSONL file: one {"prompt": text or list of token ids} per line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise QuickdraftError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            p = json.loads(line)["prompt"]
        except (json.JSONDecodeError, TypeError, KeyError):
            raise QuickdraftError(f"{path}:{n}: expected a JSON object with a \"prompt\" field") from None
        if not (isinstance(p, str) and p) and not (isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p)):
            raise QuickdraftError(f"{path}:{n}: \"prompt\" must be a non-empty string or list of token ids")
        prompts.append(p)
    if not prompts:
        raise QuickdraftError(f"{path}: no prompts")
    return prompts
