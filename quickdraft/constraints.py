"""Constrained decoding: JSON schemas, regular expressions, choice lists and grammars, as token masks.

A constraint is one more logits processor: at every position the tokens its grammar forbids get
-inf, on the target's logits after penalties and logit_bias and before temperature / top-k /
top-p / min-p (vLLM's order: truncation then works on the allowed tokens, so greedy takes the
most likely *allowed* token and top-p keeps p of the allowed mass; masking after truncation
would leave no token at all whenever the nucleus held only forbidden ones). The same masked
distribution is used in plain decoding and at every verify position, so speculation stays
lossless: verify position i follows the committed tokens and the draft tokens before it (the
grammar's matcher is advanced over the draft prefix, its mask read, then rolled back); a draft
token the grammar forbids has p = 0 and is rejected, never emitted. The draft's q is left as it
sampled (exact rejection sampling needs q to be what the draft drew from, masked or not).

The grammar engine is llguidance (Microsoft's; Rust, no Python dependencies, ~8 MB): it builds
its lexer and parser lazily, so a new JSON schema costs milliseconds rather than a compile, it
rolls back consumed tokens, and it tells which tokens a state forces (compute_ff_tokens).
Notations: JSON Schema, regular expressions (Rust's regex syntax), Lark (llguidance's EBNF
dialect) and llama.cpp's GBNF, choice lists.

Compiling: a Constraint checks its notation when built (no tokenizer needed). Its compile for a
vocabulary (llguidance's matcher and first mask: the costly part, up to about a second for a
pathological schema) runs on a worker thread under a time limit (EngineConfig's
constraint_compile_timeout) when the engine checks the request, which the server does off its
event loop and off the engine's thread; llguidance drops the GIL meanwhile, so other requests
keep streaming. The compiled matcher is kept on the Constraint and copied for each request.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import DEFAULT_CONSTRAINT_COMPILE_TIMEOUT
from .errors import QuickdraftError

COMPILED_CACHE_SIZE = 64  # distinct constraints whose compiled start matcher each engine keeps

# JSON is written in one layout: ", " and ": " between items, no other whitespace. Flexible
# whitespace lets a model pad forever (a known way constrained JSON never ends), and one layout
# leaves more tokens forced. A schema's own "x-guidance" options override it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a core dependency: only a broken install lacks it
        raise QuickdraftError("constrained decoding needs the llguidance package: pip install llguidance",
                              field="constraint") from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What the output must match: one of KINDS and its text.

    json_schema: the schema as JSON text (a dict is serialised); json_object: any JSON object
    (value ""); regex: a regular expression the whole output matches; choice: a JSON list of
    strings (a Python list is serialised), the output is one of them; grammar: a Lark grammar
    (llguidance's syntax, `start:` rule) or a GBNF one (llama.cpp's, `root ::=` rule).
    Construction checks the notation (a bad schema, regex or grammar is a QuickdraftError whose
    field is the kind)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise QuickdraftError(f"invalid constraint kind {self.kind!r}: must be one of {', '.join(KINDS)}",
                                  field="constraint")
        value = self.value
        if self.kind == "json_schema" and isinstance(value, (Mapping, bool)):
            value = json.dumps(value)
        elif self.kind == "choice" and isinstance(value, (list, tuple)):
            if not value or not all(isinstance(c, str) and c for c in value):
                raise QuickdraftError("invalid choice: must be a non-empty list of non-empty strings", field="choice")
            value = json.dumps(list(value))
        elif self.kind == "json_object":
            value = ""
        if not isinstance(value, str):
            raise QuickdraftError(f"invalid {self.kind}: must be a string, got {type(value).__name__}", field=self.kind)
        object.__setattr__(self, "value", value)
        self.grammar  # noqa: B018 - parse and check now: errors belong to whoever built the params

    @classmethod
    def of(cls, value: Any) -> Constraint | None:
        """A Constraint from itself, None, or a one-entry mapping {kind: value} ({"json_object": True})."""
        if value is None or isinstance(value, Constraint):
            return value
        if isinstance(value, Mapping) and len(value) == 1:
            (kind, v), = value.items()
            return cls(kind, "" if kind == "json_object" else v)
        raise QuickdraftError("invalid constraint: must be a Constraint or a mapping with one of "
                              f"{', '.join(KINDS)}, got {value!r}"[:300], field="constraint")

    @property
    def grammar(self) -> str:
        """The llguidance grammar (checked once, then cached)."""
        cached = self.__dict__.get("_grammar")
        if cached is None:
            cached = _compile(self.kind, self.value)
            object.__setattr__(self, "_grammar", cached)
        return cached

    def __reduce__(self):  # pickles without the cached grammar and matcher
        return (Constraint, (self.kind, self.value))

    def compiled(self, vocab: GrammarVocabulary, timeout: float = DEFAULT_CONSTRAINT_COMPILE_TIMEOUT):
        """llguidance's matcher for `vocab` at the start of the output (compiled once per
        vocabulary, on a worker thread; copy it before use). A QuickdraftError naming the kind
        when the grammar is invalid for this vocabulary or took longer than `timeout` seconds."""
        cached = self.__dict__.get("_compiled")
        if cached is not None and cached[0] is vocab:
            return cached[1]
        matcher = vocab.compiled(self, timeout)
        object.__setattr__(self, "_compiled", (vocab, matcher))
        return matcher


@functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)  # each request of a client builds its own Constraint
def _compile(kind: str, value: str) -> str:
    llg = _llguidance()
    try:
        if kind == "json_schema":
            schema = json.loads(value)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object (or true / false)")
            grammar = llg.LLMatcher.grammar_from_json_schema(value, defaults=JSON_LAYOUT)
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(value)
        elif kind == "choice":
            choices = json.loads(value)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("must be a non-empty list of non-empty strings")
            grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        else:  # grammar: Lark, or GBNF (llama.cpp's `::=` rules) converted to Lark
            grammar = llg.grammar_from("gbnf" if "::=" in value else "lark", value)
    except (ValueError, json.JSONDecodeError) as exc:
        raise QuickdraftError(f"invalid {kind}: {_one_line(str(exc))}", field=kind) from None
    problem = llg.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise QuickdraftError(f"invalid {kind}: {_one_line(problem)}", field=kind)
    return grammar


def _compile_matcher(vocab: GrammarVocabulary, constraint: Constraint, timeout: float):
    """Build the matcher and its first mask on a daemon thread, waiting at most `timeout` seconds.
    A compile past its limit is left to finish on its own (a thread cannot be stopped; llguidance's
    size and fuel limits end it, and it holds no GIL) and its result dropped."""
    llg = _llguidance()
    done = threading.Event()
    box: dict[str, Any] = {}

    def build() -> None:
        try:
            m = llg.LLMatcher(vocab.tokenizer, constraint.grammar, log_level=0)
            if not m.is_error():  # the lexer is built lazily: the first mask is part of the compile
                scratch = torch.empty(vocab.words, dtype=torch.int32)
                m.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
            box["matcher"] = m
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=build, name="quickdraft-constraint-compile", daemon=True).start()
    if not done.wait(timeout):
        raise QuickdraftError(f"{constraint.kind} did not compile within {timeout:g} s "
                              "(constraint_compile_timeout): simplify it or raise the limit", field=constraint.kind)
    if "error" in box:
        raise box["error"]
    m = box["matcher"]
    if m.is_error():
        raise QuickdraftError(f"invalid {constraint.kind}: {_one_line(m.get_error())}", field=constraint.kind)
    return m


def _one_line(message: str) -> str:
    """llguidance's multi-line message (with caret lines and source excerpts) as one line."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and line.strip("^ ") and not line.split("|")[0].strip().isdigit()]
    return "; ".join(kept)[:1000]


