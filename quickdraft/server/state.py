"""What the server's routes share (ServerState): the model, loaded on a thread at start-up,
the AsyncEngine over it, and the Prometheus metrics."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import QuickdraftError
from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .protocol import APIError, Limits

log = logging.getLogger("quickdraft.server")


class ServerState:
    """What the routes share: the model once loaded, the engine thread, the metrics."""

    def __init__(self, load: Callable[[], Any], model_name: str, max_queue: int = 256,
                 chat_template: str | None = None, request_timeout: float = 30.0, freeze_gc: bool = False):
        self._load = load  # () -> quickdraft.LLM, run on a thread at start-up
        self.model_name = model_name
        self.max_queue = max_queue
        self.chat_template = chat_template
        self.request_timeout = request_timeout  # seconds a request's body may take to arrive (then 408)
        # the process is the server's (`quickdraft serve`): once loaded, its objects leave the garbage
        # collector's generations (freeze_heap)
        self.freeze_gc = freeze_gc
        self.llm = None
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(self)
        self.on_ready: Callable[[], None] | None = None
        self.on_load_error: Callable[[str], None] | None = None
        self.on_engine_dead: Callable[[BaseException], None] | None = None  # from the engine thread

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        threading.Thread(target=self._load_model, args=(loop,), name="quickdraft-load", daemon=True).start()

    def _load_model(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            llm = self._load()
            if self.chat_template is not None:
                if llm.tokenizer is None:
                    raise QuickdraftError("--chat-template needs a tokenizer; the model folder has none")
                llm.tokenizer.chat_template = self.chat_template
                llm.tokenizer._compiled = None
            if llm.tokenizer is not None:
                llm.tokenizer.release_gil = True  # prompts are tokenized on worker threads
                llm.tokenizer.max_token_chars  # computed once, now
                # the grammar vocabulary (a Python loop over every token's bytes, 1-4 s holding the GIL
                # for a 50k vocabulary) is built now, not at the first constrained request while others stream
                try:
                    llm.engine.grammar_vocabulary()
                except QuickdraftError:  # e.g. no eos token: constrained requests get the error, with a 400
                    pass
            if self.freeze_gc:
                freeze_heap()
            engine = AsyncEngine(llm.engine, self.max_queue, on_step=self.metrics.step_time.observe)
            engine.on_dead = self.on_engine_dead
            engine.start(loop)
        except Exception as exc:  # noqa: BLE001 - reported and turned into an exit by the CLI
            self.load_error = str(exc) if isinstance(exc, QuickdraftError) else f"{type(exc).__name__}: {exc}"
            log.error("loading the model failed: %s", self.load_error)
            if self.on_load_error is not None:
                self.on_load_error(self.load_error)
            return
        self.llm, self.engine = llm, engine
        if self.on_ready is not None:
            self.on_ready()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    def limits(self) -> Limits:
        """The bounds precheck applies (the model is loaded)."""
        ctx = self.llm.engine.max_model_len
        tok = self.llm.tokenizer
        return Limits(max_sequences=self.engine.capacity, context=ctx,
                      max_chars=None if tok is None else ctx * tok.max_token_chars, max_messages=ctx)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.dead is None

    def require_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise APIError(503, self.load_error or "the model is still loading; retry shortly",
                           code="model_loading" if self.load_error is None else "model_load_failed")
        if self.engine.dead is not None:
            raise APIError(503, self.engine.dead, code="engine_dead")
        return self.engine


def freeze_heap() -> None:
    """Collect, then move every object alive now (the model, the tokenizer, the libraries: hundreds
    of thousands) out of the garbage collector's generations (gc.freeze, as vLLM's server does).
    A full collection walks every tracked object holding the GIL, so it would stop the engine
    thread, and every stream, for as long as it takes (benchmarks/gc_pause.py: docs/server.md);
    after this it walks only what the server made since. Objects alive now are never collected as
    cycles later: for the process that serves one model for its life."""
    gc.collect()
    gc.freeze()
