"""The role API on the management plane (server/api/planes/pd_routes.py) with a PD instance and
a fake engine: no daemon.

By default (no ``apiKeys``) a role, its peers, its key and a KV release are taken only
from a caller holding the deployment's KV transfer key (a signed call, as the coordinator
sends) or an API key; a role taken purges what was loaded from peers before; bodies are
capped.  Before issue 58 anyone who reached the management port could post D a role
naming their own KV server and a key of their own.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.api.errors import install_error_handlers
from server.api.planes.pd_routes import MAX_BODY_BYTES, add_pd_routes
from server.pd import trust
from server.pd.instance import PDInstance, PDSettings
from server.web.api_keys import ApiKeys

RUNTIME = SimpleNamespace(num_kv_layers=2, block_size=4, kv_block_bytes=8,
                          kv_cache_dtype="bfloat16", mtp_enabled=True)
KEY = trust.new_key()
ATTACK = {"local": {"host_ip": "127.0.0.1"},
          "peers": [{"server_ip": "127.0.0.1", "kv_port": 9999}],
          "kv_transfer_key": trust.new_key().hex()}
ROLE = {"local": {"host_ip": "127.0.0.1"}, "peers": [{"server_ip": "127.0.0.1", "kv_port": 1500}]}


class FakeEngine:
    def __init__(self) -> None:
        self.purges: list[int] = []

    def purge_peer_blocks(self, epoch: int) -> None:
        self.purges.append(epoch)


def _client(key: bytes | None = KEY, api_keys: tuple[str, ...] = ()) -> TestClient:
    pd = PDInstance(PDSettings(None, (), "127.0.0.1", 1500, 2.0, 2.0, key), RUNTIME)
    state = SimpleNamespace(pd=pd, api_keys=ApiKeys(api_keys), engine=FakeEngine(),
                            settings=SimpleNamespace(body_timeout_s=5.0))
    app = FastAPI()
    install_error_handlers(app)
    add_pd_routes(app, state)
    client = TestClient(app)
    client.state = state
    return client


def _signed(key: bytes, path: str, body: dict) -> dict:
    content = json.dumps(body).encode()
    return {"content": content, "headers": {
        trust.CALL_HEADER: trust.sign_call(key, "POST", path, content),
        "content-type": "application/json"}}


def test_no_role_peers_or_key_without_a_credential():
    c = _client()
    path = "/v1/role/decode"
    for kw in ({"json": ATTACK},                                           # the probe's call
               {"json": ATTACK, "headers": {"Authorization": "Bearer anything"}},
               _signed(trust.new_key(), path, ATTACK),                      # another key
               {**_signed(KEY, path, ATTACK), "content": json.dumps(ROLE).encode()},  # replayed
               _signed(KEY, "/v1/role/prefill", ATTACK),                    # for another path
               {"json": ATTACK, "headers": {trust.CALL_HEADER: "é".encode("latin-1")}}):
        r = c.post(path, **kw)
        assert r.status_code == 401, (kw, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    pd = c.state.pd
    assert pd.roles.role is None and pd.roles.key == KEY and c.state.engine.purges == []
    assert c.post("/v1/kv/release", json={"remote_request_id": "x"}).status_code == 401
    # The coordinator's call: taken, and what was loaded from peers before is purged.
    r = c.post(path, **_signed(KEY, path, ROLE))
    assert r.status_code == 200 and r.json() == {"result": "ok"}
    assert pd.roles.role == "decode" and pd.roles.kv_ports_of("127.0.0.1", 1) == {1500}
    assert c.state.engine.purges == [pd.roles.version]
    r = c.post("/v1/kv/release", **_signed(KEY, "/v1/kv/release", {"remote_request_id": "x"}))
    assert r.status_code == 200 and r.json() == {"released": False}
    # A refused body changes nothing and purges nothing.
    r = c.post("/v1/role/flex", **_signed(KEY, "/v1/role/flex", ROLE))
    assert r.status_code == 503 and c.state.engine.purges == [1]


def test_an_instance_without_key_or_api_key_takes_no_role():
    c = _client(key=None)
    r = c.post("/v1/role/decode", json=ATTACK)
    assert r.status_code == 401 and "pdTransferKeyFile" in r.json()["error"]["message"]
    assert c.state.pd.roles.role is None


def test_an_api_key_holder_may_hand_over_the_key():
    c = _client(key=None, api_keys=("s3cret",))
    assert c.post("/v1/role/decode", json=ROLE).status_code == 401
    body = {**ROLE, "kv_transfer_key": KEY.hex()}
    r = c.post("/v1/role/decode", json=body, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and c.state.pd.roles.key == KEY
    # ... and from then on the key signs calls too.
    assert c.post("/v2/role/decode", **_signed(KEY, "/v2/role/decode", ROLE)).status_code == 200


def test_bodies_are_capped_and_cross_origin_calls_refused():
    c = _client()
    big = b"{" + b" " * MAX_BODY_BYTES + b"}"
    r = c.post("/v1/role/decode", content=big)
    assert r.status_code == 413
    r = c.post("/v1/role/decode", content=(chunk for chunk in [big[:600_000], big[600_000:]]))
    assert r.status_code == 413                               # streamed: cut past the cap
    assert c.post("/v1/role/decode", **_signed(KEY, "/v1/role/decode", ROLE)).status_code == 200
    r = c.post("/v1/role/decode", json=ROLE, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403


@pytest.mark.parametrize("content", [b"{not json", b"[" * 100_000])
def test_bad_json_is_still_422_once_authenticated(content):
    c = _client()
    headers = {trust.CALL_HEADER: trust.sign_call(KEY, "POST", "/v1/role/decode", content)}
    r = c.post("/v1/role/decode", content=content, headers=headers)
    assert r.status_code == 422 and "json" in r.json()["error"]
