"""Faults on every parallel layout, not only tp=2 (test_parallel.py): a rank killed, or
stopped (hung), while the group serves.  The step in flight fails with the group's error
naming the rank (shared-memory collectives see a dead process within milliseconds; a
hung one after the collective timeout), the engine's fatal error is set, every later
step fails at once, and shutdown leaves no rank behind."""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from server.engine.config import ParallelConfig
from server.engine.core import LLMEngine
from server.model.loading import inspect_checkpoint
from tests.engine.helpers import free_port
from tests.engine.test_parallel import BASE, DEMO, _requests

pytestmark = [pytest.mark.slow, pytest.mark.demo]

# name: ParallelConfig fields (MindIE's rules: tp x cp x dp == worldSize, sp == tp, ...)
LAYOUTS = {
    "sp2": dict(world_size=2, moe_tp=2, moe_ep=1, sp=2),
    "dp2": dict(world_size=2, dp=2, moe_tp=1, moe_ep=2),
    "dp2-tp2": dict(world_size=4, dp=2, moe_tp=1, moe_ep=4),
    "cp2": dict(world_size=4, moe_tp=1, moe_ep=4, sp=2, cp=2),
}


@pytest.mark.parametrize("layout,how", [("sp2", "kill"), ("dp2", "kill"), ("dp2-tp2", "kill"),
                                        ("cp2", "kill"), ("cp2", "stop")])
def test_a_dead_or_hung_rank_fails_the_group_naming_it(layout, how):
    par = ParallelConfig(master_port=free_port(), timeout_s=3.0, **LAYOUTS[layout])
    engine = LLMEngine(inspect_checkpoint(str(DEMO)),
                       dataclasses.replace(BASE, num_speculative_tokens=1, parallel=par),
                       eos_token_ids=set())
    victim = par.world_size - 1
    pid = engine.executor.worker_pids[victim]
    try:
        for r in _requests(2048)[:2]:
            engine.add_request(r)
        engine.step()
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            for _ in range(200):
                engine.step()
        seconds = time.monotonic() - t0
        # Named by the collective that waited for it: at once for a killed rank, after
        # the collective timeout for a stopped one.
        message = str(err.value)
        if how == "kill":
            assert f"rank {victim} (pid {pid}) exited" in message and seconds < 5, (seconds, message)
        else:
            assert f"rank(s) {victim} did not reach the collective within 3 s" in message, message
            assert seconds < 15, seconds
        assert engine.fatal_error is not None
        with pytest.raises(RuntimeError):                  # later steps fail at once
            engine.add_request(_requests(2048)[3])
            engine.step()
    finally:
        if how == "stop":
            os.kill(pid, signal.SIGKILL)
        engine.shutdown()
    assert not any(p.is_alive() for p in engine.executor._procs), "a rank outlived shutdown"
