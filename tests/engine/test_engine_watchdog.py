"""The engine process's watchdog (engine/front/engine_process.py): an engine process that stops
(SIGSTOP) or hangs inside a step while it holds requests is taken for hung after the step
bound, killed, and fails as a dead rank does: its streams end with the error, the fatal
error is set (the daemon's /health answers 503) and the daemon is told (it exits 1).
Before, requests waited tokenTimeout while /health said 200.

A stand-in child plays the engine process here (the real one's pipes and messages, a
step message every 20 ms while it holds a request), so the test needs no model."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

from server.engine.front.engine_process import EngineProcess
from server.engine.protocol import EngineRequest, FinishReason, SamplingParams
from server.engine.runtime import RuntimeInfo
from server.engine.stats import EngineStats

BOUND_S = 0.5


def _stand_in(requests, results) -> None:
    """Steps every 20 ms while it holds a request (never finishing it), as an engine does."""
    held = set()
    while True:
        if requests.poll(0.02):
            try:
                msg = requests.recv()
            except EOFError:
                return
            if msg[0] == "stop":
                results.send(("closed",))
                return
            if msg[0] == "add":
                held.add(msg[1].request_id)
        if held:
            results.send(("out", [], EngineStats(), None))


def test_a_stopped_engine_process_is_taken_for_hung_and_fails_as_a_dead_rank():
    ctx = mp.get_context("fork")
    requests_rx, requests = ctx.Pipe(duplex=False)
    results, results_tx = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_stand_in, args=(requests_rx, results_tx), daemon=True)
    proc.start()
    requests_rx.close()
    results_tx.close()
    engine = EngineProcess(None, proc, requests, results, RuntimeInfo(1, 1, False, False, 64, 16,
                                                                      frozenset(), 512),
                           EngineStats(), step_timeout_s=BOUND_S)
    told: list[str] = []
    engine.on_fatal = told.append

    async def go():
        await engine.start()
        await asyncio.sleep(BOUND_S * 1.5)     # idle past the bound: owes nothing
        stream = engine.submit(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=4)))
        first = asyncio.create_task(anext(stream))
        await asyncio.sleep(BOUND_S * 2)       # busy, a step every 20 ms: no false alarm
        assert engine.fatal_error is None and not first.done()
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        out = await asyncio.wait_for(first, 10)
        seconds = time.monotonic() - t0
        await stream.aclose()
        return out, seconds

    try:
        out, seconds = asyncio.run(go())
        assert out.finished and out.finish_reason is FinishReason.ERROR
        assert "hung or stopped" in out.error and f"pid {proc.pid}" in out.error
        # The watchdog counts the silence from the last step message, which can have come
        # up to one 20 ms step before the SIGSTOP (a clean-clone run saw 0.4996 s).
        assert BOUND_S - 0.05 <= seconds < BOUND_S + 2, seconds
        assert engine.fatal_error == out.error and told == [out.error]
        # The engine's reader thread may reap the killed child first (its own join): then
        # this thread's join returns before that thread has recorded the exit code.
        deadline = time.monotonic() + 5
        while proc.exitcode is None and time.monotonic() < deadline:
            proc.join(0.1)
        assert proc.exitcode == -signal.SIGKILL      # killed: nothing of it is left
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
