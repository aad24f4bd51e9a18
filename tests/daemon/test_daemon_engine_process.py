"""The daemon's engine in a process of its own (server/engine/front/engine_process.py, the
default) against the engine on a thread of the serving process ($MTP_SERVE_ENGINE_PROCESS=0).

Same answers (greedy and seeded, streamed and not, tools and reasoning) and the same
counters (drafts, accepted drafts, requests, tokens) either way, on the demo model with MTP k=2; /v1/status names the
process that runs the engine; a drain stops it with the daemon; and an engine process
killed mid-stream, or stopped (SIGSTOP: the step watchdog, $MTP_SERVE_STEP_TIMEOUT),
ends the stream with an error, turns /health to 503 (requests meanwhile get 503) and
makes the daemon exit 1 without leaving a process behind; a daemon killed outright takes
the engine process with it.  The serving process never loads torch.
"""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from server.testing.daemon import MODEL_NAME, ROOT, Daemon, demo_model_ready, make_config, process_alive
from tests.daemon.answers import K2, answers, metric

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.demo,
              pytest.mark.skipif(not demo_model_ready(), reason="demo model not present")]
DEMO = ROOT / "models" / "deepseek-v3-tiny-mtp"
# /health's 503 is read at once after the failure: 2 s of it is enough (default 5).
ENV = {"MTP_SERVE_COMPILE": "0", "MTP_SERVE_FATAL_EXIT_DELAY": "2"}


def _counters(d: Daemon) -> tuple[int, int, int, int]:
    """Drafts and accepted drafts (/metrics), requests finished and tokens (/v1/status)."""
    engine = d.status()["engine"]
    return (int(metric(d.metrics, "spec_decode_num_draft_tokens_total")),
            int(metric(d.metrics, "spec_decode_num_accepted_tokens_total")),
            engine["num_requests_finished"], engine["num_generation_tokens"])


def _wait_gone(pid: int, timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not process_alive(pid)


@pytest.fixture
def k2_daemon(tmp_path, request):
    """A demo-model daemon (MTP k=2, engine process) and its engine process's pid
    (``request.param``: more environment)."""
    d = Daemon(make_config(tmp_path, DEMO, model=K2),
               env={**ENV, **getattr(request, "param", {})}).start()
    try:
        yield d, d.status()["runtime"]["engine_pid"]
    finally:
        d.kill()


def test_engine_process_answers_like_the_engine_thread_and_stops_with_a_drain(demo_k2_reference, k2_daemon):
    ref_answers, ref_counters = demo_k2_reference      # the engine on a thread (conftest.py)
    d, pid = k2_daemon
    assert pid != d.proc.pid and process_alive(pid)
    assert answers(d.base) == ref_answers
    if os.path.exists(f"/proc/{pid}/maps"):  # Linux: torch lives in the engine process only
        assert "libtorch" in open(f"/proc/{pid}/maps").read()
        assert "libtorch" not in open(f"/proc/{d.proc.pid}/maps").read(), \
            "the serving process loaded torch (a second more at start and at exit)"
    assert _counters(d) == ref_counters      # the engine's stats come back with each step
    assert d.terminate() == 0
    assert _wait_gone(pid), "the engine process outlived the daemon"


@pytest.mark.parametrize("k2_daemon,how", [({}, "kill"), ({"MTP_SERVE_STEP_TIMEOUT": "2"}, "stop")],
                         indirect=["k2_daemon"])
def test_a_killed_or_stopped_engine_process_fails_the_stream_and_the_daemon(k2_daemon, how):
    """Killed: seen at once (its pipe closes).  Stopped (issue 58): before, the stream
    waited tokenTimeout with /health 200; now the watchdog takes it for hung after the
    step bound (2 s here), kills it and fails as for a dead rank.  A request arriving
    before the daemon exits gets 503, as /health says (before: 500)."""
    d, pid = k2_daemon
    client = openai.OpenAI(base_url=d.base + "/v1", api_key="none", timeout=60, max_retries=0)
    stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", stream=True,
                                       max_tokens=400, temperature=0,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        for _chunk in stream:
            pass
    assert time.monotonic() - t0 < (30 if how == "kill" else 10)
    assert "engine process" in str(err.value)
    assert httpx.get(d.base + "/health", timeout=5).status_code == 503
    st = d.status()
    assert st["status"] == "unhealthy"
    assert ("engine process exited" if how == "kill" else "hung or stopped") in st["error"]
    r = httpx.post(d.base + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi",
                                                     "max_tokens": 4}, timeout=10)
    assert r.status_code == 503 and "engine process" in r.json()["error"]["message"]
    assert d.proc.wait(30) == 1
    assert "worker group failed" in d.output()
    assert _wait_gone(pid), "the engine process outlived the daemon"


def test_the_engine_process_does_not_outlive_a_killed_daemon(k2_daemon):
    d, pid = k2_daemon
    assert pid != d.proc.pid and process_alive(pid)
    d.proc.send_signal(signal.SIGKILL)         # no drain, no goodbye: only the pipe closes
    d.proc.wait(10)
    assert _wait_gone(pid), "the engine process outlived a killed daemon"
