"""Request bodies of the OpenAI API (the parts quickdraft serves) and OpenAI's error body.

Unknown fields are ignored, as OpenAI's own server does. Fields that OpenAI defines but
quickdraft cannot honour (suffix, best_of > n) are a 400 when set to anything but their
neutral value, rather than being silently dropped: a client that asks for them would otherwise
get a different answer than it thinks.

Structured output (docs/structured-output.md): OpenAI's `response_format` (`json_object`,
`json_schema`) on both endpoints, and the body extensions vLLM's clients send: `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` ({"json", "regex",
"choice", "grammar", "json_object"}). One per request; `constraint()` names the body field it
came from, so that a bad schema's 400 names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, \
    StrictInt, StrictStr, ValidationError

from ..sampling import field_problem

MAX_N = 64  # choices per request
MAX_STOP = 16  # stop strings per request


def _utf8(text: str) -> str:
    """Strings must be encodable text: JSON's "\\ud800" escapes decode to lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone surrogate ({text[exc.start]!r} at index {exc.start}): "
                         "not valid Unicode text") from None
    return text


Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]  # strict: "0" and true are not numbers
Text = Annotated[StrictStr, AfterValidator(_utf8)]


def _sampling_check(name: str) -> AfterValidator:
    """The sampling field's own range check (sampling.FIELD_CHECKS, what SamplingParams runs):
    the same bounds and words in a 400 as in the library's error."""
    def check(value):
        problem = field_problem(name, value)
        if problem is not None:
            raise ValueError(problem)
        return value
    return AfterValidator(check)


def _number(name: str):
    return Annotated[Number, _sampling_check(name)]


def _integer(name: str):
    return Annotated[StrictInt, _sampling_check(name)]
TokenIds = list[StrictInt]


def _texts(value: Any) -> Any:
    """A string or a list of them: each checked by _utf8 before a union of types can hide why
    it failed; anything else is left to the field's type."""
    for x in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(x, str):
            _utf8(x)
    return value


def _prompt_shape(value: Any) -> Any:
    """One clear message for a prompt of the wrong shape (a union's error would name its first
    member: "should be a valid string" for a list of floats)."""
    if isinstance(value, str):
        return _texts(value)
    if isinstance(value, list):
        if all(isinstance(x, str) for x in value):
            return _texts(value)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return value
        if all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
               for x in value):
            return value
        if any(isinstance(x, (float, bool)) for x in value) or any(
                isinstance(x, list) and any(isinstance(t, (float, bool)) for t in x) for x in value):
            raise ValueError("token ids must be integers")
    raise ValueError("prompt must be a string, a list of strings, a list of token ids (integers) "
                     "or a list of such lists")


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or {401: "authentication_error", 429: "rate_limit_exceeded",
                              503: "service_unavailable"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    # sampling fields: None = SamplingParams' default; each checked by SamplingParams' own check
    max_tokens: _integer("max_tokens") | None = None
    temperature: _number("temperature") | None = None
    top_p: _number("top_p") | None = None
    top_k: _integer("top_k") | None = None  # extra field (vLLM): 0 or -1 = off
    min_p: _number("min_p") | None = None  # extra field (vLLM)
    seed: _integer("seed") | None = None
    stop: Annotated[Text | list[Text] | None, BeforeValidator(_texts)] = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # extra field (vLLM)
    num_speculative_tokens: StrictInt | None = Field(None, ge=0)  # extra field: this request's own k cap
    return_token_ids: StrictBool = False  # extra field (vLLM): token ids beside the text, per chunk when streaming
    return_token_origins: StrictBool = False  # extra field: each token's origin and text (docs/server.md)
    user: StrictStr | None = None
    presence_penalty: _number("presence_penalty") | None = None
    frequency_penalty: _number("frequency_penalty") | None = None
    repetition_penalty: _number("repetition_penalty") | None = None  # extra field (vLLM): 1 = off
    logit_bias: dict[StrictStr, Number] | None = None  # token id (as a JSON key) -> bias, clamped to [-100, 100]
    prompt_logprobs: _integer("prompt_logprobs") | None = None  # extra field (vLLM)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictBool | Text | None = None  # extra fields (vLLM): a schema (or its JSON text)
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None  # Lark or GBNF
    structured_outputs: dict[str, Any] | None = None  # extra field (vLLM >= 0.10)

    def unsupported(self) -> list[str]:
        return []

    def constraint(self) -> tuple[str, dict[str, Any]] | None:
        """(the body field it came from, {kind: value} for constraints.Constraint.of), or None."""
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(400, "response_format json_schema needs json_schema.schema: a JSON schema object",
                                   "response_format.json_schema.schema")
                if not isinstance(spec.get("strict", False), (bool, type(None))):
                    raise APIError(400, "response_format json_schema.strict must be a boolean",
                                   "response_format.json_schema.strict")
                # strict or not, the schema is enforced: output always validates
                found.append(("response_format.json_schema.schema", {"json_schema": schema}))
            elif kind not in (None, "text"):
                raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                               "response_format.type")
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                if name == "guided_json" and isinstance(value, bool):
                    raise APIError(400, "guided_json must be a JSON schema (an object or its JSON text)", name)
                found.append((name, {kind: value}))
        so = self.structured_outputs
        if so:
            kinds = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                     "json_object": "json_object"}
            given = [(k, v) for k, v in so.items() if k in kinds and v not in (None, False)]
            unknown = [k for k, v in so.items() if k not in kinds and v not in (None, False)]
            if unknown:
                raise APIError(400, f"structured_outputs.{unknown[0]} is not supported by this server "
                               f"(supported: {', '.join(kinds)})", f"structured_outputs.{unknown[0]}")
            found += [(f"structured_outputs.{k}", {kinds[k]: v}) for k, v in given]
        if len(found) > 1:
            raise APIError(400, f"one constraint per request: got {found[0][0]} and {found[1][0]}", found[1][0])
        return found[0] if found else None

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids; a key that is not one is a 400."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise APIError(400, f"invalid logit_bias: keys must be token ids (integers >= 0 as strings), "
                               f"got {key!r}", "logit_bias")
            out[int(key)] = value
        return out

    def wanted_logprobs(self) -> int | None:
        """Alternatives per generated token the response carries (None: no logprobs)."""
        return None

    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise APIError(400, f"at most {MAX_STOP} stop strings, got {len(stop)}", "stop")
        if any(s == "" for s in stop):
            raise APIError(400, "stop strings must not be empty", "stop")
        return stop


