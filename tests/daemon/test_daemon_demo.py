"""Tool calls and thinking on the trained demo model (models/deepseek-v3-tiny-mtp).

A random checkpoint cannot call tools or think, so these run only when the demo model is
in the tree; the parsing itself is pinned on fixed outputs in test_serving_unit.py.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.testing.daemon import DEMO_MODEL, Daemon, demo_model_ready, make_config

pytestmark = [pytest.mark.slow, pytest.mark.demo, pytest.mark.skipif(not demo_model_ready(), reason=(
    f"demo model not in the tree ({DEMO_MODEL}); tool-call and thinking behaviour is "
    "meaningless on a random checkpoint (unit tests cover the parsing)"))]

NAME = "demo"


def _tool(name, desc, props):
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in props.items()},
        "required": list(props)}}}


WEATHER = _tool("get_weather", "Get the current weather in a city.", {"city": "string"})
TIME = _tool("get_time", "Get the current local time in a city.", {"city": "string"})
ASK = [{"role": "user", "content": "What's the weather like in Paris?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # A fixed k: adaptive speculation may draft nothing for a whole short request when the
    # machine makes MTP steps look dear, and the acceptance test below must see drafts.
    cfg = make_config(tmp_path_factory.mktemp("demo"), DEMO_MODEL, model={
        "modelName": NAME,
        "plugin_params": '{"plugin_type":"mtp","num_speculative_tokens":1,"adaptive_speculation":false}'},
                      deploy={"maxSeqLen": 2048, "maxInputTokenLen": 1536})
    d = Daemon(cfg).start()
    yield d
    assert d.terminate() == 0


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="x", max_retries=0)


def test_tool_call_auto(client):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME],
                                       temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    assert "city" in json.loads(call.function.arguments)


# Held-out cities (training/facts.py EVAL_CITIES) in held-out phrasings
# (corpus.HELDOUT_*_PHRASINGS): never trained, so only copying from the prompt gets them right.
COPY_ASKS = [("What is the weather in Paris?", "get_weather", "Paris"),
             ("What is the weather in Florence?", "get_weather", "Florence"),
             ("Could you tell me the weather in Valencia?", "get_weather", "Valencia"),
             ("Is it snowing in Calgary?", "get_weather", "Calgary"),
             ("How hot is it in Adelaide today?", "get_weather", "Adelaide"),
             ("What time is it now in Nagoya?", "get_time", "Nagoya"),
             ("Could you tell me the time in Halifax?", "get_time", "Halifax"),
             ("Look up the local time for Mombasa.", "get_time", "Mombasa"),
             ("Time in Gdansk?", "get_time", "Gdansk")]


def test_tool_call_arguments_copy_the_city_from_the_prompt(client):
    """The demo model used to fill in a memorised city (Lima, Barcelona, Boston) whatever
    the prompt named; a call is only useful with the prompt's own city."""
    got = []
    for prompt, name, city in COPY_ASKS:
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                           tools=[WEATHER, TIME], temperature=0, max_tokens=80)
        calls = r.choices[0].message.tool_calls or []
        got.append((calls[0].function.name, json.loads(calls[0].function.arguments)) if calls else None)
    assert got[0] == ("get_weather", {"city": "Paris"}), got[0]
    right = sum(g == (name, {"city": city}) for g, (_p, name, city) in zip(got, COPY_ASKS))
    assert right >= len(COPY_ASKS) - 1, list(zip([a[0] for a in COPY_ASKS], got))


