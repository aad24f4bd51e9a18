"""Serving path with a scripted engine: parsing of fixed outputs into OpenAI shapes.

A random tiny model cannot be made to call tools or think, so these tests pin the
reasoning / tool-call / SSE logic on fixed engine outputs; test_daemon_*.py drive the
real daemon.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server.api.app import build_app
from server.api.limits import Admission
from server.api.settings import ApiSettings
from server.api.state import ServerState
from server.metrics import ServingMetrics
from server.testing.tiny_tokenizer import write_tiny_tokenizer
from server.text.special_tokens import (THINK_END, TOOL_CALL_BEGIN, TOOL_CALL_END,
                                        TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP)
from server.text.tokenizer import Tokenizer
from tests.api.fake_engine import FakeEngine

MODEL = "tiny"
CALL = (TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP + "get_weather\n```json\n"
        '{"city": "Paris"}\n```' + TOOL_CALL_END + "\n" + TOOL_CALL_BEGIN + "function" +
        TOOL_SEP + "get_time\n```json\n{}\n```" + TOOL_CALL_END + TOOL_CALLS_END)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d, 512)
    return Tokenizer.from_dir(d)


def settings(**over) -> ApiSettings:
    base = dict(model_name=MODEL, model_path="/x", max_seq_len=2048, max_input_len=1800,
                vocab_size=512, truncation=0, max_iter_times=64, max_link_num=4,
                token_timeout_s=5, e2e_timeout_s=10, max_request_bytes=4096, full_text=False,
                num_speculative_tokens=1, enable_reasoning=True,
                tool_call_parser="deepseek_v3", raw={})
    base.update(over)
    return ApiSettings(**base)


def make_client(tokenizer, script: str, **over):
    s = settings(**over)
    engine = FakeEngine(tokenizer, script, num_speculative_tokens=s.num_speculative_tokens)
    state = ServerState(settings=s, tokenizer=tokenizer, engine=engine,
                        metrics=ServingMetrics(MODEL, 1), admission=Admission(s.max_link_num))
    app = build_app(state, {"business", "management", "metrics"})
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return client, engine, state


def run(coro):
    return asyncio.run(coro)


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: ")
            events.append(block[6:] if block[6:] == "[DONE]" else json.loads(block[6:]))
    return events


def test_tool_calls_non_streaming(tokenizer):
    async def go():
        client, engine, _ = make_client(tokenizer, "Sure." + CALL)
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "weather?"}],
            "tools": TOOLS})
        return r
    r = run(go())
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["content"] == "Sure."


def test_tool_calls_streamed_by_index(tokenizer):
    async def go():
        client, _, _ = make_client(tokenizer, CALL)
        return await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
            "stream": True, "stream_options": {"include_usage": True}})
    r = run(go())
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    args: dict[int, str] = {}
    names = {}
    for ev in events[1:-2]:
        for tc in ev["choices"][0]["delta"].get("tool_calls", []):
            assert "index" in tc
            if "id" in tc:
                names[tc["index"]] = tc["function"]["name"]
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
    assert names == {0: "get_weather", 1: "get_time"}
    assert json.loads(args[0]) == {"city": "Paris"} and json.loads(args[1]) == {}
    assert events[-3]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] > 0


def test_parallel_tool_calls_false_keeps_first(tokenizer):
    async def go():
        client, _, _ = make_client(tokenizer, CALL)
        return await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
            "parallel_tool_calls": False})
    calls = run(go()).json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_named_tool_choice_forces_the_call(tokenizer):
    # A grammar forces the call (the prompt gets no opening or fence to repeat); the
    # script stands for what the grammar lets the model write.
    async def go():
        client, engine, _ = make_client(tokenizer, TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function"
                                        + TOOL_SEP + 'get_weather\n```json\n{"city": "Rome"}\n```'
                                        + TOOL_CALL_END + TOOL_CALLS_END)
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
        return r, engine
    r, engine = run(go())
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"          # OpenAI: named choice gives "stop"
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Rome"}'}
    prompt = tokenizer.decode(engine.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert not prompt.rstrip().endswith(("```", TOOL_SEP, "```json"))     # nothing to repeat
    g = engine.requests[0].sampling.grammar
    assert g is not None and engine.grammars == [g]
    assert '"get_weather"' in g and "get_time" not in g     # only the named function


def test_malformed_tool_text_is_content(tokenizer):
    bad = TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP + "f\n```json\n{not json"
    async def go():
        client, _, _ = make_client(tokenizer, bad)
        return await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    r = run(go())
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["message"]["tool_calls"] == []
    assert "{not json" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")


def test_reasoning_split_and_usage(tokenizer):
    script = "Let me think step by step." + THINK_END + "The answer is 42."
    async def go():
        client, _, _ = make_client(tokenizer, script)
        body = {"messages": [{"role": "user", "content": "q"}],
                "chat_template_kwargs": {"thinking": True}}
        full = await client.post("/v1/chat/completions", json=body)
        stream = await client.post("/v1/chat/completions", json={**body, "stream": True,
                                   "stream_options": {"include_usage": True}})
        off = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}]})
        return full, stream, off
    full, stream, off = run(go())
    msg = full.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "Let me think step by step."
    assert msg["content"] == "The answer is 42."
    usage = full.json()["usage"]
    n_reason = len(tokenizer.encode("Let me think step by step." + THINK_END))
    assert usage["completion_tokens_details"]["reasoning_tokens"] == n_reason
    events = sse_events(stream.text)
    reasoning = "".join(e["choices"][0]["delta"].get("reasoning_content", "")
                        for e in events[:-1] if e["choices"])
    content = "".join(e["choices"][0]["delta"].get("content", "") or ""
                      for e in events[:-1] if e["choices"])
    assert reasoning == "Let me think step by step." and content == "The answer is 42."
    # Thinking off for this request: no reasoning split, all text is content.
    off_msg = off.json()["choices"][0]["message"]
    assert "reasoning_content" not in off_msg and THINK_END in off_msg["content"]


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_reasoning_content_starts_after_the_separator_newlines(tokenizer, tokens_per_step):
    """R1 writes ``</think>\\n\\n`` before the answer; content starts at the answer, streamed
    (the newlines may arrive in their own chunks) and not."""
    script = "Let me think." + THINK_END + "\n\nThe answer\n\nis 42."
    async def go():
        client, engine, _ = make_client(tokenizer, script)
        engine.tokens_per_step = tokens_per_step
        body = {"messages": [{"role": "user", "content": "q"}],
                "chat_template_kwargs": {"thinking": True}}
        full = await client.post("/v1/chat/completions", json=body)
        stream = await client.post("/v1/chat/completions", json={**body, "stream": True})
        return full, stream
    full, stream = run(go())
    assert full.json()["choices"][0]["message"]["content"] == "The answer\n\nis 42."
    deltas = [e["choices"][0]["delta"].get("content") for e in sse_events(stream.text)[:-1]]
    deltas = [d for d in deltas if d]
    assert "".join(deltas) == "The answer\n\nis 42." and deltas[0].startswith("The")


def test_full_text_streaming(tokenizer):
    async def go():
        client, _, _ = make_client(tokenizer, "one two three four", full_text=True)
        return await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "stream": True})
    events = sse_events(run(go()).text)
    texts = [e["choices"][0]["delta"].get("content") for e in events[1:-1]
             if e["choices"][0]["delta"].get("content")]
    assert texts[-1] == "one two three four"
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))


def test_logprobs_shapes(tokenizer):
    async def go():
        client, _, _ = make_client(tokenizer, "abc def")
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "logprobs": True,
            "top_logprobs": 1})
        comp = await client.post("/v1/completions", json={"prompt": "q", "logprobs": 1})
        return chat, comp
    chat, comp = run(go())
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert content and {"token", "logprob", "bytes", "top_logprobs"} <= set(content[0])
    lp = comp.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])


def test_over_capacity_503_with_retry_after(tokenizer):
    async def go():
        client, engine, state = make_client(tokenizer, "x " * 30, max_link_num=1)
        engine.step_delay_s = 0.05
        first = asyncio.create_task(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}]}))
        await asyncio.sleep(0.1)
        second = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}]})
        return await first, second
    first, second = run(go())
    assert first.status_code == 200
    assert second.status_code == 503 and second.headers["retry-after"]
    assert second.json()["error"]["code"] == 503


def test_metrics_spec_counters_move(tokenizer):
    from prometheus_client.parser import text_string_to_metric_families

    async def go():
        client, _, _ = make_client(tokenizer, "one two three four five six")
        await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}]})
        return await client.get("/metrics")
    text = run(go()).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text)
               for s in f.samples if not s.labels.get("position")}
    assert samples["spec_decode_num_drafts_total"] > 0
    assert samples["spec_decode_num_accepted_tokens_total"] > 0
    assert samples["request_success_total"] == 1


def test_mid_stream_failure_sends_error_event_then_done(tokenizer):
    async def go():
        client, engine, _ = make_client(tokenizer, "one two three four five six")
        engine.fail_after = 2
        stream = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "stream": True})
        plain = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}]})
        return stream, plain
    stream, plain = run(go())
    events = sse_events(stream.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["error"]["code"] == 500 and "device lost" in events[-2]["error"]["message"]
    assert plain.status_code == 500 and "device lost" in plain.json()["error"]["message"]


@pytest.mark.parametrize("truncation,keep", [(-1, "head"), (1, "tail")])
def test_truncation_keeps_head_or_tail(tokenizer, truncation, keep):
    async def go():
        client, engine, _ = make_client(tokenizer, "ok", max_input_len=8,
                                        truncation=truncation)
        r = await client.post("/v1/completions", json={"prompt": list(range(3, 23))})
        return r, engine
    r, engine = run(go())
    assert r.status_code == 200
    sent = engine.requests[0].prompt_token_ids
    assert sent == (list(range(3, 11)) if keep == "head" else list(range(15, 23)))


def test_sampling_params_from_request_and_generation_defaults(tokenizer):
    async def go():
        client, engine, state = make_client(tokenizer, "ok")
        state.generation_defaults = {"temperature": 0.6, "top_p": 0.95}
        await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 9,
            "max_tokens": 50, "top_k": 5, "stop": "END", "seed": 3, "logit_bias": {"7": 2.5},
            "presence_penalty": 0.5, "repetition_penalty": 1.1, "min_p": 0.05,
            "skip_special_tokens": False, "stop_token_ids": [4]})
        await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "temperature": 0})
        return engine
    engine = run(go())
    p, q = engine.requests[0].sampling, engine.requests[1].sampling
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (9, 0.6, 0.95, 5)
    assert p.stop == ("END",) and p.seed == 3 and p.logit_bias == {7: 2.5}
    assert (p.presence_penalty, p.repetition_penalty, p.min_p) == (0.5, 1.1, 0.05)
    assert p.skip_special_tokens is False and p.stop_token_ids == (4,)
    assert q.greedy and q.max_tokens == 64          # capped by maxIterTimes


def test_required_tool_choice_streams_the_forced_call(tokenizer):
    # A grammar forces the section; the script is what it lets the model write.
    rest = (TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP +
            "get_time\n```json\n{\"city\": \"Oslo\"}\n```" + TOOL_CALL_END + TOOL_CALLS_END)

    async def go():
        client, engine, _ = make_client(tokenizer, rest)
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
            "tool_choice": "required", "stream": True})
        return r, engine
    r, engine = run(go())
    prompt = tokenizer.decode(engine.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert not prompt.endswith(TOOL_SEP) and engine.requests[0].sampling.grammar is not None
    events = sse_events(r.text)
    calls = [tc for e in events[:-1] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_time" and calls[0]["type"] == "function"
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"city": "Oslo"}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_turns_go_through_the_template(tokenizer):
    from server.text.special_tokens import TOOL_OUTPUT_BEGIN, TOOL_OUTPUTS_END
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "think",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]

    async def go():
        client, engine, _ = make_client(tokenizer, "It is 21.")
        r = await client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS})
        return r, engine
    r, engine = run(go())
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(engine.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert TOOL_SEP + 'get_weather\n```json\n{"city": "Paris"}\n```' in prompt
    assert TOOL_OUTPUT_BEGIN + '{"temp": 21}' in prompt and TOOL_OUTPUTS_END in prompt
    assert "get_weather" in prompt.split(TOOL_CALLS_BEGIN)[0]      # the tools section


def test_v31_tool_format_from_config(tokenizer):
    text = (TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "get_time" + TOOL_SEP + '{"city": "Oslo"}' +
            TOOL_CALL_END + TOOL_CALLS_END)

    async def go():
        client, _, _ = make_client(tokenizer, text, tool_call_parser="deepseek_v31")
        return await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    call = run(go()).json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_time", "arguments": '{"city": "Oslo"}'}


def test_close_stream_aborts_a_body_suspended_at_yield(tokenizer):
    # A disconnect can cancel the response while the body generator sits at a yield; the
    # generator's finally would then wait for garbage collection.  close_stream must abort.
    from server.api.serving.engine_call import EngineCall, close_stream
    from server.engine.protocol import EngineRequest, SamplingParams

    async def go():
        engine = FakeEngine(tokenizer, "one two three four five six seven", tokens_per_step=1)
        call = EngineCall(engine, EngineRequest("r1", [5, 6], SamplingParams(max_tokens=50)),
                          ServingMetrics(MODEL, 1), token_timeout_s=5, e2e_timeout_s=5)
        released = []

        async def body():
            async for out in call:
                yield out.text

        gen = body()
        await gen.__anext__()                    # suspended at the yield now
        await close_stream(gen, [call], lambda: released.append(True))
        return engine, released
    engine, released = run(go())
    assert engine.aborted == {"r1"} and released == [True]


def test_a_call_to_a_function_that_was_not_offered_is_dropped(tokenizer):
    bad = (TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP + 'search\n```json\n{"q": 1}\n```'
           + TOOL_CALL_END + "\n" + TOOL_CALL_BEGIN + "function" + TOOL_SEP
           + 'get_time\n```json\n{}\n```' + TOOL_CALL_END + TOOL_CALLS_END)

    async def go(stream):
        client, _, _ = make_client(tokenizer, bad)
        return await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "stream": stream})
    msg = run(go(False)).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]
    assert "search" not in (msg["content"] or "")
    events = sse_events(run(go(True)).text)
    calls = [tc for e in events[:-1] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert {c["function"].get("name") for c in calls if "id" in c} == {"get_time"}
    assert {c["index"] for c in calls} == {0}


def test_response_format_with_thinking_closes_the_thought_first(tokenizer):
    async def go():
        client, engine, _ = make_client(tokenizer, '{"a": 1}')
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
            "chat_template_kwargs": {"thinking": True}})
        return r, engine
    r, engine = run(go())
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == '{"a": 1}' and not msg["reasoning_content"]
    prompt = tokenizer.decode(engine.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith(THINK_END) and engine.requests[0].sampling.grammar is not None


def test_small_bodies_are_planned_on_the_loop_large_ones_on_the_pool(tokenizer, monkeypatch):
    """The same request, its JSON padded with whitespace past PLAN_INLINE_BYTES, plans the
    same prompt either way; only the padded one goes through the planning pool.  A small
    request refused by validation frees its slot as a pooled one does."""
    from server.api.serving import common as serving_common
    from server.web.offload import PLAN_INLINE_BYTES
    pooled = []
    real = serving_common.off_loop

    async def counting(fn, *args):
        pooled.append(fn)
        return await real(fn, *args)
    monkeypatch.setattr(serving_common, "off_loop", counting)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "weather?"}],
                       "tools": TOOLS, "temperature": 0.5}).encode()
    padded = body[:-1] + b" " * (PLAN_INLINE_BYTES + 1 - len(body)) + b"}"
    assert len(body) <= PLAN_INLINE_BYTES < len(padded)

    async def go():
        client, engine, _ = make_client(tokenizer, "Sure.", max_link_num=1)
        out = []
        for content in (body, padded):
            out.append(await client.post("/v1/chat/completions", content=content,
                                         headers={"content-type": "application/json"}))
        bad = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "q"}], "temperature": -1})
        after = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "q"}]})
        return out, bad, after, engine

    (small, large), bad, after, engine = run(go())
    assert small.status_code == large.status_code == 200, (small.text, large.text)
    first, second = engine.requests[:2]
    assert first.prompt_token_ids == second.prompt_token_ids
    assert first.sampling == second.sampling
    assert len(pooled) == 2          # validation and planning of the padded request only
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert after.status_code == 200


@pytest.mark.parametrize("param,route,shown", [("max_tokens", "chat", "max_tokens"),
                                               ("prompt", "chat", "messages"),
                                               ("prompt", "completions", "prompt")])
def test_an_engine_refusal_is_a_400_naming_the_parameter(tokenizer, param, route, shown):
    """An engine that refuses a request it can never serve as asked (it cannot fit the KV
    pool) answers 400 with the parameter to change, not 500 (issue 58); a stream gets the
    same error as its event."""
    why = "request needs up to 40 KV blocks (450 prompt + 62 output tokens), the pool has 34"

    async def go():
        client, engine, _ = make_client(tokenizer, "one two")
        engine.refusal = (param, why)
        body = {"messages": [{"role": "user", "content": "q"}]} if route == "chat" else \
            {"prompt": "q"}
        url = f"/v1/{'chat/' if route == 'chat' else ''}completions"
        return await client.post(url, json=body), \
            await client.post(url, json={**body, "stream": True})
    plain, stream = run(go())
    assert plain.status_code == 400, plain.text
    err = plain.json()["error"]
    assert (err["param"], err["message"], err["code"]) == (shown, why, 400)
    event = [e for e in sse_events(stream.text) if e != "[DONE]"][-1]
    assert event["error"]["code"] == 400 and event["error"]["param"] == shown
