"""The engine on its own thread, fed by asyncio request handlers.

One thread owns the Engine (nothing else touches it). Handlers send it commands through
a thread-safe queue (add a request, abort one); between steps it applies them all, so a
waiting request joins the running batch at the next step and an aborted one leaves it and
frees its cache slot at once. Outputs go back to each request's asyncio queue through the
event loop's call_soon_threadsafe. The thread sleeps on the command queue when idle.

A failing step only fails the requests it was working on: a failed prefill of several
requests puts them back to be prefilled one at a time, so only the one that fails alone is
answered with an error; a failed decode step fails the running batch (which row broke it
cannot be told apart, and their state is no longer trustworthy); the engine then goes on
with the next requests. An error escaping the
loop itself marks the engine dead (/health answers 503).
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

from ..errors import QuickdraftError
from ..engine import Engine
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


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue: int):
        self.engine = engine
        self.max_queue = max_queue
        self.capacity = engine.config.max_num_seqs + max_queue  # requests held at once
        self.pending = 0  # requests submitted and not yet finished (touched by the event loop only)
        self.dead: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="quickdraft-engine", daemon=True)
        self._stopping = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(("stop",))
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
        if self.dead is not None:
            raise EngineDead(self.dead)
        rid = f"r{next(self._ids)}"
        self.pending += 1
        self._commands.put(("add", rid, prompt, params, num_speculative_tokens, out))
        return rid

    def release(self, rid: str, finished: bool) -> None:
        """The handler is done with a request: abort it unless it finished."""
        self.pending -= 1
        if not finished:
            self._commands.put(("abort", rid))

    # ---- the engine thread ----------------------------------------------------------

    def _deliver(self, q: asyncio.Queue, item) -> None:
        self._loop.call_soon_threadsafe(q.put_nowait, item)

    def _run(self) -> None:
        queues: dict[str, asyncio.Queue] = {}
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished()
                while True:
                    try:
                        cmd = self._commands.get(block=block, timeout=None)
                    except queue.Empty:
                        break
                    block = False
                    if cmd[0] == "stop":
                        return
                    if cmd[0] == "add":
                        _, rid, prompt, params, k, q = cmd
                        try:
                            engine.add_request(prompt, params, request_id=rid, num_speculative_tokens=k)
                            queues[rid] = q
                        except QuickdraftError as exc:
                            self._deliver(q, EngineError(rid, str(exc)))
                    elif cmd[0] == "abort":
                        rid = cmd[1]
                        if queues.pop(rid, None) is not None:
                            engine.abort_request(rid)
                if not engine.has_unfinished():
                    continue
                try:
                    outputs = engine.step()
                except Exception as exc:  # fail only the requests this step worked on
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    requests, prefill = engine.recover_failed_step()
                    if prefill and len(requests) > 1:  # retry them one by one to find the culprit
                        engine.retry_singly(requests)
                        continue
                    message = f"the engine failed on this request: {type(exc).__name__}: {exc}"
                    for r in requests:
                        if not prefill:
                            engine.abort_request(r.id)
                        q = queues.pop(r.id, None)
                        if q is not None:
                            self._deliver(q, EngineError(r.id, message))
                    continue
                for out in outputs:
                    q = queues.get(out.request_id)
                    if q is None:
                        continue
                    if out.finished:
                        del queues[out.request_id]
                    self._deliver(q, out)
        except BaseException as exc:  # the loop itself broke: nothing more will be served
            self.dead = f"the engine stopped: {type(exc).__name__}: {exc}"
            log.critical("%s\n%s", self.dead, traceback.format_exc())
            for rid, q in queues.items():
                self._deliver(q, EngineError(rid, self.dead))
            while True:  # requests queued while it broke
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    self._deliver(cmd[5], EngineError(cmd[1], self.dead))


def now() -> float:
    return time.perf_counter()