class GrammarVocabulary:
    """llguidance's view of a model's vocabulary: each token id's bytes (the tokenizer's
    token_bytes), the special tokens, eos, and the model's vocabulary size (ids past the
    tokenizer's are never allowed). Built once per engine (about a second for 50k tokens)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        llg = _llguidance()
        if not eos_token_ids:
            raise QuickdraftError("constraints need an eos token id; this model names none", field="constraint")
        n = min(tokenizer.vocab_size, vocab_size)
        added = tokenizer.special_token_ids() if hasattr(tokenizer, "special_token_ids") else []

        class _Words:  # llguidance.TokenizerWrapper's duck type
            tokens = [tokenizer.token_bytes(i) for i in range(n)]
            eos_token_id = eos_token_ids[0]
            bos_token_id = None
            special_token_ids = [i for i in added if i < n]

            def __call__(self, text: str) -> list[int]:
                return tokenizer.encode(text, add_special_tokens=False)

        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of one bitmask
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Words()), n_vocab=vocab_size,
                                         eos_token=list(eos_token_ids))
        self._bits = torch.arange(32, dtype=torch.int32)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        # after eos only eos is allowed (llguidance's stopped state; its rollback cannot undo an eos,
        # so draft eos tokens are never consumed: their children get this mask)
        self.eos = frozenset(eos_token_ids)
        self.eos_only = torch.zeros(self.words, dtype=torch.int32)
        for e in self.eos:
            if e < vocab_size:
                self.eos_only[e // 32] |= torch.tensor(1 << (e % 32), dtype=torch.int64).to(torch.int32)

    def compiled(self, constraint: Constraint, timeout: float) -> Any:
        """The start matcher of `constraint` for this vocabulary: compiled once per distinct
        (kind, value), kept for the last COMPILED_CACHE_SIZE of them (a client sends the same
        schema with every request), least recently used first out."""
        key = (constraint.kind, constraint.value)
        with self._lock:
            m = self._compiled.get(key)
            if m is not None:
                self._compiled.move_to_end(key)
                return m
        m = _compile_matcher(self, constraint, timeout)  # outside the lock: compiles may run side by side
        with self._lock:
            self._compiled[key] = m
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return m

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh grammar state for one request (a copy of the constraint's compiled matcher)."""
        return Matcher(self, constraint)

    def to_bool(self, bitmask: torch.Tensor) -> torch.Tensor:
        """(..., words) int32 bitmasks -> (..., V) bool allowed."""
        bits = (bitmask[..., None] >> self._bits) & 1
        return bits.flatten(-2)[..., :self.vocab_size].bool()


