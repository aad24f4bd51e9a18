"""``n`` > 1 choices: refused under MTP, fanned out to n engine requests without it.

The daemon tests drive the real server (MTP off, prefix cache on) with the openai SDK
and raw httpx; a random tiny checkpoint says nothing meaningful, so they check counts,
indices, seeds, framing and that aborted siblings free their KV blocks.  The scripted
engine pins seeds, request ids and admission slots (tests/api/test_fanout.py).
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.testing.daemon import MODEL_NAME, Daemon, make_config

MSG = [{"role": "user", "content": "Tell me a story about a fox."}]
NO_MTP = {"plugin_params": '{"plugin_type":"prefix_cache"}'}


@pytest.fixture(scope="module")
def daemon(tiny_weights, tmp_path_factory):
    d = Daemon(make_config(tmp_path_factory.mktemp("cfg-nomtp"), tiny_weights,
                           model=NO_MTP)).start()
    assert not d.status()["mtp"]["enabled"]
    yield d
    assert d.terminate() == 0, d.output()[-3000:]


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="x", max_retries=0)


def sse(raw: str) -> list:
    """Parse an SSE body strictly: every block is ``data: ...``."""
    events = []
    for block in raw.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.slow                       # real daemon
def test_chat_n3_non_streaming_usage_sums(client):
    one = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=8,
                                         temperature=1.0, seed=11, logprobs=True)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=8,
                                       temperature=1.0, seed=11, n=3, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    lengths = [len(c.logprobs.content) for c in r.choices]
    assert all(1 <= k <= 8 for k in lengths)
    for c in r.choices:
        assert c.finish_reason in ("stop", "length") and c.message.role == "assistant"
    assert r.usage.completion_tokens == sum(lengths)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens        # counted once, not 3 times
    assert r.usage.total_tokens == r.usage.prompt_tokens + sum(lengths)
    # Choice 0 samples with the request's own seed: it is the n=1 answer.
    assert r.choices[0].message.content == one.choices[0].message.content


@pytest.mark.slow                       # real daemon
def test_seeded_n2_is_reproducible_and_choices_differ(client):
    kw = dict(model=MODEL_NAME, messages=MSG, max_tokens=12, temperature=1.0, seed=1234, n=2,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts_a = [c.message.content for c in a.choices]
    assert texts_a == [c.message.content for c in b.choices]
    assert texts_a[0] != texts_a[1]
    assert a.usage.completion_tokens == 24
    # Choice 1 is seed + 1 (documented): the n=1 answer for seed 1235.
    other = client.chat.completions.create(**{**kw, "n": 1, "seed": 1235})
    assert other.choices[0].message.content == texts_a[1]


@pytest.mark.slow                       # real daemon
def test_greedy_choices_are_identical(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=6, n=2,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == r.choices[1].message.content


@pytest.mark.slow                       # real daemon
def test_chat_streaming_n2_raw(daemon):
    body = {"model": MODEL_NAME, "messages": MSG, "max_tokens": 6, "n": 2, "stream": True,
            "temperature": 1.0, "seed": 5, "logprobs": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", daemon.base + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse(r.read().decode())
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("error" not in c for c in chunks), chunks
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    tokens = {0: 0, 1: 0}
    first: dict = {}
    finishes: dict = {}
    for c in chunks[:-1]:
        assert len(c["choices"]) == 1 and "usage" not in c
        ch = c["choices"][0]
        i = ch["index"]
        first.setdefault(i, ch["delta"])
        assert i not in finishes, "a chunk after its choice finished"
        tokens[i] += len((ch.get("logprobs") or {}).get("content") or [])
        if ch["finish_reason"] is not None:
            finishes[i] = ch["finish_reason"]
    assert set(first) == {0, 1}
    assert all(d == {"role": "assistant", "content": ""} for d in first.values())
    assert finishes == {0: "length", 1: "length"}
    assert tokens == {0: 6, 1: 6}
    u = usage_chunk["usage"]
    assert u["completion_tokens"] == 12 and u["total_tokens"] == u["prompt_tokens"] + 12


@pytest.mark.slow                       # real daemon
def test_chat_streaming_n2_sdk(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=5, n=2,
                                            temperature=1.0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    seen = {c.choices[0].index for c in chunks if c.choices}
    done = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert seen == done == {0, 1}
    assert chunks[-1].usage.completion_tokens == 10


@pytest.mark.slow                       # real daemon
def test_completions_n2_with_prompt_list(client):
    prompts = ["one two", "three"]
    kw = dict(model=MODEL_NAME, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    single = [client.completions.create(prompt=p, **kw) for p in prompts]
    r = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # index = prompt_index * n + i: greedy choices of a prompt equal its n=1 answer.
    texts = [c.text for c in r.choices]
    assert texts == [single[0].choices[0].text] * 2 + [single[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    assert r.usage.completion_tokens == 16


@pytest.mark.slow                       # real daemon
def test_completions_n2_streaming(daemon):
    body = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 5, "n": 2, "stream": True,
            "temperature": 1.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", daemon.base + "/v1/completions", json=body, timeout=60) as r:
        events = sse(r.read().decode())
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                for c in events[:-2] if c["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 10


@pytest.mark.slow                       # real daemon
@pytest.mark.parametrize("n", [65, 128])
def test_n_above_maximum_is_refused(daemon, n):
    # maxN defaults to 128, clamped to the test daemon's maxBatchSize 64
    r = httpx.post(daemon.base + "/v1/chat/completions", timeout=30, json={
        "model": MODEL_NAME, "messages": MSG, "max_tokens": 2, "n": n})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and err["code"] == 400 and "at most 64" in err["message"]
    assert daemon.status()["in_flight"] == 0


@pytest.mark.slow                       # real daemon
def test_best_of_and_beam_search_stay_refused(daemon):
    for extra, param in (({"best_of": 2}, "best_of"), ({"use_beam_search": True},
                                                        "use_beam_search")):
        r = httpx.post(daemon.base + "/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


@pytest.mark.slow                       # real daemon
def test_disconnect_during_n3_stream_aborts_all_and_frees_kv(daemon):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "count " * 40}],
            "max_tokens": 400, "n": 3, "stream": True, "ignore_eos": True, "temperature": 1.0}
    before = daemon.status()["engine"]["num_requests_aborted"]
    with httpx.stream("POST", daemon.base + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            assert next(lines).startswith("data: ")
            next(lines)
        busy = daemon.status()
        assert busy["in_flight"] == 3, busy               # one admission slot per choice
        assert busy["kv_cache"]["usage"] > 0, busy
    st = daemon.wait_kv_free(timeout_s=5)
    assert st["in_flight"] == 0
    assert st["engine"]["num_requests_aborted"] - before == 3, st["engine"]


# --- MTP on: the refusal is unchanged ------------------------------------------------------

@pytest.mark.slow                       # real daemon
def test_mtp_daemon_refuses_n2(plain_daemon):
    d = plain_daemon                    # tests/daemon/conftest.py: MTP on, drained at the end
    assert d.status()["mtp"]["enabled"]
    for path, body in (("/v1/chat/completions", {"messages": MSG}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(d.base + path, timeout=30,
                       json={"model": MODEL_NAME, "max_tokens": 2, "n": 2, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == "n" and err["type"] == "invalid_request_error"
        assert "mtp" in err["message"] and "n=2" in err["message"]
    assert d.status()["in_flight"] == 0
