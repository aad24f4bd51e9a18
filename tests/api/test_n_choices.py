"""``n`` > 1 choices: refused under MTP, fanned out to n engine requests without it.

The daemon tests drive the real server (MTP off, prefix cache on) with the openai SDK
and raw httpx; a random tiny checkpoint says nothing meaningful, so they check counts,
indices, seeds, framing and that aborted siblings free their KV blocks.  The unit tests
at the end use the scripted engine to pin seeds, request ids and admission slots.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from server.api.app import build_app
from server.api.limits import Admission
from server.api.serving.fanout import choice_seed
from server.api.settings import ApiSettings
from server.api.state import ServerState
from server.engine.protocol import EngineOutput, FinishReason, RequestCounters
from server.metrics import ServingMetrics
from server.testing.tiny_tokenizer import write_tiny_tokenizer
from server.text.tokenizer import Tokenizer
from tests.api.daemon_proc import MODEL_NAME, Daemon, make_config
from tests.api.fake_engine import FakeEngine

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
def test_mtp_daemon_refuses_n2(tiny_weights, tmp_path_factory):
    d = Daemon(make_config(tmp_path_factory.mktemp("cfg-mtp"), tiny_weights)).start()
    try:
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
    finally:
        assert d.terminate() == 0


# --- unit: seeds, ids and admission slots on the scripted engine ---------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok-n")
    write_tiny_tokenizer(d, 512)
    return Tokenizer.from_dir(d)


def fake_client(tokenizer, script: str = "one two three four", **over):
    base = dict(model_name="tiny", model_path="/x", max_seq_len=2048, max_input_len=1800,
                vocab_size=512, truncation=0, max_iter_times=64, max_link_num=4,
                token_timeout_s=5, e2e_timeout_s=10, max_request_bytes=4096, full_text=False,
                num_speculative_tokens=0, enable_reasoning=False,
                tool_call_parser="deepseek_v3", raw={})
    base.update(over)
    s = ApiSettings(**base)
    engine = FakeEngine(tokenizer, script, num_speculative_tokens=s.num_speculative_tokens)
    state = ServerState(settings=s, tokenizer=tokenizer, engine=engine,
                        metrics=ServingMetrics("tiny", 1), admission=Admission(s.max_link_num))
    app = build_app(state, {"business", "management", "metrics"})
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return client, engine, state


def test_n_is_capped_by_the_configs_max_n(tokenizer):
    async def go():
        client, _, _ = fake_client(tokenizer, max_link_num=8, max_n=3)
        return (await client.post("/v1/completions", json={"prompt": "a", "n": 3, "max_tokens": 2}),
                await client.post("/v1/completions", json={"prompt": "a", "n": 4, "max_tokens": 2}))
    ok, over = asyncio.run(go())
    assert ok.status_code == 200, ok.text
    err = over.json()["error"]
    assert over.status_code == 400 and err["param"] == "n" and "at most 3" in err["message"]


def test_choice_seed_derivation():
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(None, 2) is None
    assert choice_seed(2 ** 63 - 1, 1) == -2 ** 63             # wraps, stays a valid int64
    assert choice_seed(-1, 1) == 0


def test_fanout_requests_seeds_and_ids(tokenizer):
    async def go():
        client, engine, state = fake_client(tokenizer)
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "n": 3, "seed": 7})
        comp = await client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2})
        return chat, comp, engine, state
    chat, comp, engine, state = asyncio.run(go())
    assert chat.status_code == 200 and comp.status_code == 200
    chat_reqs, comp_reqs = engine.requests[:3], engine.requests[3:]
    assert [r.sampling.seed for r in chat_reqs] == [7, 8, 9]
    cid = chat.json()["id"]
    assert [r.request_id for r in chat_reqs] == [f"{cid}-{i}" for i in range(3)]
    assert [r.sampling.seed for r in comp_reqs] == [None] * 4
    pa, pb = comp_reqs[0].prompt_token_ids, comp_reqs[2].prompt_token_ids
    assert [r.prompt_token_ids for r in comp_reqs] == [pa, pa, pb, pb] and pa != pb
    body = chat.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    per_choice = len(tokenizer.encode("one two three four")[:chat_reqs[0].sampling.max_tokens])
    assert body["usage"]["completion_tokens"] == 3 * per_choice > 0
    assert comp.json()["usage"]["completion_tokens"] == 4 * min(per_choice, 16)
    assert state.admission.in_flight == 0


def test_n_needs_free_slots(tokenizer):
    async def go():
        client, engine, state = fake_client(tokenizer, max_link_num=4)
        over = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "n": 5})
        state.admission.acquire(3)                      # three slots busy elsewhere
        full = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "n": 2})
        held = state.admission.in_flight
        state.admission.release(3)
        engine.fail_after = 1
        failed = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "n": 3})
        return over, full, held, failed, engine, state
    over, full, held, failed, engine, state = asyncio.run(go())
    assert over.status_code == 400 and over.json()["error"]["param"] == "n"
    assert "maxLinkNum" in over.json()["error"]["message"]
    assert full.status_code == 503 and full.headers["retry-after"]
    assert held == 3                                    # the refused request gave its slot back
    assert failed.status_code == 500 and "device lost" in failed.json()["error"]["message"]
    assert state.admission.in_flight == 0


class SecondChoiceFails(FakeEngine):
    """Choice 1 (request id ``...-1``) fails after a short wait; the others run on."""

    async def submit(self, req):
        if not req.request_id.endswith("-1"):
            async for out in super().submit(req):
                yield out
            return
        self.requests.append(req)
        await asyncio.sleep(0.05)
        yield EngineOutput(req.request_id, [], "", True, FinishReason.ERROR,
                           counters=RequestCounters(prompt_tokens=len(req.prompt_token_ids)),
                           error="device lost")


@pytest.mark.parametrize("stream", [False, True])
def test_failure_of_one_choice_aborts_siblings(tokenizer, stream):
    async def go():
        client, _, state = fake_client(tokenizer)
        engine = SecondChoiceFails(tokenizer, "x " * 60, step_delay_s=0.01)
        state.engine = engine
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "n": 3, "stream": stream})
        # Checked before asyncio.run's teardown cancels leftover tasks (which would abort
        # the siblings anyway): the server must have aborted them by the time it answered.
        return r, engine, state, set(engine.aborted)
    r, engine, state, aborted = asyncio.run(go())
    if stream:
        events = sse(r.text)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert events[-2]["error"]["code"] == 500
        rid = events[0]["id"]
    else:
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        rid = engine.requests[0].request_id.rsplit("-", 1)[0]
    assert {f"{rid}-0", f"{rid}-2"} <= aborted                # the siblings were stopped
    assert state.admission.in_flight == 0
