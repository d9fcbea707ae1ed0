"""The OpenAI-compatible HTTP server: FastAPI routes over the AsyncEngine. No model logic.

    POST /v1/completions, POST /v1/chat/completions (both with stream=true as SSE)
    GET /v1/models, GET /health, GET /metrics

The route and error handlers are module-level functions; build_app(state) makes the app,
keeps the ServerState (state.py) in app.state.server, where handlers reach it with
_server(request), and registers them.

Every error is OpenAI's body {"error": {"message", "type", "param", "code"}} with a 4xx
status for anything the client sent (malformed JSON, wrong types, bad sampling values,
a prompt over the context, an unknown model, a request larger than the server can ever
hold), 401 without the API key (access.py), 413 past the body limit, 415 for a body not
declared application/json, 408 for a body that does not arrive in time, 429 + Retry-After
when the queue is full, 503 while the model loads or after the engine died.

Parsing, validation and tokenizing run on a worker thread (tokenizers releases the GIL),
after cheap bounds (protocol.precheck): one big request does not stall the event loop,
which streams every other request's tokens. An error after a stream started is a
`data: {"error": ...}` event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..constraints import KINDS
from ..engine import RequestOutput
from ..model.tokenizer import Detokenizer
from ..errors import ContextLengthError, QuickdraftError
from ..metrics import SpecStats
from ..sampling import SamplingParams
from . import logprobs as lpfmt
from . import tools as toolcalls
from .access import add_access_control
from .async_engine import EngineDead, EngineError, QueueFull, now
from .metrics import RequestTimer
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body, precheck
from .state import ServerState  # with build_app, the entry point (serve.py, tests)
from .web import add_web_page

log = logging.getLogger("quickdraft.server")

MAX_BODY_BYTES = 32 * 1024 * 1024
_CLOSE = {"Connection": "close"}  # after an unread body: the connection cannot be reused


@dataclass
class _Sub:
    index: int  # choice index
    prompt: list[int]
    params: SamplingParams


class _Job:
    """One HTTP request's engine requests (n choices per prompt), sharing one output queue."""

    def __init__(self, state: ServerState, subs: list[_Sub], k: int | None, arrival: float):
        self.engine = state.require_engine()
        self.engine.check_room(len(subs))
        self.queue: asyncio.Queue = asyncio.Queue()
        self.index: dict[str, int] = {}
        self.done: set[str] = set()
        self.timers: dict[str, RequestTimer] = {}
        self.closed = False
        self.metrics = state.metrics
        for sub in subs:
            rid = self.engine.submit(sub.prompt, sub.params, self.queue, k)
            self.index[rid] = sub.index
            self.timers[rid] = RequestTimer(state.metrics, arrival)
            state.metrics.prompt_tokens.inc(len(sub.prompt))

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as outputs arrive, until every choice finished."""
        while len(self.done) < len(self.index):
            item = await self.queue.get()
            if isinstance(item, EngineError):
                self.done.add(item.request_id)
                raise QuickdraftError(item.message)
            t = now()
            timer = self.timers[item.request_id]
            timer.output(t, len(item.new_token_ids))
            if item.finished:
                self.done.add(item.request_id)
                timer.finish(t, item.finish_reason)
            yield self.index[item.request_id], item

    def close(self) -> None:
        """Release every choice (aborting the unfinished ones); safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for rid in self.index:
            self.engine.release(rid, finished=rid in self.done)


# ---- the app ------------------------------------------------------------------------------

