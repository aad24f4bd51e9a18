"""OpenAI Predicted Outputs on the API side: the ``prediction`` field's shapes and refusals,
its token ids in ``SamplingParams.prediction``, the usage keys and the metrics.

A scripted engine (fake_engine.py) stands in for the real one: it counts the prediction
tokens at each step's positions as verified and the matching ones as accepted, so these
tests check that the serving path carries such figures, not what the engine decides
(tests/engine and tests/daemon check that once the engine uses predictions).
"""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.testing.tiny_tokenizer import write_tiny_tokenizer
from server.text.tokenizer import Tokenizer
from tests.api.test_serving_unit import make_client, sse_events

SCRIPT = "The quick brown fox jumps over the lazy dog."
MSG = [{"role": "user", "content": "Say the sentence."}]
SHAPES = ('{"type": "content", "content": "<text>"} or {"type": "content", '
          '"content": [{"type": "text", "text": "<text>"}, ...]}')


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d, 512)
    return Tokenizer.from_dir(d)


def post(tokenizer, path: str, body: dict, script: str = SCRIPT, **over):
    """(response, engine) of one request to a fresh app on the scripted engine."""
    async def go():
        client, engine, _ = make_client(tokenizer, script, **over)
        async with client:
            return await client.post(path, json=body), engine
    return asyncio.run(go())


def chat(pred, **extra) -> dict:
    return {"messages": MSG, "prediction": pred, **extra}


def completion(pred, **extra) -> dict:
    return {"prompt": "Say the sentence.", "max_tokens": 32, "prediction": pred, **extra}


def refused(r: httpx.Response, param: str = "prediction") -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["code"] == 400
    return err["message"]


# ---- shapes --------------------------------------------------------------------------

