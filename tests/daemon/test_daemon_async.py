"""Asynchronous scheduling through the real daemon (MINDIE_ASYNC_SCHEDULING_ENABLE=1).

Two daemons on the same tiny checkpoint with MTP k=2, one with async scheduling on and
one off, get the same 16 concurrent, staggered requests (greedy and seeded sampling,
stop strings, max_tokens, min_tokens, streamed and not): the outputs must be identical.
A third daemon whose checkpoint has no MTP weights must report k=0 and allow n > 1.
"""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from server.testing.daemon import MODEL_NAME, Daemon, make_config, start_all
from server.testing.tiny_checkpoint import make_tiny_checkpoint

pytestmark = pytest.mark.slow          # starts a real daemon

MTP2 = {"plugin_params": '{"plugin_type":"mtp","num_speculative_tokens":2}'}


@pytest.fixture(scope="module")
def daemons(tiny_weights, tmp_path_factory):
    out = {}
    for on in (False, True):
        cfg = make_config(tmp_path_factory.mktemp(f"cfg-async-{on}"), tiny_weights, model=MTP2)
        env = {"MINDIE_ASYNC_SCHEDULING_ENABLE": "1" if on else "0"}
        out[on] = Daemon(cfg, env=env, log_level="info")
    start_all(*out.values())
    yield out
    for d in out.values():
        assert d.terminate() == 0, d.output()[-3000:]


def bodies() -> list[dict]:
    rng = random.Random(7)
    words = "the fox jumps over a lazy dog while cats sleep in warm sun".split()
    out = []
    for i in range(16):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8 + 3 * i,
                "temperature": 0.0, "stream": i % 2 == 0}
        if i % 4 == 1:
            body.update(temperature=0.8, top_p=0.9, seed=100 + i)
        if i % 5 == 2:
            body.update(min_tokens=5)
        if i % 3 == 0:
            body.update(stop=["e", "a "])
        out.append(body)
    return out


async def _one(client: httpx.AsyncClient, base: str, body: dict, delay: float) -> tuple:
    await asyncio.sleep(delay)
    if not body["stream"]:
        r = await client.post(base + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["text"], c["finish_reason"], r.json()["usage"]["completion_tokens"]
    text, reason = "", None
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch:
                    text += ch[0]["text"]
                    reason = ch[0]["finish_reason"] or reason
    return text, reason, None


async def _all(base: str) -> list[tuple]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*[_one(client, base, b, 0.02 * i)
                                      for i, b in enumerate(bodies())])


def test_outputs_identical_with_async_scheduling_on_and_off(daemons):
    off = asyncio.run(_all(daemons[False].base))
    on = asyncio.run(_all(daemons[True].base))
    assert on == off
    assert any(reason == "stop" for _t, reason, _n in on)
    assert any(reason == "length" for _t, reason, _n in on)
    for d in daemons.values():
        d.wait_kv_free()


def test_status_and_startup_log_report_the_runtime(daemons):
    for on, d in daemons.items():
        st = d.status()
        assert st["async_scheduling_enabled"] is on
        assert st["mtp"] == {"enabled": True, "num_speculative_tokens": 2,
                             "configured_num_speculative_tokens": 2, "adaptive_speculation": True}
        assert f"async scheduling {'on' if on else 'off'}" in d.output()
        assert "MTP on, k=2" in d.output()


def test_abort_mid_stream_with_async_scheduling(daemons):
    d = daemons[True]

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": MODEL_NAME, "prompt": "the fox", "max_tokens": 200,
                    "temperature": 0.0, "stream": True, "ignore_eos": True}
            async with client.stream("POST", d.base + "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 3:
                        break                 # disconnect: the daemon aborts the request
            return await _one(client, d.base, {**bodies()[1], "stream": False}, 0)

    text, reason, _ = asyncio.run(go())
    assert reason in ("stop", "length") and text
    d.wait_kv_free()


@pytest.fixture(scope="module")
def no_mtp_daemon(tmp_path_factory):
    weights = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-nomtp"), seed=0, with_mtp=False)
    d = Daemon(make_config(tmp_path_factory.mktemp("cfg-nomtp-w"), weights, model=MTP2),
               log_level="info").start()
    yield d
    assert d.terminate() == 0, d.output()[-3000:]


def test_checkpoint_without_mtp_weights_reports_k0_and_allows_n(no_mtp_daemon):
    d = no_mtp_daemon
    st = d.status()
    assert st["mtp"]["enabled"] is False and st["mtp"]["num_speculative_tokens"] == 0
    assert st["mtp"]["configured_num_speculative_tokens"] == 2
    assert "MTP off (configured k=2)" in d.output()
    card = httpx.get(d.base + "/v1/models").json()["data"][0]
    assert card["num_speculative_tokens"] == 0
    r = httpx.post(d.base + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "the fox", "max_tokens": 4, "n": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