def test_tool_call_streamed(client):
    stream = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME],
                                            temperature=0, max_tokens=80, stream=True)
    names, args, reasons = {}, {}, []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            if tc.function and tc.function.name:
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + ((tc.function and tc.function.arguments) or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert names.get(0) == "get_weather" and "city" in json.loads(args[0])
    assert reasons[-1] == "tool_calls"


def test_tool_choice_required_and_named(client):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", temperature=0, max_tokens=80)
    assert r.choices[0].message.tool_calls and r.choices[0].finish_reason == "tool_calls"
    r = client.chat.completions.create(
        model=NAME, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "stop"
    json.loads(call.function.arguments)


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                       tool_choice="none", temperature=0, max_tokens=40)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content


def test_thinking(client):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "What is 2 plus 3?"}],
              temperature=0, max_tokens=200,
              extra_body={"chat_template_kwargs": {"thinking": True}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message.model_extra
    assert msg["reasoning_content"] and r.choices[0].message.content
    assert "</think>" not in r.choices[0].message.content
    assert not r.choices[0].message.content.startswith("\n")    # the separator is not content
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    stream = client.chat.completions.create(stream=True, **kw)
    reasoning = content = ""
    for chunk in stream:
        if chunk.choices:
            extra = chunk.choices[0].delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert reasoning == msg["reasoning_content"] and content == r.choices[0].message.content


def _answer(r) -> tuple:
    m = r.choices[0].message
    return (m.content, (m.model_extra or {}).get("reasoning_content"),
            [(c.function.name, c.function.arguments) for c in m.tool_calls or []])


def _streamed(client, **kw) -> tuple:
    content, reasoning, usage = "", "", None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
    return content, reasoning, usage


def test_a_prediction_changes_no_answer(client):
    """Predicted Outputs (spec/prediction.py) on the trained model, MTP k=1: the previous
    answer sent back as the prediction, edited, or another question's answer; plain, with
    tools and thinking; whole and streamed, greedy and seeded: every answer is the one
    asked without a prediction, and the own answer is mostly accepted."""
    ask = {"role": "user", "content": "What is the weather in Paris? Answer in one sentence."}
    cases = [dict(messages=[ask], tools=[WEATHER, TIME], tool_choice="none"),
             dict(messages=[ask], tools=[WEATHER, TIME]),
             dict(messages=[{"role": "user", "content": "What is 2 plus 3?"}],
                  extra_body={"chat_template_kwargs": {"thinking": True}}),
             dict(messages=[ask], temperature=0.8, seed=11)]
    other = "The time in Tokyo is 10:00. It is sunny and warm."
    for case in cases:
        kw = {"model": NAME, "temperature": 0, "max_tokens": 100, **case}
        ref = client.chat.completions.create(**kw)
        content, reasoning, calls = _answer(ref)
        own = content or (reasoning or "") or "".join(a for _, a in calls)
        edited = own.replace("Paris", "Lyon").replace(" is ", " was ", 1)
        for pred in (own, edited, other, ""):
            extra = {**kw.get("extra_body", {}), "prediction": {"type": "content", "content": pred}}
            r = client.chat.completions.create(**{**kw, "extra_body": extra})
            assert _answer(r) == _answer(ref), (case, pred)
            details = r.usage.completion_tokens_details
            if pred == own and case.get("tool_choice") == "none":
                assert details.accepted_prediction_tokens >= r.usage.completion_tokens // 2, r.usage
                assert r.usage.model_extra["speculative"]["prediction_accepted_tokens"] \
                    == details.accepted_prediction_tokens
            if not pred:
                assert details.accepted_prediction_tokens == details.rejected_prediction_tokens == 0
        s_content, s_reasoning, usage = _streamed(client, **{**kw, "extra_body": {
            **kw.get("extra_body", {}), "prediction": {"type": "content", "content": own}}})
        if not calls:
            assert (s_content, s_reasoning or None) == (content, reasoning or None), case
        assert usage.completion_tokens == ref.usage.completion_tokens


def test_mtp_acceptance_counters_move(daemon, client):
    def accepted() -> float:
        text = httpx.get(daemon.metrics + "/metrics").text
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "spec_decode_num_accepted_tokens_total")
    before = accepted()
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content":
                                   "What is the capital of France?"}], temperature=0,
                                   max_tokens=40)
    assert accepted() > before
