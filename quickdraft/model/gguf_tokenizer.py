"""A GGUF's tokenizer metadata -> tokenizer.json (the `tokenizers` library) + tokenizer_config.json.

llama.cpp keeps the vocabulary as `tokenizer.ggml.*` arrays. Two kinds are rebuilt here, to the
same token ids as transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`):

- `gpt2`: byte-level BPE (Llama 3, Qwen, SmolLM): tokens in GPT-2's byte alphabet, merges as
  "left right" strings, and a pre-tokenizer split named by `tokenizer.ggml.pre`.
- `llama`: SentencePiece BPE (Llama 2, Mistral): tokens with scores and token types, byte
  fallback through the `<0xNN>` tokens. Such files store no merges: they are recovered from
  the scores, ranked as transformers ranks them.

Control tokens (and the bos / eos / unk / pad tokens) become special added tokens, user-defined
ones plain added tokens, so both match whole in text as llama.cpp matches them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..errors import QuickdraftError, UnsupportedModelError

log = logging.getLogger("quickdraft")

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as llama.cpp names them. Absent = GPT-2's own split.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2),
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O),
}


@dataclass(frozen=True)
class GGUFTokenizer:
    tokenizer_json: str  # tokenizer.json text
    config: dict[str, Any]  # tokenizer_config.json


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE tokens are spelled in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()
    chars = set(alphabet.values())
    # Tokens outside the alphabet (raw text, e.g. added tokens) are spelled in it, as the BPE model sees text.
    vocab = {t if set(t) <= chars else "".join(alphabet[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise QuickdraftError("GGUF tokenizer.ggml.merges: every merge must be two tokens separated by a space")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":  # llama.cpp: each digit alone, then GPT-2's split
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif PRE_SPLITS.get(pre) is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        if pre not in PRE_SPLITS:
            log.warning("GGUF tokenizer.ggml.pre %r is not one quickdraft knows: splitting text as GPT-2 does "
                        "(as transformers does); token ids may differ from llama.cpp's on some text", pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, lambda t: set(t) <= chars  # which tokens the vocabulary holds as written


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: each way of cutting a token into two
    tokens is a merge, ranked by the merged token's score (best first; ties: longer left piece,
    then longer right piece, then vocabulary order), as transformers' `generate_merges` ranks them."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in dict(zip(tokens, scores)).items():
        cuts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        cuts.sort(key=lambda c: (vocab[c[0]], vocab[c[1]]))
        found += [(left, right, score) for left, right in cuts]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: keeps the order above on ties
    return [(left, right) for left, right, _ in found]


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in meta:
        merges = sentencepiece_merges(tokens, meta["tokenizer.ggml.scores"])
    else:
        raise QuickdraftError("GGUF SentencePiece tokenizer has neither tokenizer.ggml.scores nor merges")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, dropout=None,
                               fuse_unk=True, byte_fallback=True))
    # llama.cpp prepends a space unless the file says not to (transformers always does).
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok, lambda t: True


def build_tokenizer(meta: dict[str, Any]) -> GGUFTokenizer | None:
    """tokenizer.json + tokenizer_config.json from GGUF metadata; None when the file has no vocabulary."""
    from tokenizers import AddedToken, processors

    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise UnsupportedModelError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
    tok, holds = builders[kind](meta, tokens)

    def token(name: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    named = {name: token(key) for name, key in
             (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))}
    types = meta.get("tokenizer.ggml.token_type") or []
    special = [t for t, k in zip(tokens, types) if k == _CONTROL] + [t for t in named.values() if t is not None]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in dict.fromkeys(special) if holds(t)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED and holds(t)])

    # Older SentencePiece files have no flag: llama.cpp adds bos to them.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and named["bos_token"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and named["eos_token"] is not None
    bos, eos = named["bos_token"], named["eos_token"]
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[(bos, tok.token_to_id(bos))] * add_bos + [(eos, tok.token_to_id(eos))] * add_eos)

    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **named, "add_bos_token": add_bos,
                              "add_eos_token": add_eos, "clean_up_tokenization_spaces": False}
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return GGUFTokenizer(tok.to_str(), config)
