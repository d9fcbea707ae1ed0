"""The engine on its own thread, fed by asyncio request handlers.

One thread owns the Engine (nothing else touches it). Handlers send it commands
(AddRequest, AbortRequest, Stop) through a thread-safe queue; between steps it applies them
all, so a waiting request joins the running batch at the next step and an aborted one leaves
it and frees its cache slot at once. Outputs go back to each request's asyncio queue through
the event loop's call_soon_threadsafe. The thread sleeps on the command queue when idle.

A failing step only fails the requests it was working on: a failed prefill of several
requests puts them back to be prefilled one at a time, so only the one that fails alone is
answered with an error; a failed decode step fails the running batch (which row broke it
cannot be told apart, and their state is no longer trustworthy); the engine then goes on
with the next requests. An error escaping the loop itself marks the engine dead (/health
answers 503).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass

from ..engine import Engine, RequestOutput
from ..errors import EngineFailure, QuickdraftError
from ..sampling import SamplingParams

log = logging.getLogger("quickdraft.server")


@dataclass
class EngineError:
    """Delivered instead of an output when the engine could not finish a request."""
    request_id: str
    message: str


class QueueFull(Exception):
    pass


class EngineDead(Exception):
    pass


# ---- commands: the event loop -> the engine thread ---------------------------------------

@dataclass(frozen=True)
class AddRequest:
    """Admit a request to the engine; its outputs (or an EngineError) go to `out`."""
    request_id: str
    prompt: list[int]
    params: SamplingParams
    num_speculative_tokens: int | None
    out: asyncio.Queue


@dataclass(frozen=True)
class AbortRequest:
    """Drop a request the handler no longer waits for (a no-op once it finished)."""
    request_id: str


@dataclass(frozen=True)
class Stop:
    """End the engine thread."""


Command = AddRequest | AbortRequest | Stop


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue: int, on_step=None):
        self.engine = engine
        self.on_step = on_step  # called with each step's seconds (on the engine thread; the metrics)
        self.max_queue = max_queue
        self.capacity = engine.config.max_num_seqs + max_queue  # requests held at once
        self.pending = 0  # requests submitted and not yet finished (touched by the event loop only)
        self.dead: str | None = None
        # held by submit() from its check of `dead` to its enqueue, and by _die() from setting
        # `dead` to draining the queue: every request is either refused or drained and answered
        self._death = threading.Lock()
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="quickdraft-engine", daemon=True)
        # the engine thread's own: request id -> the queue its outputs go to
        self._queues: dict[str, asyncio.Queue] = {}
        self.on_dead = None  # called with the exception once the engine died (the CLI exits on EngineFailure)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(Stop())
        self._thread.join(timeout=10)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return max(0, self.pending - self.engine.num_running)

    # ---- the event loop's side ------------------------------------------------------

    def check_room(self, n: int) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)
        if self.pending + n > self.capacity:
            raise QueueFull(f"the server is full ({self.pending} requests held, room for {self.capacity}); "
                            "retry shortly")

    def submit(self, prompt: list[int], params: SamplingParams, out: asyncio.Queue,
               num_speculative_tokens: int | None = None) -> str:
        """Queue one request (already checked with engine.check_request); returns its id.
        Its outputs (RequestOutput, or an EngineError on failure) arrive on `out`."""
        with self._death:
            if self.dead is not None:
                raise EngineDead(self.dead)
            rid = f"r{next(self._ids)}"
            self._commands.put(AddRequest(rid, prompt, params, num_speculative_tokens, out))
            self.pending += 1
        return rid

    def release(self, rid: str, finished: bool) -> None:
        """The handler is done with a request: abort it unless it finished."""
        self.pending -= 1
        if not finished:
            self._commands.put(AbortRequest(rid))

    # ---- the engine thread ----------------------------------------------------------

    def _deliver(self, q: asyncio.Queue, item: RequestOutput | EngineError) -> None:
        self._loop.call_soon_threadsafe(q.put_nowait, item)

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished()
                if idle:  # at rest the server holds no request rows (the next request allocates its own; the
                    # prefix cache's blocks stay, within the budget, and give way when requests need it)
                    engine.release_caches()
                if not self._apply_commands(block=idle):
                    return
                if not engine.has_unfinished():
                    continue
                try:
                    started = time.perf_counter()
                    outputs = engine.step()
                    if self.on_step is not None:
                        self.on_step(time.perf_counter() - started)
                except EngineFailure:  # nothing more can be served (a tensor-parallel rank is gone)
                    raise
                except Exception as exc:  # fail only the requests this step worked on
                    self._fail_step(exc)
                    continue
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is None:
                        continue
                    if out.finished:
                        del self._queues[out.request_id]
                    self._deliver(q, out)
        except BaseException as exc:  # the loop itself broke: nothing more will be served
            self._die(exc)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command, first waiting for one if `block`; False on Stop."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=None)
            except queue.Empty:
                return True
            block = False
            match cmd:
                case Stop():
                    return False
                case AddRequest():
                    try:
                        self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id,
                                                num_speculative_tokens=cmd.num_speculative_tokens)
                        self._queues[cmd.request_id] = cmd.out
                    except QuickdraftError as exc:
                        self._deliver(cmd.out, EngineError(cmd.request_id, str(exc)))
                case AbortRequest():
                    if self._queues.pop(cmd.request_id, None) is not None:
                        self.engine.abort_request(cmd.request_id)

    def _fail_step(self, exc: Exception) -> None:
        """A step raised: retry a failed prefill of several requests one by one (to find the
        culprit), else answer the requests it worked on with an EngineError."""
        log.error("engine step failed:\n%s", traceback.format_exc())
        engine = self.engine
        requests, prefill = engine.recover_failed_step()
        if prefill and len(requests) > 1:
            engine.retry_singly(requests)
            return
        message = f"the engine failed on this request: {type(exc).__name__}: {exc}"
        for r in requests:
            if not prefill:
                engine.abort_request(r.id)
            q = self._queues.pop(r.id, None)
            if q is not None:
                self._deliver(q, EngineError(r.id, message))

    def _die(self, exc: BaseException) -> None:
        """Mark the engine dead and answer every request it holds or was sent with the reason."""
        reason = f"the engine stopped: {type(exc).__name__}: {exc}"
        log.critical("%s\n%s", reason, traceback.format_exc())
        for rid, q in self._queues.items():
            self._deliver(q, EngineError(rid, reason))
        with self._death:  # no submit() between setting `dead` and draining: none is left unanswered
            self.dead = reason
            while True:  # requests queued while it broke
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, AddRequest):
                    self._deliver(cmd.out, EngineError(cmd.request_id, reason))
        if self.on_dead is not None:
            self.on_dead(exc)


def now() -> float:
    return time.perf_counter()
