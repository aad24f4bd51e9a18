"""API keys on the business plane; the management plane's guard on /stopService and on
/health/timed[-N] (each call runs an inference, so a keyless caller could load the engine).

One daemon with two keys (one in config.json, one from $MTP_SERVE_API_KEY) and the
management plane on its own port, as shipped.
"""
from __future__ import annotations

import httpx
import openai
import pytest

from server.testing.daemon import MODEL_NAME, Daemon, make_config

pytestmark = pytest.mark.slow          # starts a real daemon

FILE_KEY, ENV_KEY = "file-key-2f9a61c0", "env-key-77d03b1e"
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def daemon(tiny_weights, tmp_path_factory):
    cfg = make_config(tmp_path_factory.mktemp("auth"), tiny_weights,
                      server={"apiKeys": [FILE_KEY]})
    d = Daemon(cfg, env={"MTP_SERVE_API_KEY": ENV_KEY}).start()
    yield d
    d.kill()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, bearer("wrong-key-0000"), bearer(FILE_KEY + "x"),
                                     bearer(FILE_KEY[:-1]), {"Authorization": FILE_KEY},
                                     {"Authorization": f"Basic {FILE_KEY}"}])
@pytest.mark.parametrize("method, path", [("POST", "/v1/chat/completions"),
                                          ("POST", "/v1/completions"), ("GET", "/v1/models"),
                                          ("GET", f"/v1/models/{MODEL_NAME}")])
def test_business_routes_need_a_key(daemon, headers, method, path):
    r = httpx.request(method, daemon.base + path, headers=headers, json=CHAT, timeout=30)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == 401 and "API key" in err["message"]


@pytest.mark.parametrize("key", [FILE_KEY, ENV_KEY])
def test_either_key_works_with_the_openai_sdk(daemon, key):
    client = openai.OpenAI(base_url=daemon.base + "/v1", api_key=key, max_retries=0)
    out = client.chat.completions.create(model=MODEL_NAME, max_tokens=2,
                                         messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].finish_reason in ("length", "stop")
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


def test_wrong_key_is_an_sdk_authentication_error(daemon):
    client = openai.OpenAI(base_url=daemon.base + "/v1", api_key="wrong-key-0000", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_health_and_schema_stay_open(daemon):
    assert httpx.get(daemon.base + "/health", timeout=10).status_code == 200
    doc = httpx.get(daemon.base + "/openapi.json", timeout=10).json()
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]


@pytest.mark.parametrize("method, path", [("POST", "/stopService"), ("GET", "/stopService"),
                                          ("GET", "/v1/status"), ("GET", "/v1/config"),
                                          ("GET", "/health/timed-1"), ("GET", "/metrics")])
def test_management_is_not_reachable_through_the_business_port(daemon, method, path):
    r = httpx.request(method, daemon.base + path, headers=bearer(FILE_KEY), timeout=10)
    assert r.status_code in (404, 405), (path, r.status_code, r.text)
    assert daemon.proc.poll() is None


def test_model_card_names_no_path(daemon, tiny_weights):
    # A key holder is a client, not an operator: where the weights lie on the host (and
    # the account in that path) is none of its business.
    listed = httpx.get(daemon.base + "/v1/models", headers=bearer(FILE_KEY), timeout=10).json()
    one = httpx.get(daemon.base + f"/v1/models/{MODEL_NAME}", headers=bearer(FILE_KEY),
                    timeout=10).json()
    for card in (*listed["data"], one):
        assert card["id"] == card["root"] == MODEL_NAME
        for field, value in card.items():
            assert not (isinstance(value, str) and ("/" in value or str(tiny_weights) in value)), \
                (field, value)
    assert str(tiny_weights) not in str(listed)


@pytest.mark.parametrize("path", ["/health/timed", "/health/timed-1", "/health/timed-600"])
def test_timed_health_needs_a_key(daemon, path):
    url = daemon.mgmt + path
    for headers in ({}, bearer("wrong-key-0000"), {"Authorization": FILE_KEY}):
        r = httpx.get(url, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        body = r.json()              # the native MindIE shape, like /stopService's 401
        assert set(body) == {"error", "error_type"} and "API key" in body["error"]
    for key in (FILE_KEY, ENV_KEY):
        r = httpx.get(url, headers=bearer(key), timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "healthy"}, r.text


def test_plain_health_stays_open_on_the_management_port(daemon):
    # Load balancers and kubelet probes send no key.
    assert httpx.get(daemon.mgmt + "/health", timeout=10).status_code == 200


def test_stop_service_is_post_only_same_origin_and_keyed(daemon):
    url = daemon.mgmt + "/stopService"
    assert httpx.get(url, headers=bearer(FILE_KEY), timeout=10).status_code == 405
    # A page on another origin (what a browser sends for a cross-origin form POST).
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Origin": "null"}):
        r = httpx.post(url, headers={**bearer(FILE_KEY), **headers}, timeout=10)
        assert r.status_code == 403, r.text
        assert set(r.json()) == {"error", "error_type"}
    assert httpx.post(url, timeout=10).status_code == 401
    assert httpx.post(url, headers=bearer("wrong-key-0000"), timeout=10).status_code == 401
    assert daemon.status()["status"] == "running"            # still serving after all that
    same = daemon.mgmt.split("://", 1)[1]
    r = httpx.post(url, headers={**bearer(ENV_KEY), "Origin": f"http://{same}"}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "stopping"
    assert daemon.proc.wait(30) == 0
