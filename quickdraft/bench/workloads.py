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


# --- chat workloads for instruction-tuned models (benchmarks/real_model.py) ----------------------
# Conversations as {"role", "content"} messages, rendered by the model's own chat template
# (LLM.encode_chat). Written for this benchmark: varied lengths, topics and answer shapes.

Conversation = list[dict[str, str]]

CHAT_PROMPTS = (
    "What is the difference between weather and climate? Answer in a short paragraph.",
    "Give me three tips for getting better sleep, with one sentence of explanation each.",
    "Explain to a ten-year-old why the sky is blue.",
    "I have eggs, spinach, an onion and some cheese. Suggest a quick dinner and how to cook it.",
    "Write a polite email to my landlord asking when the broken heating will be repaired.",
    "Summarise the main causes of the French Revolution in a few bullet points.",
    "What are the pros and cons of working from home?",
    "How does a refrigerator keep food cold? Keep it simple.",
    "Plan a relaxed one-day visit to Paris for someone who likes museums and good food.",
    "Translate into French and then explain the grammar: 'I would have come if you had told me.'",
    "My houseplant's leaves are turning yellow. What could be wrong and what should I check first?",
    "Write a short poem about autumn rain in a city.",
)

CODE_REQUESTS = (
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Write a Python function that merges two sorted lists into one sorted list without using sort().",
    "Write a JavaScript function that debounces another function by a given number of milliseconds.",
    "Write a Python function that reads a CSV file and returns the average of a named numeric column.",
    "Write a function in C that reverses a singly linked list in place. Include the struct definition.",
    "Write a Python function that returns the n-th Fibonacci number using memoisation, with a docstring.",
    "Write a SQL query that lists the five customers with the highest total order value, "
    "given tables customers(id, name) and orders(id, customer_id, amount).",
    "Write a Python class for a stack with push, pop, peek and is_empty methods, with type hints.",
    "Write a bash script that counts the lines of every .py file in a folder and prints the total.",
    "Write a Python function that validates an email address with a regular expression and explain the pattern.",
    "Write a Go function that counts how often each word occurs in a string and returns a map.",
    "Write a Python function that flattens an arbitrarily nested list, with a few example calls.",
)

EDIT_INSTRUCTIONS = (  # {old}, {new}, {code}: the instruction around the file
    "Here is a file:\n\n```python\n{code}```\n\nRename `{old}` to `{new}` everywhere and return the whole file.",
    "Please rename every use of `{old}` to `{new}` in the following code. Return the complete updated file, "
    "nothing else.\n\n```python\n{code}```",
    "```python\n{code}```\n\nIn the file above, change the identifier `{old}` to `{new}`. Reply with the full "
    "file.",
    "I'm refactoring. Replace the name `{old}` with `{new}` throughout this module and give me back all of "
    "it:\n\n```python\n{code}```",
)


@dataclass(frozen=True)
class ChatEdit:
    messages: Conversation  # what the model is asked
    expected: str  # the file with the rename done (what a perfect answer contains)
    renamed: tuple[str, str]  # (old, new) identifier
    lines: int  # lines of the file in the prompt


def chat_requests(n: int) -> list[Conversation]:
    """Up to `n` general instructions and questions (single user turns)."""
    return [[{"role": "user", "content": text}] for text in CHAT_PROMPTS[:n]]


def code_requests(n: int) -> list[Conversation]:
    """Up to `n` "write a function that ..." requests in several languages."""
    return [[{"role": "user", "content": text}] for text in CODE_REQUESTS[:n]]


def editing_requests(docs: list[Document], n: int, min_lines: int = 30, max_lines: int = 80,
                     max_chars: int = 2400) -> list[ChatEdit]:
    """Up to `n` "rename X to Y and return the whole file" requests, one per held-out file:
    a 30-80 line excerpt (whole lines from its first top-level def/class, at most `max_chars`)
    inline, so most of a good answer is copied from the prompt."""
    order = sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).digest())
    out: list[ChatEdit] = []
    for _, text in order:
        m = re.search(r"^(def|class) ", text, re.M)
        if m is None:
            continue
        lines = text[m.start():].splitlines(keepends=True)[:max_lines]
        while lines and sum(map(len, lines)) > max_chars:
            lines.pop()
        while lines and not lines[-1].strip():
            lines.pop()
        if len(lines) < min_lines or any(len(line) > 120 for line in lines):
            continue
        code = "".join(lines)
        if not code.endswith("\n"):
            code += "\n"
        common = [w for w in rename_candidates(code) if len(re.findall(rf"\b{re.escape(w)}\b", code)) >= 3]
        if not common:
            continue
        old, new = common[0], new_name(common[0])
        template = EDIT_INSTRUCTIONS[len(out) % len(EDIT_INSTRUCTIONS)]
        out.append(ChatEdit([{"role": "user", "content": template.format(old=old, new=new, code=code)}],
                            rename(code, old), (old, new), len(lines)))
        if len(out) == n:
            break
    return out


def copied_lines(output: str, expected: str) -> float:
    """The share of the output's non-blank lines that are lines of `expected` (0 when none):
    how much of an editing answer is the edited file, copied."""
    want = {line.strip() for line in expected.splitlines() if line.strip()}
    got = [line.strip() for line in output.splitlines() if line.strip()]
    return sum(line in want for line in got) / len(got) if got else 0.0
