"""AsyncEngine: a request submitted while the engine thread dies is answered, never lost.

submit() checks `dead`, then enqueues; the dying thread sets `dead`, then drains the queue. The
window between the check and the enqueue is widened here (each enqueue sleeps first), and
requests are submitted back to back while the engine dies: every one must be refused
(EngineDead) or answered (an EngineError), and `pending` must return to 0."""

from __future__ import annotations

import asyncio
import logging
import queue
import time

from quickdraft import LLM, SamplingParams
from quickdraft.server.async_engine import AsyncEngine, EngineDead, EngineError


class SlowPuts:
    """The command queue, each put delayed: the window a preempted submit() would open."""

    def __init__(self, delay_s: float):
        self.q, self.delay_s = queue.SimpleQueue(), delay_s

    def put(self, item, *args, **kwargs):
        time.sleep(self.delay_s)
        self.q.put(item)

    def get(self, *args, **kwargs):
        return self.q.get(*args, **kwargs)

    def get_nowait(self):
        return self.q.get_nowait()


def one_round(engine, delay_s: float, die_after_s: float) -> int:
    """Submit until refused while the engine dies; returns how many were answered."""

    def die():
        time.sleep(die_after_s)
        raise SystemExit("injected engine death")

    engine.step = die

    async def main() -> int:
        eng = AsyncEngine(engine, max_queue=100_000)
        eng._commands = SlowPuts(delay_s)
        eng.start(asyncio.get_running_loop())
        held = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            out: asyncio.Queue = asyncio.Queue()
            try:
                rid = eng.submit([0, 5], SamplingParams(max_tokens=2), out)
            except EngineDead:
                break
            held.append((rid, out))
            await asyncio.sleep(0)
        else:
            raise AssertionError("the engine never died")
        for rid, out in held:
            item = await asyncio.wait_for(out.get(), 5)  # an unanswered request times out here
            assert isinstance(item, EngineError) and "injected engine death" in item.message
            eng.release(rid, finished=False)
        assert eng.pending == 0
        eng._thread.join(5)
        return len(held)

    return asyncio.run(main())


def test_requests_submitted_while_the_engine_dies_are_all_answered(target_dir):
    rounds = 100  # (about 2 s)
    engine = LLM(target_dir, method="none").engine
    logging.getLogger("quickdraft.server").disabled = True  # (each death logs its traceback)
    try:
        answered = sum(one_round(engine, delay_s=0.001 * (1 + i % 3), die_after_s=0.0005 * (i % 5))
                       for i in range(rounds))
    finally:
        logging.getLogger("quickdraft.server").disabled = False
    assert answered >= rounds
