"""schemathesis against the real daemon's business-plane /openapi.json: no 5xx, ever, and
every body the schema forbids is refused.

Bounded: a fixed seed, at most ``MAX_EXAMPLES`` generated cases per operation (five
operations, positive and negative cases, plus schemathesis's coverage phase), on a daemon
whose outputs are capped at 2 tokens.  Checks: ``not_a_server_error`` (no 5xx) and
``negative_data_rejection`` (a schema-violating request must get a 4xx, not a 2xx).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.testing.daemon import Daemon, make_config

pytestmark = pytest.mark.slow          # starts a real daemon

MAX_EXAMPLES = 8
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def daemon(tiny_weights, tmp_path_factory):
    cfg = make_config(tmp_path_factory.mktemp("fuzz"), tiny_weights,
                      schedule={"maxIterTimes": 2})
    d = Daemon(cfg).start()
    yield d
    assert d.terminate() == 0


def test_openapi_names_the_request_models(daemon):
    doc = httpx.get(daemon.base + "/openapi.json", timeout=10).json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert "CompletionRequest" in doc["components"]["schemas"]
    # The management plane publishes nothing.
    assert httpx.get(daemon.mgmt + "/openapi.json", timeout=10).status_code == 404


def test_schemathesis_finds_no_server_error(daemon, tmp_path):
    if not SCHEMATHESIS.exists():
        pytest.fail("schemathesis is not installed: it is in the test extra (pip install -e .[test])")
    cmd = [str(SCHEMATHESIS), "run", daemon.base + "/openapi.json",
           "--checks", "not_a_server_error,negative_data_rejection",
           "--max-examples", str(MAX_EXAMPLES), "--seed", "19", "--mode", "all",
           "--phases", "examples,coverage,fuzzing", "--generation-database", "none",
           # One worker: with threads, CPython 3.11's ast module can raise a spurious
           # "AST constructor recursion depth mismatch" (cpython gh-106905) in the run.
           "--request-timeout", "30", "--workers", "1", "--no-color",
           "--suppress-health-check", "all", "--report", "junit",
           "--report-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # The run really sent requests (a schema it could not read would test nothing).
    m = re.search(r"(\d+) generated, (\d+) passed", out)
    assert m and int(m.group(1)) >= 300 and m.group(1) == m.group(2), out[-3000:]
    print("schemathesis:", m.group(0))


# ---- the inputs that reached the engine or the handler and came back as 500 ----------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("extra, param", [
    ({"top_k": 2 ** 63}, "top_k"),                       # was: engine step failed (overflow)
    ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias"),     # was: int() ValueError -> 500
    ({"logit_bias": {"1" * 5000: 1.0}}, "logit_bias"),   # int() refuses > 4300 digits
    ({"max_tokens": "3"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stream": "true"}, "stream"),
    ({"stop_token_ids": [True]}, "stop_token_ids.0"),
    ({"seed": 2 ** 64}, "seed"),
    ({"min_tokens": 2 ** 40}, "min_tokens"),
    ({"temperature": "0.5"}, "temperature"),
])
def test_former_500s_and_loose_types_are_400(daemon, extra, param):
    r = httpx.post(daemon.base + "/v1/chat/completions", json={**CHAT, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_boolean_token_ids_are_not_a_prompt(daemon):
    r = httpx.post(daemon.base + "/v1/completions",
                   json={"prompt": [[False]], "max_tokens": 2}, timeout=30)
    assert r.status_code == 400, r.text


def test_top_k_above_the_vocabulary_means_no_top_k(daemon):
    """Clamped, not refused: the answer equals the one without top_k (greedy)."""
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
    plain = httpx.post(daemon.base + "/v1/completions", json=body, timeout=30)
    wide = httpx.post(daemon.base + "/v1/completions", json={**body, "top_k": 2 ** 31 - 1},
                      timeout=30)
    assert plain.status_code == wide.status_code == 200, wide.text
    assert wide.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


# ---- property-based: any body, never a 5xx ---------------------------------------------

def _json_values():
    from hypothesis import strategies as st
    scalars = st.one_of(
        st.none(), st.booleans(),
        st.integers(min_value=-2 ** 70, max_value=2 ** 70),
        st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, -2 ** 63 - 1, 2 ** 64]),
        st.floats(allow_nan=False, allow_infinity=False, width=64),
        st.text(max_size=12),
        st.sampled_from(["3", "true", "\u00b2", "\u0663", "-0", "1e3", "", "auto", "none"]))
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=4)


def _bodies():
    """A valid chat or completions body with up to two fields set to anything at all (a
    valid value for that field about half the time), or a body that is anything at all."""
    from hypothesis import strategies as st
    anything = _json_values()
    good = {"model": st.just("tiny-mtp"), "max_tokens": st.integers(1, 2),
            "max_completion_tokens": st.integers(1, 2), "temperature": st.floats(0, 2),
            "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 2 ** 31 - 1),
            "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.01, 2),
            "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
            "logit_bias": st.dictionaries(st.integers(0, 3000).map(str), st.floats(-100, 100),
                                          max_size=2),
            "seed": st.integers(-2 ** 63, 2 ** 63 - 1), "stop": st.text(min_size=1, max_size=3),
            "stop_token_ids": st.lists(st.integers(0, 3000), max_size=2),
            "n": st.just(1), "stream": st.booleans(), "ignore_eos": st.booleans(),
            "min_tokens": st.integers(0, 2), "logprobs": st.booleans(),
            "skip_special_tokens": st.booleans(), "echo": st.booleans(),
            "tool_choice": st.sampled_from(["none", "auto"]),
            "chat_template_kwargs": st.just({"thinking": True}),
            "stream_options": st.just({"include_usage": True}),
            "response_format": st.just({"type": "text"}), "top_logprobs": st.integers(0, 20)}
    value = {f: st.one_of(v, anything) for f, v in good.items()}
    mutations = st.lists(st.sampled_from(sorted(value)), max_size=2, unique=True).flatmap(
        lambda fs: st.fixed_dictionaries({f: value[f] for f in fs}))
    text = st.text(max_size=30)
    content = st.one_of(text, text, anything)
    chat = st.builds(lambda c, m: ("/v1/chat/completions",
                                   {"messages": [{"role": "user", "content": c}],
                                    "max_tokens": 1, **m}), content, mutations)
    prompt = st.one_of(text, st.lists(st.integers(-5, 5000), min_size=1, max_size=6), anything)
    completion = st.builds(lambda p, m: ("/v1/completions",
                                         {"prompt": p, "max_tokens": 1, **m}), prompt, mutations)
    garbage = st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), anything)
    return st.one_of(chat, completion, chat, completion, garbage)


@pytest.mark.timeout(300)
def test_property_no_server_error_on_any_body(daemon):
    from hypothesis import HealthCheck, given, settings

    seen: dict[int, int] = {}
    with httpx.Client(base_url=daemon.base, timeout=30) as client:
        @settings(max_examples=500, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(_bodies())
        def run(case):
            path, body = case
            r = client.post(path, json=body)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.text[:500])
            if r.status_code != 200:
                err = r.json()["error"]
                assert err["code"] == r.status_code and err["message"], err

        run()
    print("status counts:", seen)
    assert sum(seen.values()) >= 500 and seen.get(200, 0) > 50 and seen.get(400, 0) > 200, seen
