"""``n`` > 1 choices on the scripted engine (tests/api/fake_engine.py): seeds, request ids,
admission slots, the config's cap, and a failed choice aborting its siblings.  The same
behaviour through the real daemon is in tests/daemon/test_n_choices.py.
"""
from __future__ import annotations

import asyncio
import json

import httpx
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
from tests.api.fake_engine import FakeEngine


def sse(raw: str) -> list:
    """Parse an SSE body strictly: every block is ``data: ...``."""
    events = []
    for block in raw.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


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
