"""The real daemon driven by the openai SDK (sync and async) and raw httpx.

A random tiny checkpoint cannot produce meaningful text, tool calls or thinking; these
tests check shapes, framing, lengths and plumbing.  Behaviour on the trained demo model
is in test_daemon_demo.py.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import MINDIE_METRIC_NAMES, SPEC_METRIC_NAMES
from server.testing.daemon import MODEL_NAME

pytestmark = pytest.mark.slow          # starts a real daemon

MSG = [{"role": "user", "content": "Hello! How are you today?"}]


@pytest.fixture(scope="module")
def daemon(plain_daemon):
    return plain_daemon                 # tests/daemon/conftest.py: shared, drained at the end


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="x", max_retries=0)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=8,
                                       temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.usage.completion_tokens_details.reasoning_tokens >= 0


def test_max_tokens_and_ignore_eos_give_exact_length(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_completion_tokens=7,
                                       temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


def test_sampling_with_and_without_seed(client):
    kw = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8, temperature=0.8,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    assert a.choices[0].text == b.choices[0].text
    assert client.completions.create(**kw).usage.completion_tokens == 8


def test_greedy_is_repeatable(client):
    a = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    b = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=10,
                                            stream=True, temperature=0, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-2].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_prediction_accepted_with_usage_keys(client):
    """A Predicted Outputs request through the real engine: 200, and the usage keys the SDK
    reads (what the engine accepts is tested with the engine)."""
    pred = {"type": "content", "content": "I am fine, thank you. How are you?"}
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=8,
                                       temperature=0, prediction=pred)
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 0 and details.rejected_prediction_tokens >= 0
    assert details.reasoning_tokens >= 0
    spec = r.usage.model_extra["speculative"]
    assert spec["prediction_accepted_tokens"] == details.accepted_prediction_tokens
    assert spec["prediction_draft_tokens"] == (details.accepted_prediction_tokens
                                               + details.rejected_prediction_tokens)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"prediction": pred}))
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 0
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, echo=True,
                                  extra_body={"prediction": pred})
    assert info.value.body["param"] == "prediction"


def test_async_client_concurrent(daemon):
    async def go():
        client = openai.AsyncOpenAI(base_url=daemon.base + "/v1", api_key="x", max_retries=0)
        tasks = [client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=6,
                                                temperature=0, extra_body={"ignore_eos": True})
                 for _ in range(4)]
        stream = await client.chat.completions.create(model=MODEL_NAME, messages=MSG,
                                                      max_tokens=6, stream=True, temperature=0)
        texts = [c async for c in stream]
        return await asyncio.gather(*tasks), texts
    results, chunks = asyncio.run(go())
    assert all(r.usage.completion_tokens == 6 for r in results)
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completions_prompt_forms(client):
    r = client.completions.create(model=MODEL_NAME, prompt=["one two", "three"], max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 8
    r = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=3,
                                  temperature=0)
    assert r.usage.prompt_tokens == 4
    r = client.completions.create(model=MODEL_NAME, prompt="echo me", max_tokens=2, echo=True,
                                  temperature=0)
    assert r.choices[0].text.startswith("echo me")
    stream = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=5, stream=True,
                                       temperature=0,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5


def test_raw_sse_framing(daemon):
    body = {"model": MODEL_NAME, "messages": MSG, "max_tokens": 5, "stream": True,
            "temperature": 0,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", daemon.base + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[0]["object"] == "chat.completion.chunk"
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"] == [] and "usage" in payloads[-1]


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=4,
                                       logprobs=True, top_logprobs=2, temperature=0,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


def test_tools_and_thinking_shapes_on_random_model(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=tools,
                                           tool_choice=choice, max_tokens=12, temperature=0)
        msg = r.choices[0].message
        assert msg.tool_calls is not None or msg.content is not None
    for choice in ("auto", "required"):
        chunks = list(client.chat.completions.create(
            model=MODEL_NAME, messages=MSG, tools=tools, tool_choice=choice, max_tokens=12,
            temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
        for c in chunks:
            for tc in c.choices[0].delta.tool_calls or []:
                assert tc.index is not None
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=6,
                                       temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": True},
                                                   "ignore_eos": True})
    # No </think> from a random model: everything is reasoning, as DeepSeek-R1 parses it.
    extra = r.choices[0].message.model_extra
    assert isinstance(extra.get("reasoning_content"), str) and extra["reasoning"] == extra["reasoning_content"]


def test_management_plane(daemon):
    m = daemon.mgmt
    assert httpx.get(daemon.base + "/health").status_code == 200
    assert httpx.get(m + "/health/timed", timeout=30).json() == {"status": "healthy"}
    assert httpx.get(m + "/health/timed-5", timeout=30).status_code == 200
    bad = httpx.get(m + "/health/timed-601")
    assert bad.status_code == 404 and set(bad.json()) == {"error", "error_type"}
    cfg = httpx.get(m + "/v1/config").json()
    assert cfg["modelName"] == MODEL_NAME and cfg["maxSeqLen"] == 512
    st = httpx.get(m + "/v1/status").json()
    assert st["mtp"]["enabled"] and st["kv_cache"]["total_blocks"] > 0


def test_metrics_names_and_acceptance(daemon, client):
    def scrape() -> dict:
        text = httpx.get(daemon.metrics + "/metrics").text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                assert s.labels.get("model_name") == MODEL_NAME
                key = s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "") \
                    + (f"[k={s.labels['k']}]" if "k" in s.labels else "")
                out[key] = s.value
        return out
    before = scrape()
    names = {k.split("[")[0] for k in before}
    for name in MINDIE_METRIC_NAMES + SPEC_METRIC_NAMES:
        assert name in names or name + "_bucket" in names, name
    client.completions.create(model=MODEL_NAME, prompt="one two three", max_tokens=24,
                              temperature=0, extra_body={"ignore_eos": True})
    after = scrape()
    # Adaptive speculation may run a request with k=0 when drafting has not paid (this
    # random checkpoint accepts almost nothing): then its steps count under k=0.
    drafted = after["spec_decode_num_drafts_total"] > before["spec_decode_num_drafts_total"]
    assert drafted or after["spec_decode_steps_total[k=0]"] > before["spec_decode_steps_total[k=0]"]
    assert (after["spec_decode_num_draft_tokens_total"] > before["spec_decode_num_draft_tokens_total"]) == drafted
    assert after["spec_decode_num_accepted_tokens_total"] >= before["spec_decode_num_accepted_tokens_total"]
    assert after["request_success_total"] > before["request_success_total"]
    assert after["generation_tokens_total"] >= before["generation_tokens_total"] + 24
    assert after["time_per_output_token_seconds_count"] > before["time_per_output_token_seconds_count"]


def test_client_disconnect_frees_kv(daemon):
    body = {"model": MODEL_NAME, "prompt": "count " * 40, "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", daemon.base + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)                                   # the blank line after each event
        busy = daemon.status()
        assert busy["kv_cache"]["usage"] > 0 and busy["in_flight"] >= 1, busy
    # Leaving the block closes the connection mid-stream.
    st = daemon.wait_kv_free(timeout_s=5)
    assert st["in_flight"] == 0 and st["engine"]["num_requests_aborted"] >= 1


def test_non_streaming_client_gone_frees_kv(daemon):
    # 460 tokens take ~0.7 s on a fast run of this machine: a 0.2 s read timeout leaves
    # the client gone well before the answer.
    body = {"model": MODEL_NAME, "prompt": "count " * 40, "max_tokens": 460,
            "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(daemon.base + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
    st = daemon.wait_kv_free(timeout_s=3)
    assert st["in_flight"] == 0
