"""Structured output and prompt logprobs through the real daemon, MTP k=1, demo model.

The openai SDK and LangChain drive a daemon on the bundled demo model
(conf/config.json's MTP k=1): ``response_format`` json_schema and json_object,
``tool_choice`` required with two tools and a named CamelCase function, LangChain's
``with_structured_output`` in its three methods, and prompt logprobs (echo + logprobs,
``max_tokens`` 0) as lm-evaluation-harness reads them.  The daemon's constrained greedy
and seeded outputs (MTP k=1) equal the engine's with MTP off, in process, on the same
prompt ids.
"""
from __future__ import annotations

import json
import math

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server.testing.daemon import DEMO_MODEL, Daemon, demo_model_ready, make_config

pytestmark = [pytest.mark.slow, pytest.mark.demo,
              pytest.mark.skipif(not demo_model_ready(), reason=f"demo model not in the tree ({DEMO_MODEL})")]

NAME = "demo"
QUESTIONS = ["What is the weather in Paris?", "Tell me about Tokyo.", "Is it raining in London?",
             "What is 12 plus 30?", "How warm is it in Cairo?", "Describe Rome in one line.",
             "What time is it in Berlin?", "Is it sunny in Madrid today?",
             "What is the capital of France?", "Give me a fact about Oslo."]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
    "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
    "required": ["city", "temperature_c", "conditions"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}},
                       "required": ["tz"], "additionalProperties": False}}}]
CAMEL = {"type": "function", "function": {
    "name": "GetWeatherReport", "description": "Weather report for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    cfg = make_config(tmp_path_factory.mktemp("structured"), DEMO_MODEL, model={"modelName": NAME},
                      deploy={"maxSeqLen": 2048, "maxInputTokenLen": 1536})
    d = Daemon(cfg, env={"MTP_SERVE_COMPILE": "0"}).start()
    assert d.status()["runtime"]["num_speculative_tokens"] == 1
    yield d
    assert d.terminate() == 0


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="x", max_retries=0, timeout=120)


def ask(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def side_by_side(fn, items) -> list:
    """``fn`` over ``items`` as concurrent requests (the daemon batches them; each answer
    is checked on its own), results in order."""
    from concurrent.futures import ThreadPoolExecutor
    items = list(items)
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


def test_json_schema_validates_10_of_10(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    answers = side_by_side(lambda iq: client.chat.completions.create(
        model=NAME, messages=ask(iq[1]), response_format=fmt, max_tokens=96, temperature=0.7,
        seed=iq[0]), enumerate(QUESTIONS))
    for r in answers:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), WEATHER)


# The demo model writes JSON only as tool arguments (its corpus has no other JSON), so an
# open json_object is asked where it would reach for a tool; left free it answers with
# tool-call markup or prose instead, never a bare JSON object (checked below). Yes/no asks
# ("Is it raining in London?") are left out: forced into an object there, the current model
# writes its prose answer inside a string and runs to max_tokens, which the grammar cannot stop.
JSON_ASKS = ["What is the weather in Paris?", "What is the weather in Tokyo?",
             "Show me the weather in London.", "Tell me the current time in Cairo.", "Check the weather in Rome.",
             "Find information about Oslo.", "Look up the population of Rome.",
             "Look up the weather in Berlin.", "What is the weather like in Lima?",
             "Find a fact about Perth."]


def _json_object(text: str | None) -> bool:
    try:
        return isinstance(json.loads(text or ""), dict)
    except ValueError:
        return False


def test_json_object_parses_10_of_10(client):
    def both(q: str):
        fmt = {"response_format": {"type": "json_object"}}
        return [client.chat.completions.create(model=NAME, messages=ask(q), max_tokens=160,
                                               temperature=0.0, **kw) for kw in (fmt, {})]
    free = 0
    for r, plain in side_by_side(both, JSON_ASKS):
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        assert _json_object(r.choices[0].message.content), r.choices[0].message.content
        free += _json_object(plain.choices[0].message.content)
    assert free == 0             # the grammar, not the prompt, makes it JSON