def build_app(state: ServerState, api_key: str | None = None, allowed_origins: list[str] | None = None,
              web: bool = True) -> FastAPI:
    """The server's app over `state` (which it starts and stops with the app's lifespan);
    `api_key`: required on /v1/*; `allowed_origins`: browser origins allowed (CORS); `web`:
    serve the chat page at / (web.py)."""
    app = FastAPI(title="quickdraft", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    add_access_control(app, api_key, allowed_origins,
                       on_reject=lambda: state.metrics.errors.labels(status="401").inc())
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    if web:
        add_web_page(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state: ServerState = app.state.server
    state.start(asyncio.get_running_loop())
    yield
    state.stop()


def _server(request: Request) -> ServerState:
    return request.app.state.server


def _error_response(request: Request, exc: APIError) -> JSONResponse:
    _server(request).metrics.errors.labels(status=str(exc.status)).inc()
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error_response(request, exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    return _error_response(request, APIError(exc.status_code, message, type_="invalid_request_error"))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s", request.url.path)
    return _error_response(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


# ---- routes -------------------------------------------------------------------------------

async def health(request: Request):
    state = _server(request)
    if state.ready:
        return Response(status_code=200)
    reason = (state.engine.dead if state.engine is not None else state.load_error) or "loading"
    return JSONResponse({"status": reason}, status_code=503)


async def metrics(request: Request):
    return Response(generate_latest(_server(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request):
    state = _server(request)
    data = [{"id": state.model_name, "object": "model", "created": state.created, "owned_by": "quickdraft"}]
    if state.llm is not None:
        data[0]["max_model_len"] = state.llm.engine.max_model_len
    return {"object": "list", "data": data}


async def completions(request: Request):
    return await _generate(request, _prepare_completion, chat=False)


async def chat_completions(request: Request):
    return await _generate(request, _prepare_chat, chat=True)


async def _generate(request: Request, prepare, chat: bool):
    """Read the body here; parse, check and tokenize it on a worker thread (a big request
    must not hold up the event loop, which streams everyone's tokens); then submit."""
    state = _server(request)
    arrival = now()
    body = await _read_body(request)
    job = await asyncio.to_thread(prepare, state, body)
    return await _respond(state, request, job, arrival, chat=chat)


# ---- request -> engine inputs (on a worker thread) ----------------------------------------

@dataclass(frozen=True)
class _Prepared:
    req: Any  # CompletionRequest | ChatCompletionRequest
    subs: list[_Sub]
    prompts: list[list[int]]
    echo: list[str] | None = None  # completions with echo: each prompt's text, answered before its completion
    tools: toolcalls.ToolPlan | None = None  # chat with tools: how the answer is read (server/tools.py)


def _prepare_completion(state: ServerState, body: bytes) -> _Prepared:
    req, engine, tok = _begin(state, body, CompletionRequest)
    prompts: list[list[int]] = []
    echo: list[str | None] = []
    for p in req.prompts():
        if isinstance(p, str):
            if p == "":
                raise APIError(400, "prompt is empty", "prompt")
            if tok is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
            echo.append(p)
            p = tok.encode(p)
        else:
            echo.append(None)
        prompts.append(p)
    max_tokens = SamplingParams.max_tokens if req.max_tokens is None else req.max_tokens  # 16, as OpenAI
    subs = _subs(engine.engine, req, prompts, [max_tokens] * len(prompts))  # checks the token ids
    if not req.echo:
        return _Prepared(req, subs, prompts)
    # a prompt sent as token ids is echoed as their text (special tokens included)
    echo = [e if e is not None else "" if tok is None else tok.decode(p, skip_special_tokens=False)
            for e, p in zip(echo, prompts)]
    return _Prepared(req, subs, prompts, echo)


def _prepare_chat(state: ServerState, body: bytes) -> _Prepared:
    req, engine, tok = _begin(state, body, ChatCompletionRequest)
    if tok is None or not tok.chat_template:
        raise APIError(400, "this model has no chat template (tokenizer_config.json has no chat_template; "
                       "start the server with --chat-template FILE, or use /v1/completions)", "messages")
    plan = toolcalls.plan(req.tools, req.tool_choice)
    try:
        prompt = state.llm.encode_chat([m.as_template_input() for m in req.messages],  # LLM.chat's path
                                       None if plan is None else plan.tools)
    except QuickdraftError as exc:
        raise APIError(400, str(exc), "messages") from None
    except Exception as exc:  # noqa: BLE001 - a template failing on odd input is the input's fault
        raise APIError(400, f"chat template failed on these messages: {type(exc).__name__}: {exc}",
                       "messages") from None
    limit = req.max_completion_tokens or req.max_tokens
    if limit is None:
        limit = max(1, engine.engine.max_model_len - len(prompt))  # _check names the messages if none is left
    subs = _subs(engine.engine, req, [prompt], [limit], plan)
    return _Prepared(req, subs, [prompt], tools=plan)


def _begin(state: ServerState, body: bytes, model):
    """Decode, bound and parse a body, and check what every generation request shares:
    the engine, the model name."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None
    if state.ready:  # cheap bounds before the expensive validation and tokenizing
        precheck(data, state.limits())
    req = parse_body(model, data)
    engine = state.require_engine()
    _check_model(state, req.model)
    return req, engine, state.llm.tokenizer


_JSON_TYPES = ("application/json",)


async def _read_body(request: Request) -> bytes:
    """The body, counted as it streams in (a chunked upload has no Content-Length to trust):
    413 at MAX_BODY_BYTES, 408 if it is not complete within the request timeout, 415 unless it is
    declared JSON (a browser's cross-origin "simple" POST cannot declare it)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media not in _JSON_TYPES:
        raise APIError(415, f"the body must be JSON sent with Content-Type: application/json "
                       f"(got {media or 'no Content-Type'!r})", code="unsupported_media_type")
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"request body too large ({size} bytes; limit {MAX_BODY_BYTES})",
                       code="body_too_large", headers=_CLOSE)
    chunks: list[bytes] = []
    timeout = _server(request).request_timeout

    async def receive() -> None:
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > MAX_BODY_BYTES:
                raise APIError(413, f"request body too large (over {MAX_BODY_BYTES} bytes, the limit)",
                               code="body_too_large", headers=_CLOSE)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s "
                       f"({sum(map(len, chunks))} bytes received)", code="request_timeout", headers=_CLOSE) from None
    except ClientDisconnect:
        raise APIError(499, "the client disconnected while sending the request", code="client_disconnected") \
            from None
    return b"".join(chunks)


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                       "model", code="model_not_found")


def _constraint(req, plan: toolcalls.ToolPlan | None) -> tuple[str, dict[str, Any]] | None:
    """The request's one constraint (the body field it came from, Constraint.of's mapping):
    response_format or a guided_* field, or tool_choice "required" / a named function."""
    given = req.constraint()
    tool = None if plan is None else plan.constraint()
    if given is not None and tool is not None:
        raise APIError(400, f"tool_choice {plan.choice!r} constrains the answer to a tool call: it cannot be combined "
                       f"with {given[0]}", given[0])
    return given if tool is None else ("tool_choice", tool)


def _subs(engine, req, prompts: list[list[int]], max_tokens: list[int],
          plan: toolcalls.ToolPlan | None = None) -> list[_Sub]:
    """The engine requests of one HTTP request: n choices per prompt, each prompt checked once."""
    subs = []
    constraint = _constraint(req, plan)
    for i, (prompt, mt) in enumerate(zip(prompts, max_tokens)):
        for j in range(req.n):
            params = _sampling(req, mt, j, constraint)
            if constraint is not None:  # one Constraint for every choice and prompt: its grammar compiles once
                constraint = (constraint[0], params.constraint)
            if j == 0:
                _check(engine, req, prompt, params, constraint)
            subs.append(_Sub(i * req.n + j, prompt, params))
    return subs


_CONSTRAINT_FIELDS = KINDS + ("constraint",)
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")


def _sampling(req, max_tokens: int, seed_offset: int, constraint: tuple[str, dict[str, Any]] | None = None
              ) -> SamplingParams:
    seed = req.seed
    if seed is not None and seed_offset:
        seed = (seed + seed_offset) % (2**64)  # distinct choices from one seed
    # a field the request leaves out (None) takes SamplingParams' default, as in the library
    given = {name: value for name in _SAMPLING_FIELDS if (value := getattr(req, name)) is not None}
    try:
        return SamplingParams(
            **given, max_tokens=max_tokens, seed=seed, stop=tuple(req.stop_list()), ignore_eos=req.ignore_eos,
            logit_bias=req.logit_bias_ids(), logprobs=req.wanted_logprobs(), prompt_logprobs=_prompt_logprobs(req),
            constraint=None if constraint is None else constraint[1])
    except QuickdraftError as exc:
        if constraint is not None and exc.field in _CONSTRAINT_FIELDS:  # name the body field it came from
            raise APIError(400, str(exc), constraint[0]) from None
        raise _param_error(exc, req) from None


def _prompt_logprobs(req) -> int | None:
    """Prompt logprobs the engine computes: vLLM's prompt_logprobs field, and the echoed prompt's
    (completions with echo and logprobs)."""
    wanted = [n for n in (req.prompt_logprobs, req.wanted_logprobs() if getattr(req, "echo", False) else None)
              if n is not None]
    return max(wanted) if wanted else None


def _param_error(exc: QuickdraftError, req) -> APIError:
    """A library error about a request as a 400 naming its field as the body spells it."""
    return APIError(400, str(exc), _body_field(exc.field, req),
                    code="context_length_exceeded" if isinstance(exc, ContextLengthError) else None)


def _body_field(field: str | None, req) -> str | None:
    """The request body's name for a library field (SamplingParams', Engine.check_request's)."""
    chat = isinstance(req, ChatCompletionRequest)
    if field == "prompt":
        return "messages" if chat else "prompt"
    if field == "max_tokens" and chat and req.max_completion_tokens is not None:
        return "max_completion_tokens"  # the one the limit came from (it wins over max_tokens)
    if field == "prompt_logprobs" and req.prompt_logprobs is None:
        return "echo"  # completions' echo with logprobs asks for the prompt's
    return field


def _check(engine, req, prompt: list[int], params: SamplingParams,
           constraint: tuple[str, dict[str, Any]] | None = None) -> None:
    if len(prompt) >= engine.max_model_len:  # no max_tokens could make it fit: name the prompt
        what = "messages take" if isinstance(req, ChatCompletionRequest) else "prompt takes"
        raise APIError(400, f"the {what} {len(prompt)} tokens, {engine.context_text()} is "
                       "the limit: no room to answer", _body_field("prompt", req),
                       code="context_length_exceeded")
    try:
        engine.check_request(prompt, params, req.num_speculative_tokens)
    except QuickdraftError as exc:
        if constraint is not None and exc.field in _CONSTRAINT_FIELDS:
            raise APIError(400, str(exc), constraint[0]) from None
        raise _param_error(exc, req) from None


# ---- engine outputs -> responses ---------------------------------------------------------

async def _respond(state: ServerState, request: Request, prepared: _Prepared, arrival: float, chat: bool):
    """Submit the choices and answer: an SSE stream, or one JSON body once every choice finished."""
    req, subs, prompts = prepared.req, prepared.subs, prepared.prompts
    shape = _Shape(state.llm.tokenizer, req, prepared, chat)
    capacity = state.require_engine().capacity
    if len(subs) > capacity:  # never fits: a 429 would have the client retry forever
        raise APIError(400, f"this request asks for {len(subs)} sequences; the server holds at most {capacity} "
                       "at once", "n", code="request_too_large")
    try:
        job = _Job(state, subs, req.num_speculative_tokens, arrival)
    except QueueFull as exc:
        raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"}) from None
    except EngineDead as exc:
        raise APIError(503, str(exc), code="engine_dead") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        stream = _stream(state, job, rid, created, len(subs), prompts, chat, include_usage, req.return_token_ids,
                         req.return_token_origins, shape)
        return StreamingResponse(stream, media_type="text/event-stream", background=BackgroundTask(job.close),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        finals = await _watch_disconnect(request, _collect(job))
    except QuickdraftError as exc:
        raise APIError(500, str(exc), code="engine_error") from None
    finally:
        job.close()
    choices = []
    for index in range(len(subs)):
        out = finals[index]
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": out.finish_reason}
        if chat:
            choice["message"], choice["finish_reason"] = toolcalls.message(out.text, out.finish_reason, prepared.tools)
        else:
            choice["text"] = shape.echo_text(index) + out.text
        shape.add(choice, index, out, out.logprobs, first=True)
        if req.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
        if req.return_token_origins:
            _add_origins(choice, out.token_origins, shape.token_texts(index, out.token_ids))
        choices.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.model_name, "choices": choices, "usage": _usage(state, prompts, finals)}


async def _collect(job: _Job) -> dict[int, RequestOutput]:
    """Each choice's final output, by choice index."""
    finals: dict[int, RequestOutput] = {}
    async for index, out in job.events():
        if out.finished:
            finals[index] = out
    return finals


class _Shape:
    """Logprobs, prompt logprobs and echo of each choice in the response's shape (server/logprobs.py)."""

    def __init__(self, tok, req, prepared: _Prepared, chat: bool):
        self.tok, self.chat, self.req = tok, chat, req
        self.n = req.wanted_logprobs()
        self.echo = prepared.echo
        self.subs = prepared.subs
        self.offsets: dict[int, int] = {}  # completions: text offset reached per choice (streaming)
        self.detoks: dict[int, Detokenizer] = {}  # return_token_origins: each token's text, per choice
        self.tools = prepared.tools
        self.tool_streams: dict[int, toolcalls.ToolStream] = {}

    def token_texts(self, index: int, token_ids: list[int]) -> list[str] | None:
        """The text each of these tokens (the choice's next ones) adds, as the engine's detokenizer
        spells it ("" for a token that ends inside a character: the next one carries it); None
        without a tokenizer."""
        if self.tok is None:
            return None
        if index not in self.detoks:
            self.detoks[index] = Detokenizer(self.tok, self.subs[index].prompt)
        detok = self.detoks[index]
        return [detok.add(t) for t in token_ids]

    def tool_deltas(self, index: int, out: RequestOutput) -> tuple[list[dict[str, Any]], str | None]:
        """A chat with tools: the deltas of `out`'s new text (content or tool calls) and the finish_reason."""
        stream = self.tool_streams.setdefault(index, toolcalls.ToolStream(self.tools))
        return stream.feed(out.new_text, out.finished, out.finish_reason)

    def echo_text(self, index: int) -> str:
        return "" if self.echo is None else self.echo[index // self.req.n]

    def add(self, choice: dict[str, Any], index: int, out: RequestOutput, lps, first: bool) -> None:
        """Fill choice["logprobs"] (for `lps`, the new tokens' logprobs) and, with the first chunk
        of a choice, the echoed prompt's logprobs and vLLM's prompt_logprobs."""
        tok, n = self.tok, self.n
        if first and self.req.prompt_logprobs is not None and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = lpfmt.prompt_logprobs(tok, out.prompt_logprobs, self.req.prompt_logprobs)
        if n is None or lps is None:
            return
        if self.chat:
            choice["logprobs"] = lpfmt.chat_logprobs(tok, lps, n)
            return
        body, offset = None, self.offsets.get(index, 0)
        if first and self.echo is not None:
            body, _ = lpfmt.echo_logprobs(tok, self.subs[index].prompt, out.prompt_logprobs, n)
            offset = len(self.echo_text(index))
        generated, self.offsets[index] = lpfmt.completion_logprobs(tok, lps, n, offset)
        choice["logprobs"] = generated if body is None else lpfmt.merge(body, generated)


async def _stream(state: ServerState, job: _Job, rid: str, created: int, n: int, prompts: list[list[int]],
                  chat: bool, include_usage: bool, return_token_ids: bool, return_token_origins: bool,
                  shape: _Shape) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict], **extra) -> str:
        return _sse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                     "choices": choices, **extra})

    finals: dict[int, RequestOutput] = {}
    try:
        if chat:
            for i in range(n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
        started: set[int] = set()
        async for index, out in job.events():
            first = index not in started
            echo = first and shape.echo is not None
            if (not out.new_text and not out.finished and not echo
                    and not ((return_token_ids or return_token_origins or shape.n is not None)
                             and out.new_token_ids)):
                continue
            started.add(index)
            choice: dict[str, Any] = {"index": index, "logprobs": None,
                                      "finish_reason": out.finish_reason if out.finished else None}
            if chat and shape.tools is not None:
                deltas, reason = shape.tool_deltas(index, out)
                for d in deltas[:-1]:
                    yield chunk([{"index": index, "delta": d, "logprobs": None, "finish_reason": None}])
                choice["delta"] = deltas[-1] if deltas else {}
                if out.finished:
                    choice["finish_reason"] = reason
            elif chat:
                choice["delta"] = {"content": out.new_text} if out.new_text else {}
            else:
                choice["text"] = (shape.echo_text(index) if echo else "") + out.new_text
            shape.add(choice, index, out, out.new_logprobs, first)
            if return_token_ids:
                choice["token_ids"] = list(out.new_token_ids)
            if return_token_origins:
                _add_origins(choice, out.new_token_origins, shape.token_texts(index, out.new_token_ids))
            if out.finished:
                finals[index] = out
            yield chunk([choice])
        if include_usage:
            yield chunk([], usage=_usage(state, prompts, finals))
    except QuickdraftError as exc:
        yield _sse(APIError(500, str(exc), code="engine_error").body())
    finally:
        job.close()
    yield "data: [DONE]\n\n"


def _add_origins(choice: dict[str, Any], origins: list[str], texts: list[str] | None) -> None:
    """The token-origin extension (return_token_origins): per token, its origin (engine.ORIGINS)
    and its text."""
    choice["token_origins"] = list(origins)
    if texts is not None:
        choice["token_texts"] = texts


def _usage(state: ServerState, prompts: list[list[int]], outs: dict[int, RequestOutput]) -> dict[str, Any]:
    """OpenAI's token counts, plus `speculation`: this request's own speculative-decoding
    figures, summed over its choices (docs/server.md)."""
    p = sum(len(x) for x in prompts)
    c = sum(len(o.token_ids) for o in outs.values())
    cached = sum(o.num_cached_tokens for o in outs.values())
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached},  # OpenAI's: prompt tokens the prefix cache gave
            "speculation": _speculation(state.llm.engine.config.spec.method, outs)}


def _speculation(method: str, outs: dict[int, RequestOutput]) -> dict[str, Any]:
    """The request's SpecStats (each choice's, merged) under the names its usage shows. Present
    for every method: plain decoding, or a request that drafted nothing, shows zeros."""
    s = SpecStats()
    for out in outs.values():
        s.merge(out.stats)
    return {"method": method, "num_drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens,
            "accepted_tokens": s.num_accepted_tokens, "acceptance_rate": s.acceptance_rate,
            "mean_acceptance_length": s.mean_acceptance_length, "accepted_per_position": list(s.accepted_per_pos),
            "num_steps": s.num_steps, "forced_tokens": s.num_forced_tokens}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _watch_disconnect(request: Request, work: asyncio.Future) -> Any:
    """Await `work`; cancel it if the client goes away first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
