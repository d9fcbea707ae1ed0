"""Tokenizer, chat template and eos ids of a local checkpoint folder.

`tokenizer.json` is read with the `tokenizers` library; the chat template comes from
`tokenizer_config.json` (or a `chat_template.jinja` file) and is rendered with jinja2
in a sandbox. A folder without tokenizer files still serves prompts given as token ids.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ..errors import QuickdraftError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise QuickdraftError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def eos_token_ids(path: str | Path, tokenizer: Tokenizer | None = None) -> tuple[int, ...]:
    """eos ids from generation_config.json and config.json (each may be an int or a
    list); the tokenizer's eos token when neither names one."""
    path = Path(path)
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(path / name).get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise QuickdraftError(f"cannot read {file}: {exc}") from None
        cfg = _read_json(path / "tokenizer_config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        self.chat_template: str | None = template
        self._compiled = None
        # encode without holding the GIL (the server tokenizes on worker threads beside its
        # event loop); off by default: tokenizers' batch path marks the process as having used
        # its thread pool, which then warns in forked children
        self.release_gil = False

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The folder's tokenizer, or None when it has no tokenizer.json."""
        return cls(path) if (Path(path) / "tokenizer.json").exists() else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def special_token_ids(self) -> list[int]:
        """The ids of the special added tokens (bos, eos, chat markers): never text a grammar can match."""
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.release_gil:  # the same ids; encode_batch lets other threads run meanwhile
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: a text longer than n times this takes more
        than n tokens (a cheap bound the server checks before tokenizing)."""
        return max(map(len, self.get_vocab()), default=1) or 1

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _token_bytes_scheme(self) -> tuple[str, dict[str, int] | None, set[int]]:
        """How a vocabulary string spells bytes: "byte-level" (GPT-2's printable alphabet for all
        256 bytes: Llama 3, Qwen, SmolLM2) or "sentencepiece" ("\u2581" for a space, "<0xNN>"
        byte fallback: Llama 2, Mistral); plus the added (special) tokens, spelled as they are."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        added = set(self._tok.get_added_tokens_decoder()) if hasattr(self._tok, "get_added_tokens_decoder") else set()
        if "ByteLevel" in kinds:
            # bytes that are printable stand for themselves; the others are moved up past 255
            printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
            chars, extra = {}, 0
            for b in range(256):
                if b in printable:
                    chars[chr(b)] = b
                else:
                    chars[chr(256 + extra)] = b
                    extra += 1
            return "byte-level", chars, added
        return "sentencepiece", None, added

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a multi-byte character is a few of its
        bytes): what OpenAI's logprobs call a token's `bytes`."""
        cache = self.__dict__.setdefault("_bytes_cache", {})
        if token_id in cache:
            return cache[token_id]
        scheme, chars, added = self._token_bytes_scheme
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            out = b""
        elif token_id in added:
            out = piece.encode()
        elif scheme == "byte-level":
            out = bytes(chars.get(c, 0) for c in piece) if all(c in chars for c in piece) else piece.encode()
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out = bytes([int(piece[3:5], 16)])
        else:
            out = piece.replace("\u2581", " ").encode()
        cache[token_id] = out
        return out

    def token_text(self, token_id: int) -> str:
        """token_bytes as text (a partial character becomes U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the model's template writes it; `tools` (OpenAI's function
        definitions) go to the template as transformers passes them (`tools=`)."""
        if not self.chat_template:
            raise QuickdraftError("this model has no chat template (tokenizer_config.json has no chat_template)")
        if self._compiled is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            try:
                self._compiled = env.from_string(self.chat_template)
            except TemplateError as exc:
                raise QuickdraftError(f"invalid chat template: {exc}") from None
        from jinja2.exceptions import TemplateError

        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools)
        except TemplateError as exc:
            raise QuickdraftError(f"chat template error: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template already writes bos where the model wants it: do not add it twice.
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


class Detokenizer:
    """Incremental decoding of generated ids into text, safe for multi-byte characters
    split across tokens and for tokenizers whose first-token decoding drops a space:
    each new piece is decoded together with a few tokens before it."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-5:])  # context for the first pieces
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""  # an incomplete character: wait for the next token
