"""Limits on the real daemon: tokenTimeout, e2eTimeout, maxLinkNum and the /stopService drain.

One daemon with maxBatchSize 1 (a second request waits while the first decodes),
tokenTimeout 1 s, e2eTimeout 3 s and maxLinkNum 2.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server.testing.daemon import MODEL_NAME, Daemon, make_config

pytestmark = pytest.mark.slow          # starts a real daemon

# Long enough to outlive e2eTimeout on any machine: the tiny model with MTP reached
# ~700 tokens/s here, which finished a 1,000-token request inside the 3 s.
LONG = {"model": MODEL_NAME, "prompt": "count to a thousand", "max_tokens": 8000,
        "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def daemon(tiny_weights, tmp_path_factory):
    cfg = make_config(tmp_path_factory.mktemp("cfg"), tiny_weights,
                      server={"tokenTimeout": 1, "e2eTimeout": 3, "maxLinkNum": 2},
                      deploy={"maxSeqLen": 8100, "maxInputTokenLen": 64},
                      schedule={"maxBatchSize": 1, "maxPrefillBatchSize": 1,
                                "maxIterTimes": 8050})
    d = Daemon(cfg).start()
    yield d
    d.terminate()


def read_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_token_and_e2e_timeouts_abort_and_free_kv(daemon):
    result: dict = {}

    def long_stream():
        with httpx.stream("POST", daemon.base + "/v1/completions",
                          json={**LONG, "stream": True}, timeout=30) as r:
            result["status"] = r.status_code
            result["events"] = read_events(r)
        result["elapsed"] = time.monotonic() - t0

    t0 = time.monotonic()
    th = threading.Thread(target=long_stream)
    th.start()
    time.sleep(0.5)                      # the long request holds the only batch slot
    queued = httpx.post(daemon.base + "/v1/completions",
                        json={**LONG, "max_tokens": 5}, timeout=30)
    assert queued.status_code == 504, queued.text
    err = queued.json()["error"]
    assert "tokenTimeout" in err["message"] and queued.headers["x-should-retry"] == "false"
    th.join(30)
    # The stream outlived e2eTimeout: an error event, then [DONE].
    events = result["events"]
    assert result["status"] == 200 and events[-1] == "[DONE]"
    assert "e2eTimeout" in events[-2]["error"]["message"]
    assert 2.5 < result["elapsed"] < 10
    st = daemon.wait_kv_free(timeout_s=5)
    assert st["engine"]["num_requests_aborted"] >= 2


def test_over_capacity_gets_503_with_retry_after(daemon):
    streams = [httpx.stream("POST", daemon.base + "/v1/completions", json={**LONG, "stream": True},
                            timeout=30) for _ in range(2)]
    opened = [s.__enter__() for s in streams]
    try:
        assert all(r.status_code == 200 for r in opened)
        r = httpx.post(daemon.base + "/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == 503 and "maxLinkNum" in r.json()["error"]["message"]
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    daemon.wait_kv_free(timeout_s=5)


def test_stop_service_drains_in_flight_then_exits(daemon):
    result: dict = {}

    def in_flight():
        result["r"] = httpx.post(daemon.base + "/v1/completions",
                                 json={**LONG, "max_tokens": 40}, timeout=30)

    th = threading.Thread(target=in_flight)
    th.start()
    time.sleep(0.3)
    stop = httpx.post(daemon.mgmt + "/stopService", timeout=10)
    assert stop.status_code == 200
    try:
        late = httpx.post(daemon.base + "/v1/completions", json={**LONG, "max_tokens": 2},
                          timeout=10)
        assert late.status_code == 503
    except httpx.TransportError:
        pass                              # already closed: also a refusal
    th.join(30)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["usage"]["completion_tokens"] == 40
    assert daemon.proc.wait(30) == 0
