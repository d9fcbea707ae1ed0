"""Engine logprobs (engine.TokenLogprob) in OpenAI's response shapes.

/v1/completions (legacy): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, where each
top_logprobs entry maps a token's text to its logprob: the n most likely, plus the chosen token
(OpenAI: "up to logprobs + 1 elements"); echoed prompt tokens come first, the very first with
null. /v1/chat/completions: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.
vLLM's prompt_logprobs: per prompt token null or {"<id>": {"logprob", "rank", "decoded_token"}}.
Values are the target's raw log-probabilities (see SamplingParams.logprobs).
"""

from __future__ import annotations

from typing import Any

from ..engine import TokenLogprob
from ..model.tokenizer import Tokenizer


def _text(tok: Tokenizer | None, token_id: int) -> str:
    return f"token_id:{token_id}" if tok is None else tok.token_text(token_id)


def _bytes(tok: Tokenizer | None, token_id: int) -> list[int]:
    return list(_text(tok, token_id).encode() if tok is None else tok.token_bytes(token_id))


def completion_logprobs(tok: Tokenizer | None, lps: list[TokenLogprob | None], n: int, offset: int = 0
                        ) -> tuple[dict[str, list], int]:
    """The legacy logprobs object for `lps` (a None: a first prompt token, no logprob), with
    text offsets from `offset`; returns it and the offset after the last token."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        if lp is None:  # only the prompt's first token; OpenAI writes null for it
            continue
        text = _text(tok, lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        top = {_text(tok, i): v for i, v in lp.top[:n]}
        top.setdefault(text, lp.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def echo_logprobs(tok: Tokenizer | None, prompt: list[int], lps: list[TokenLogprob | None], n: int
                  ) -> tuple[dict[str, list], int]:
    """completion_logprobs of an echoed prompt: its first token with nulls."""
    first = _text(tok, prompt[0])
    body, end = completion_logprobs(tok, lps[1:], n, len(first))
    body = {"tokens": [first] + body["tokens"], "token_logprobs": [None] + body["token_logprobs"],
            "top_logprobs": [None] + body["top_logprobs"], "text_offset": [0] + body["text_offset"]}
    return body, end


def merge(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    return {key: a[key] + b[key] for key in a}


def chat_logprobs(tok: Tokenizer | None, lps: list[TokenLogprob], n: int) -> dict[str, Any]:
    content = []
    for lp in lps:
        content.append({"token": _text(tok, lp.token_id), "logprob": lp.logprob, "bytes": _bytes(tok, lp.token_id),
                        "top_logprobs": [{"token": _text(tok, i), "logprob": v, "bytes": _bytes(tok, i)}
                                         for i, v in lp.top[:n]]})
    return {"content": content, "refusal": None}


def prompt_logprobs(tok: Tokenizer | None, lps: list[TokenLogprob | None], n: int) -> list[dict | None]:
    out: list[dict | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": _text(tok, i)}
                 for r, (i, v) in enumerate(lp.top[:n])}
        entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": lp.rank,
                                            "decoded_token": _text(tok, lp.token_id)})
        out.append(entry)
    return out
