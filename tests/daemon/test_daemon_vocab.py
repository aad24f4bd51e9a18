"""Token ids are checked against the model's vocabulary, not the tokenizer's.

The checkpoint has ``vocab_size`` 520 and a tokenizer of 512 ids, as DeepSeek-V3's has
rows above its tokenizer's ids: 512..519 are ids the model reads and can produce, so a
token-id prompt, a ``logit_bias`` and a stop id may name them; 520 is outside.
"""
from __future__ import annotations

import json

import pytest

from server.testing.daemon import MODEL_NAME, Daemon, make_config
from server.testing.tiny_checkpoint import make_tiny_checkpoint
from server.testing.tiny_tokenizer import write_tiny_tokenizer
from server.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow          # starts a real daemon

MODEL_VOCAB, TOKENIZER_VOCAB = 520, 512
ABOVE_TOKENIZER = 515


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    weights = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt-vocab"), seed=0,
                                   vocab_size=MODEL_VOCAB)
    write_tiny_tokenizer(weights, TOKENIZER_VOCAB)
    assert json.loads((weights / "config.json").read_text())["vocab_size"] == MODEL_VOCAB
    assert Tokenizer.from_dir(weights).vocab_size == TOKENIZER_VOCAB
    d = Daemon(make_config(tmp_path_factory.mktemp("cfg-vocab"), weights)).start()
    yield d
    assert d.terminate() == 0


def comp(**kw) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0, **kw}


def test_prompt_ids_above_the_tokenizer_are_accepted(http):
    r = http.post("/v1/completions", json=comp(prompt=[0, 5, ABOVE_TOKENIZER, MODEL_VOCAB - 1]))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4


def test_logit_bias_and_stop_id_above_the_tokenizer_reach_the_model(http):
    # +100 on id 515 makes greedy pick it; as a stop id it ends the request at once.
    r = http.post("/v1/completions", json=comp(
        prompt="hello", max_tokens=8, logit_bias={str(ABOVE_TOKENIZER): 100},
        stop_token_ids=[ABOVE_TOKENIZER]))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("field,body", [
    ("prompt", comp(prompt=[0, MODEL_VOCAB])),
    ("logit_bias", comp(prompt="hi", logit_bias={str(MODEL_VOCAB): 1})),
    ("stop_token_ids", comp(prompt="hi", stop_token_ids=[MODEL_VOCAB])),
    ("prompt", comp(prompt=[0, -1])),
])
def test_ids_outside_the_model_vocabulary_are_refused(http, field, body):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field
    assert f"[0, {MODEL_VOCAB})" in err["message"], err
