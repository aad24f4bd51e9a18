"""Bad requests against the real daemon: right 4xx, right shape, and the next request works."""
from __future__ import annotations

import httpx
import pytest

from server.testing.daemon import MODEL_NAME

pytestmark = pytest.mark.slow          # starts a real daemon

MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def chat(**kw) -> dict:
    return {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2, "temperature": 0, **kw}


def comp(**kw) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0, **kw}


# (name, path, body (dict, or bytes sent raw), status, param expected in the error or None)
CASES = [
    ("malformed json", CHAT, b'{"messages": [', 400, None),
    ("empty body", CHAT, b"", 400, None),
    ("body not an object", CHAT, b"[1, 2]", 400, None),
    ("messages missing", CHAT, {"model": MODEL_NAME}, 400, "messages"),
    ("messages empty", CHAT, chat(messages=[]), 400, "messages"),
    ("bad role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages"),
    ("temperature wrong type", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature out of range", CHAT, chat(temperature=3.5), 400, "temperature"),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_k below -1", CHAT, chat(top_k=-5), 400, "top_k"),
    ("max_tokens zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens string", CHAT, chat(max_tokens="many"), 400, "max_tokens"),
    ("presence_penalty out of range", CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    ("repetition_penalty zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("logit_bias bad key", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias id outside vocab", CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("unknown model", CHAT, chat(model="gpt-4"), 404, "model"),
    ("n > 1 under MTP", CHAT, chat(n=2), 400, "n"),
    ("best_of > 1 under MTP", COMP, comp(best_of=3), 400, "best_of"),
    ("beam search under MTP", CHAT, chat(use_beam_search=True), 400, "use_beam_search"),
    ("structural_tag response_format", CHAT, chat(response_format={"type": "structural_tag"}),
     400, "response_format"),
    ("json_schema without a schema", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format"),
    ("json_object with min_tokens", CHAT, chat(response_format={"type": "json_object"},
                                                min_tokens=2, max_tokens=8), 400, "min_tokens"),
    ("strict schema with a keyword not enforced", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
            "type": "array", "uniqueItems": True}}}), 400, "response_format"),
    ("tool_choice without tools", CHAT, chat(tool_choice="auto"), 400, "tool_choice"),
    ("named tool not in tools", CHAT, chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("bad tool_choice string", CHAT, chat(tools=TOOLS, tool_choice="sometimes"), 400,
     "tool_choice"),
    ("image content part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages"),
    ("prompt too long", CHAT, chat(messages=[{"role": "user", "content": "hello " * 600}]),
     400, "messages"),
    ("completion prompt wrong type", COMP, comp(prompt={"text": "x"}), 400, "prompt"),
    ("completion token id outside vocab", COMP, comp(prompt=[1, 2, 10 ** 9]), 400, "prompt"),
    ("completion suffix", COMP, comp(suffix="end"), 400, "suffix"),
    ("completion empty prompt", COMP, comp(prompt=""), 400, "prompt"),
    ("completion logprobs negative", COMP, comp(logprobs=-1), 400, "logprobs"),
    ("stop list too long", COMP, comp(stop=[str(i) for i in range(20)]), 400, "stop"),
    ("oversize body", CHAT, chat(messages=[{"role": "user", "content": "x" * (1024 * 1024 + 10)}]),
     413, None),
]


@pytest.fixture(scope="module")
def daemon(plain_daemon):
    return plain_daemon                 # tests/daemon/conftest.py: shared, drained at the end


def test_there_are_enough_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http, name, path, body, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and err["message"]
    if param is not None:
        assert (err["param"] or "").split(".")[0] == param, err
    ok = http.post(CHAT, json=chat())
    assert ok.status_code == 200, ok.text


def test_unknown_fields_are_ignored(http):
    r = http.post(CHAT, json=chat(some_vendor_field={"a": 1}, user="u1"))
    assert r.status_code == 200


def test_native_endpoints_use_mindie_shape(daemon):
    r = httpx.get(daemon.mgmt + "/health/timed-abc")
    assert r.status_code == 404
    assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == "NotFoundError"


def test_mtp_message_names_the_plugin(http):
    r = http.post(CHAT, json=chat(n=3))
    assert "mtp" in r.json()["error"]["message"] and "n" == r.json()["error"]["param"]