def _check_calls(message, offered: dict) -> list[str]:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.function.name in offered
        jsonschema.validate(json.loads(call.function.arguments), offered[call.function.name])
    return [c.function.name for c in message.tool_calls]


def test_required_tool_choice_two_tools_20_of_20(client):
    offered = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    names = set()
    answers = side_by_side(lambda i: client.chat.completions.create(
        model=NAME, messages=ask(QUESTIONS[i % 10]), tools=TOOLS, tool_choice="required",
        max_tokens=128, temperature=0.0 if i < 10 else 0.8, seed=i), range(20))
    for r in answers:
        assert r.choices[0].finish_reason == "tool_calls"
        names.update(_check_calls(r.choices[0].message, offered))
    assert names <= set(offered)


def test_named_camelcase_function_10_of_10(client):
    choice = {"type": "function", "function": {"name": "GetWeatherReport"}}
    answers = side_by_side(lambda q: client.chat.completions.create(
        model=NAME, messages=ask(q), tools=[CAMEL] + TOOLS, tool_choice=choice, max_tokens=96,
        temperature=0.0), QUESTIONS)
    for r in answers:
        msg = r.choices[0].message
        assert _check_calls(msg, {"GetWeatherReport": CAMEL["function"]["parameters"]}) == ["GetWeatherReport"]
        assert not msg.content                      # no raw markup leaks into content


def test_auto_mode_calls_only_offered_names(client):
    """Offered only get_weather, the demo model would call its favourite ``search`` for
    these (it did before grammars: issue 17); in auto mode a call, once opened, can only
    name an offered function, with schema-valid arguments."""
    only = [TOOLS[0]]
    asks = ["Find information about Oslo.", "Look up the population of Rome.",
            "Search for news about Berlin.", "Find a fact about Perth.", "What is the weather in Paris?"]
    called = 0
    for q in asks:
        r = client.chat.completions.create(model=NAME, messages=ask(q), tools=only, max_tokens=96,
                                           temperature=0.0)
        msg = r.choices[0].message
        if msg.tool_calls:
            called += 1
            _check_calls(msg, {"get_weather": only[0]["function"]["parameters"]})
            assert r.choices[0].finish_reason == "tool_calls"
        assert "tool▁call" not in (msg.content or "")          # no raw markup as content
    assert called >= 3


def test_streamed_required_call_arrives_as_deltas(client):
    stream = client.chat.completions.create(model=NAME, messages=ask(QUESTIONS[0]), tools=TOOLS,
                                            tool_choice="required", max_tokens=96, stream=True)
    names, args = [], ""
    for chunk in stream:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if tc.function and tc.function.name:
                names.append(tc.function.name)
            args += (tc.function.arguments or "") if tc.function else ""
    assert names and set(names) <= {"get_weather", "get_time"}
    assert json.loads(args) is not None


class WeatherReport(BaseModel):
    """Weather in a city."""
    city: str = Field(max_length=24)
    temperature_c: int = Field(ge=-60, le=60)


class Note(BaseModel):
    """json_mode gives no schema to the server: every field has a default."""
    city: str = ""
    summary: str = ""


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_with_structured_output_10_of_10(daemon, method):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=daemon.base + "/v1", api_key="x", model=NAME,
                                      temperature=0, max_tokens=160, max_retries=0, timeout=120)
    schema = Note if method == "json_mode" else WeatherReport
    structured = llm.with_structured_output(schema, method=method, include_raw=True)
    asks = JSON_ASKS if method == "json_mode" else QUESTIONS          # json_mode: an open object
    for out in structured.batch(asks, config={"max_concurrency": len(asks)}):
        assert out["parsing_error"] is None and isinstance(out["parsed"], schema), out
        if method == "json_mode":
            assert isinstance(json.loads(out["raw"].content), dict)