BAD_SHAPES = [
    ("no-content", {"type": "content"}, "content: Field required"),
    ("other-type", {"type": "text", "content": "x"}, "type: Input should be 'content'"),
    ("no-type", {"content": "x"}, "type: Field required"),
    ("content-number", {"type": "content", "content": 5}, "content"),
    ("content-null", {"type": "content", "content": None}, "content"),
    ("image-part", {"type": "content", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}, "content.0.type"),
    ("part-without-text", {"type": "content", "content": [{"type": "text"}]},
     "content.0.text: Field required"),
    ("part-text-number", {"type": "content", "content": [{"type": "text", "text": 3}]},
     "content.0.text"),
    ("part-a-string", {"type": "content", "content": ["x"]}, "content"),
    ("unknown-key", {"type": "content", "content": "x", "extra": 1}, "extra"),
    ("a-string", "The quick brown fox", "not a JSON object"),
    ("a-list", [{"type": "content", "content": "x"}], "not a JSON object"),
    ("a-number", 7, "not a JSON object"),
    ("a-bool", True, "not a JSON object"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("case,pred,where", BAD_SHAPES, ids=[c[0] for c in BAD_SHAPES])
def test_bad_shapes_are_refused_on_prediction(tokenizer, path, case, pred, where):
    body = chat(pred) if path.endswith("chat/completions") else completion(pred)
    r, engine = post(tokenizer, path, body)
    message = refused(r)
    assert SHAPES in message and where in message, message
    assert engine.requests == []


@pytest.mark.parametrize("pred,text", [
    ({"type": "content", "content": "The quick brown fox"}, "The quick brown fox"),
    ({"type": "content", "content": [{"type": "text", "text": "The quick "},
                                     {"type": "text", "text": "brown fox"}]},
     "The quick brown fox"),
], ids=["string", "text-parts"])
def test_prediction_tokens_reach_the_engine(tokenizer, pred, text):
    """Tokenized once with the model's tokenizer, no special tokens (no BOS); text parts
    joined in order with nothing between them."""
    want = tuple(tokenizer.encode(text, add_special_tokens=False))
    r, engine = post(tokenizer, "/v1/chat/completions", chat(pred))
    assert r.status_code == 200, r.text
    assert engine.requests[0].sampling.prediction == want
    r, engine = post(tokenizer, "/v1/completions", completion(pred))
    assert r.status_code == 200, r.text
    assert engine.requests[0].sampling.prediction == want


@pytest.mark.parametrize("pred", [None, {"type": "content", "content": ""},
                                  {"type": "content", "content": []}],
                         ids=["null", "empty-string", "no-parts"])
def test_null_or_empty_prediction_is_none(tokenizer, pred):
    r, engine = post(tokenizer, "/v1/chat/completions", chat(pred))
    assert r.status_code == 200, r.text
    assert engine.requests[0].sampling.prediction is None
    # null is the field absent: no prediction rule applies (n > 1 allowed without MTP)
    if pred is None:
        r, engine = post(tokenizer, "/v1/chat/completions", chat(None, n=2),
                         num_speculative_tokens=0)
        assert r.status_code == 200 and len(engine.requests) == 2, r.text


# ---- combinations ---------------------------------------------------------------------

PRED = {"type": "content", "content": "The quick brown fox"}


@pytest.mark.parametrize("k", [0, 1], ids=["mtp-off", "mtp-on"])
def test_prediction_refuses_several_choices(tokenizer, k):
    msg = refused(post(tokenizer, "/v1/chat/completions", chat(PRED, n=2),
                       num_speculative_tokens=k)[0])
    assert "n=2" in msg
    msg = refused(post(tokenizer, "/v1/completions", completion(PRED, n=3),
                       num_speculative_tokens=k)[0])
    assert "n=3" in msg
    msg = refused(post(tokenizer, "/v1/completions", completion(PRED, best_of=2),
                       num_speculative_tokens=k)[0])
    assert "best_of=2" in msg


@pytest.mark.parametrize("extra", [{"echo": True}, {"echo": True, "logprobs": 2},
                                   {"echo": True, "logprobs": 0, "max_tokens": 0}],
                         ids=["echo", "echo-logprobs", "echo-prompt-only"])
def test_prediction_refuses_echo(tokenizer, extra):
    msg = refused(post(tokenizer, "/v1/completions", completion(PRED, **extra))[0])
    assert "echo" in msg and "logprobs of the prompt" in msg


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_prediction_refuses_prompt_logprobs(tokenizer, path):
    body = chat(PRED, prompt_logprobs=1) if "chat" in path else completion(PRED, prompt_logprobs=1)
    msg = refused(post(tokenizer, path, body)[0])
    assert "prompt_logprobs" in msg and "logprobs of the prompt" in msg


def test_prediction_longer_than_max_seq_len_is_refused(tokenizer):
    words = " ".join(["fox"] * 80)
    n = len(tokenizer.encode(words, add_special_tokens=False))
    assert n > 64
    msg = refused(post(tokenizer, "/v1/chat/completions",
                       chat({"type": "content", "content": words}),
                       max_seq_len=64, max_input_len=60)[0])
    assert f"{n} tokens" in msg and "64" in msg and "maxSeqLen" in msg
    # Far too many characters for any tokenization: refused before tokenizing.
    msg = refused(post(tokenizer, "/v1/completions",
                       completion({"type": "content", "content": "x" * 3000}),
                       max_seq_len=64, max_input_len=60)[0])
    assert "3000 characters" in msg and "maxSeqLen" in msg
    # At the limit it is fine.
    fits = " ".join(["fox"] * 20)
    r, engine = post(tokenizer, "/v1/chat/completions",
                     chat({"type": "content", "content": fits}), max_seq_len=64, max_input_len=60)
    assert r.status_code == 200, r.text


# ---- usage and metrics ------------------------------------------------------------------

def spec_keys(u: dict) -> tuple[int, int, int, int]:
    s = u["speculative"]
    assert set(s) == {"mtp_draft_tokens", "mtp_accepted_tokens", "prediction_draft_tokens",
                      "prediction_accepted_tokens"}
    return (s["mtp_draft_tokens"], s["mtp_accepted_tokens"], s["prediction_draft_tokens"],
            s["prediction_accepted_tokens"])


def check_usage(u: dict) -> None:
    details = u["completion_tokens_details"]
    assert set(details) == {"reasoning_tokens", "accepted_prediction_tokens",
                            "rejected_prediction_tokens"}
    _, _, verified, accepted = spec_keys(u)
    assert details["accepted_prediction_tokens"] == accepted
    assert details["rejected_prediction_tokens"] == verified - accepted


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_usage_without_prediction_reports_zeros(tokenizer, path):
    body = {"messages": MSG} if "chat" in path else {"prompt": "x", "max_tokens": 32}
    r, _ = post(tokenizer, path, body)
    u = r.json()["usage"]
    check_usage(u)
    mtp_drafts, mtp_accepted, verified, accepted = spec_keys(u)
    assert verified == accepted == 0 and mtp_drafts > 0 and mtp_accepted > 0
    assert u["completion_tokens_details"]["accepted_prediction_tokens"] == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_usage_carries_the_prediction_counters(tokenizer, path):
    """Half the script as the prediction, then a wrong word: the fake engine's figures
    come back in completion_tokens_details and speculative, streamed or not."""
    pred = {"type": "content", "content": "The quick brown cat jumps over the lazy dog."}
    body = chat(pred) if "chat" in path else completion(pred)
    r, _ = post(tokenizer, path, body)
    u = r.json()["usage"]
    check_usage(u)
    _, _, verified, accepted = spec_keys(u)
    assert accepted > 0 and verified > accepted
    r, _ = post(tokenizer, path, {**body, "stream": True,
                                  "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-2]["choices"] == []
    assert events[-2]["usage"] == u


def test_usage_sums_choices_without_prediction(tokenizer):
    """n > 1 (MTP off): the speculative figures are sums over the choices."""
    one, _ = post(tokenizer, "/v1/completions", {"prompt": "x", "max_tokens": 32},
                  num_speculative_tokens=0)
    three, _ = post(tokenizer, "/v1/completions", {"prompt": "x", "max_tokens": 32, "n": 3},
                    num_speculative_tokens=0)
    a, b = spec_keys(one.json()["usage"]), spec_keys(three.json()["usage"])
    assert b == tuple(3 * x for x in a)


def test_openai_sdk_sends_prediction_and_reads_usage(tokenizer):
    async def go():
        client, engine, _ = make_client(tokenizer, SCRIPT)
        sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=client,
                                 max_retries=0)
        pred = {"type": "content", "content": SCRIPT}
        r = await sdk.chat.completions.create(model="tiny", messages=MSG, prediction=pred)
        chunks = [c async for c in await sdk.chat.completions.create(
            model="tiny", messages=MSG, prediction=pred, stream=True,
            stream_options={"include_usage": True})]
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(model="tiny", messages=MSG, n=2,
                                              prediction=pred)
        await client.aclose()
        return r, chunks, info.value, engine
    r, chunks, err, engine = asyncio.run(go())
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
    assert r.usage.model_extra["speculative"]["prediction_accepted_tokens"] == \
        details.accepted_prediction_tokens
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == \
        details.accepted_prediction_tokens
    assert err.body["param"] == "prediction"
    assert engine.requests[0].sampling.prediction == tuple(
        tokenizer.encode(SCRIPT, add_special_tokens=False))


def test_prediction_metrics(tokenizer):
    """spec_decode_num_prediction_*_total grow by the requests' figures; the MTP series
    count MTP drafts only."""
    async def go():
        client, _, _ = make_client(tokenizer, SCRIPT)
        async with client:
            r = await client.post("/v1/chat/completions", json=chat(
                {"type": "content", "content": "The quick brown cat jumps over the lazy dog."}))
            return r, (await client.get("/metrics")).text
    r, text = asyncio.run(go())
    values = {s.name: s.value for fam in text_string_to_metric_families(text)
              for s in fam.samples}
    mtp_drafts, mtp_accepted, verified, accepted = spec_keys(r.json()["usage"])
    assert values["spec_decode_num_prediction_draft_tokens_total"] == verified
    assert values["spec_decode_num_prediction_accepted_tokens_total"] == accepted
    assert values["spec_decode_num_draft_tokens_total"] == mtp_drafts
    assert values["spec_decode_num_accepted_tokens_total"] == mtp_accepted