class Matcher:
    """One request's grammar state over its committed output; `masks` reads the state after
    each draft prefix without changing it."""

    def __init__(self, vocab: GrammarVocabulary, constraint: Constraint):
        self.vocab = vocab
        self.m = constraint.compiled(vocab).deep_copy()

    def _fill(self, out: torch.Tensor) -> None:
        self.m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def commit(self, token: int) -> bool:
        """Consume a committed token; False when the grammar forbids it (the matcher is then broken)."""
        return self.m.consume_token(token)

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (may be empty)."""
        return self.m.compute_ff_tokens()

    def masks(self, nodes: Sequence[int], parents: Sequence[int] | None, out: torch.Tensor) -> None:
        """Fill out (1 + N, words) int32 with the bitmask after the committed tokens (row 0) and
        after each draft node's path (row 1 + n): a chain's node n follows nodes 0..n-1 (parents
        None), a tree's its ancestors (parents[n], -1 = the root). Absent nodes (-1) and nodes
        below a forbidden token keep row 0's mask (their positions are never read: the verifier
        stops at the first forbidden token). The matcher is left where it was."""
        self._fill(out[0])
        on: list[int] = []  # the node path the matcher has consumed past the committed tokens
        ok: dict[int, bool] = {-1: True}  # node -> its path is allowed

        def path_of(n: int) -> list[int]:
            path = []
            while n >= 0:
                path.append(n)
                n = n - 1 if parents is None else parents[n]
            return path[::-1]

        allowed_at: dict[int, torch.Tensor] = {-1: out[0]}
        ended: set[int] = set()  # nodes at or below an eos token (never consumed: see GrammarVocabulary.eos)
        for n, t in enumerate(nodes):
            parent = n - 1 if parents is None else parents[n]
            if t < 0 or not ok.get(parent, False):
                out[1 + n] = out[0]
                ok[n] = False
                continue
            word = allowed_at[parent][t // 32].item()
            if not (word >> (t % 32)) & 1:
                out[1 + n] = out[0]
                ok[n] = False
                continue
            if t in self.vocab.eos or parent in ended:
                out[1 + n] = self.vocab.eos_only
                allowed_at[n] = out[1 + n]
                ok[n] = True
                ended.add(n)
                continue
            path = path_of(n)
            common = 0
            while common < len(on) and common < len(path) - 1 and on[common] == path[common]:
                common += 1
            if len(on) > common:
                self.m.rollback(len(on) - common)
                del on[common:]
            for m in path[common:]:
                self.m.consume_token(nodes[m])
                on.append(m)
            self._fill(out[1 + n])
            allowed_at[n] = out[1 + n]
            ok[n] = True
        if on:
            self.m.rollback(len(on))


def batch_masks(vocab: GrammarVocabulary, matchers: Sequence[Matcher | None], nodes: list[list[int]] | None,
                parents: list[list[int]] | None) -> torch.Tensor:
    """(B, 1 + N, V) bool: the tokens each row's grammar allows at each verify position (rows
    without a constraint allow every token). nodes: (B, N) draft token ids on the host (-1 =
    absent) or None (plain decoding); parents: a tree's, or None for chains."""
    B, N = len(matchers), 0 if nodes is None else len(nodes[0])
    bm = torch.full((B, 1 + N, vocab.words), -1, dtype=torch.int32)
    for b, m in enumerate(matchers):
        if m is not None:
            m.masks(nodes[b] if N else [], None if parents is None else parents[b], bm[b])
    return vocab.to_bool(bm)


class Vocabularies:
    """One GrammarVocabulary per engine, built on first use (thread-safe: the server checks
    requests off the engine's thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._args = (tokenizer, vocab_size, tuple(eos_token_ids))
        self._vocab: GrammarVocabulary | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarVocabulary:
        if self._vocab is None:
            with self._lock:
                if self._vocab is None:
                    tokenizer = self._args[0]
                    if tokenizer is None:
                        raise QuickdraftError("constraints need a tokenizer; this model folder has none",
                                              field="constraint")
                    self._vocab = GrammarVocabulary(*self._args)
        return self._vocab