class CompletionRequest(_Sampling):
    prompt: Annotated[Text | list[Text] | TokenIds | list[TokenIds], BeforeValidator(_prompt_shape)]
    echo: StrictBool = False
    suffix: StrictStr | None = None
    logprobs: _integer("logprobs") | None = None  # OpenAI allows 5; vLLM 20 (MAX_LOGPROBS), as here
    best_of: StrictInt | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.suffix:
            bad.append("suffix")
        if self.best_of not in (None, 1, self.n):
            bad.append("best_of")
        return bad

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string or a list of token ids each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (server/tools.py)
    tool_call_id: Text | None = None  # a tool message answers this call

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:  # templates read the arguments as an object, as transformers gives them
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                calls.append({**c, "function": fn})
            msg["tool_calls"] = calls
        return msg


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: _integer("max_tokens") | None = None
    logprobs: StrictBool = False
    top_logprobs: _integer("logprobs") | None = None
    tools: list[Any] | None = None  # checked by server/tools.py's plan
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None  # "required" allows several calls either way

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return bad


@dataclass(frozen=True)
class Limits:
    """What no request can exceed and still be served, known without tokenizing."""
    max_sequences: int  # engine requests held at once (--max-num-seqs + --max-queue)
    context: int  # tokens per request (max_model_len: the model's context, or less where the KV budget holds less)
    max_chars: int | None  # characters of one prompt (context x the most characters one token spells)
    max_messages: int  # messages of one chat (each takes at least one token of any real template)


def precheck(data: Any, limits: Limits) -> None:
    """Cheap checks on a decoded body before it is validated and tokenized: a request that can
    never fit is a 400 naming the limit at once, not after seconds of work on its size. Only
    fields of the expected types are looked at; validation reports the others."""
    if not isinstance(data, dict):
        return
    n = data.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1
    prompt = data.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    if prompts and not isinstance(prompts[0], (str, list)):
        prompts = [prompts]  # one prompt of token ids
    if len(prompts) * n > limits.max_sequences:
        raise APIError(400, f"this request asks for {len(prompts) * n} sequences ({len(prompts)} prompts x n={n}); "
                       f"the server holds at most {limits.max_sequences} at once", "prompt" if len(prompts) > 1
                       else "n", code="request_too_large")
    for p in prompts:
        if isinstance(p, str) and limits.max_chars is not None and len(p) > limits.max_chars:
            raise APIError(400, f"the prompt has {len(p)} characters: more than the context length "
                           f"({limits.context} tokens) can hold ({limits.max_chars} characters at most)",
                           "prompt", code="context_length_exceeded")
        if isinstance(p, list) and len(p) >= limits.context:
            raise APIError(400, f"the prompt takes {len(p)} tokens, the context length (max_model_len) is "
                           f"{limits.context}: no room to answer", "prompt", code="context_length_exceeded")
    messages = data.get("messages")
    if isinstance(messages, list):
        if len(messages) > limits.max_messages:
            raise APIError(400, f"{len(messages)} messages: more than the context length "
                           f"({limits.context} tokens) can hold ({limits.max_messages} messages at most)",
                           "messages", code="context_length_exceeded")
        if limits.max_chars is not None:
            chars = 0
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                parts = content if isinstance(content, list) else [content]
                chars += sum(len(x) if isinstance(x, str) else len(x.get("text", "")) if isinstance(x, dict)
                             and isinstance(x.get("text"), str) else 0 for x in parts)
            if chars > limits.max_chars:
                raise APIError(400, f"the messages have {chars} characters: more than the context length "
                               f"({limits.context} tokens) can hold ({limits.max_chars} characters at most)",
                               "messages", code="context_length_exceeded")


_TYPE_TAGS = {"str", "int", "bool", "float", "dict", "list", "none"}
_TYPE_TAG_PREFIXES = ("list[", "dict[", "function-", "constrained-", "nullable[", "lax-", "strict-")


def parse_body(model: type[BaseModel], data: Any) -> Union[CompletionRequest, ChatCompletionRequest]:
    """Validate a decoded JSON body; errors become a 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = [str(x) for x in first.get("loc", ())]
        # pydantic adds the union member's type name to the location; keep the field path
        path = [x for x in loc if x not in _TYPE_TAGS and not x.startswith(_TYPE_TAG_PREFIXES)]
        param = ".".join(path) or None
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        if first.get("type") == "missing":
            message = f"missing required field {param!r}"
        else:
            value = first.get("input")
            shown = repr(value)
            if len(shown) > 80:
                shown = shown[:77] + "..."
            message = f"invalid {param or 'body'}: {msg} (got {shown})"
        raise APIError(400, message, param) from None
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"{bad[0]} is not supported by this server", bad[0])
    return req