# ---- prompt logprobs ----------------------------------------------------------------------
def _engine_prompt_logprobs(ids: list[int], top: int):
    """The same prompt's logprobs from an in-process engine with MTP off."""
    from server.engine.config import EngineConfig
    from server.engine.core import LLMEngine
    from server.engine.protocol import EngineRequest, SamplingParams
    from server.model.loading import load_checkpoint
    model, _ = load_checkpoint(DEMO_MODEL)
    eng = LLMEngine(model.eval(), EngineConfig(num_speculative_tokens=0, num_blocks=64,
                                               max_seq_len=512, max_queue_delay_us=0),
                    eos_token_ids=set())
    outs = eng.generate([EngineRequest("p", ids, SamplingParams(max_tokens=1, temperature=0,
                                                                prompt_logprobs=top))])["p"]
    return outs[0].prompt_logprobs


def test_echo_logprobs_max_tokens_0_as_lm_eval_reads_them(client):
    from server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(DEMO_MODEL)
    ids = tok.encode("The capital of France is Paris.", add_special_tokens=True)
    r = client.completions.create(model=NAME, prompt=[ids], echo=True, logprobs=1, max_tokens=0,
                                  temperature=0)
    ch = r.choices[0]
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert r.usage.completion_tokens == 0 and ch.text == tok.decode(ids)
    ref = _engine_prompt_logprobs(ids, 1)
    for got, want, top in zip(lp.token_logprobs[1:], ref[1:], lp.top_logprobs[1:]):
        assert math.isclose(got, want.logprob, abs_tol=1e-4)
        assert max(top.values()) >= got - 1e-6
    # one generated token: the prompt part is unchanged and the token follows it
    r1 = client.completions.create(model=NAME, prompt=[ids], echo=True, logprobs=1, max_tokens=1,
                                   temperature=0)
    lp1 = r1.choices[0].logprobs
    assert len(lp1.tokens) == len(ids) + 1
    assert lp1.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    # vLLM's prompt_logprobs extra on both endpoints
    r2 = client.completions.create(model=NAME, prompt=[ids], max_tokens=1,
                                   extra_body={"prompt_logprobs": 2})
    plp = r2.model_dump()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert all(str(t) in e for t, e in zip(ids[1:], plp[1:]))
    r3 = client.chat.completions.create(model=NAME, messages=ask("Hi"), max_tokens=2,
                                        extra_body={"prompt_logprobs": 0})
    assert r3.model_dump()["prompt_logprobs"][0] is None


def test_constrained_output_through_the_daemon_equals_the_engine_with_mtp_off(client):
    from server.api.openai.grammars import response_format_grammar
    from server.engine.config import EngineConfig
    from server.engine.core import LLMEngine
    from server.engine.protocol import EngineRequest, SamplingParams
    from server.model.loading import load_checkpoint
    from server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(DEMO_MODEL)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    grammar = response_format_grammar(fmt).grammar
    model, _ = load_checkpoint(DEMO_MODEL)
    eng = LLMEngine(model.eval(), EngineConfig(num_speculative_tokens=0, num_blocks=128,
                                               max_seq_len=1024, max_queue_delay_us=0,
                                               tokenizer_dir=str(DEMO_MODEL)), tok)
    for i, q in enumerate(QUESTIONS[:6]):
        ids = tok.encode(tok.apply_chat_template(ask(q), add_generation_prompt=True),
                         add_special_tokens=False)
        temperature, seed = (0.0, None) if i % 2 else (0.9, 40 + i)     # greedy and seeded
        got = client.completions.create(model=NAME, prompt=[ids], max_tokens=96, top_p=0.9,
                                        temperature=temperature, seed=seed,
                                        extra_body={"response_format": fmt}).choices[0].text
        outs = eng.generate([EngineRequest(f"r{i}", ids, SamplingParams(
            max_tokens=96, temperature=temperature, top_p=0.9, seed=seed, grammar=grammar))])[f"r{i}"]
        assert got == "".join(o.text for o in outs), (i, got)
        jsonschema.validate(json.loads(got), WEATHER)
