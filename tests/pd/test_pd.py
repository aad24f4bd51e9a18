"""PD disaggregation through real daemons: 1 prefill + 1 decode instance + the coordinator.

Against a co-located daemon with the same MTP k on the demo model: identical answers
(greedy and seeded, streamed and not, tools and reasoning), the KV really moved (bytes
on both instances' /metrics, remote prefix hits on D), MTP acceptance on D equal to the
co-located daemon's; then faults: P gone (a pull fails: D computes the prompt itself and
the answer is unchanged; through the coordinator: a clear 503), D killed mid-stream (the
stream ends with an error event; P's pool is back to its start count).  And hostile
clients: rows a client offers D (unsigned, another prompt's, or from a fake KV server on
another port) never reach D's prefix cache, and P's exports stay within their bound; the
role-API poisoning of issue 58 (a role naming the attacker's KV server, posted without a
credential) is refused, rows whose digests were made without the key are not used even
from a peer, and a role change purges what D loaded from peers.

Every instance reads the deployment's KV transfer key from a file (``pdTransferKeyFile``,
``_key_file``: one per parent folder) and the coordinator reads P's: role calls are
signed with it.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.pd.kv_exports import KVExports
from server.pd.kv_server import KVServer
from server.pd.trust import CALL_HEADER, block_digests, key_id, new_key, sign_call, sign_params
from server.pd.wire import KVRows, layout_fields
from server.testing.daemon import (MODEL_NAME, ROOT, Daemon, demo_model_ready, free_port, make_config,
                                   start_all)
from server.text.tokenizer import Tokenizer
from tests.daemon.answers import LONG, QUESTIONS, answers, metric

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.demo,
              pytest.mark.skipif(not demo_model_ready(), reason="demo model not present")]
DEMO = ROOT / "models" / "deepseek-v3-tiny-mtp"
ENV = {"MTP_SERVE_COMPILE": "0"}


def _plugins(k: int, prefix_cache: bool = False) -> str:
    kinds = "mtp,prefix_cache" if prefix_cache else "mtp"
    return (f'{{"plugin_type":"{kinds}","num_speculative_tokens":{k},"adaptive_speculation":false}}'
            if k else "")


def _key_file(folder: Path) -> Path:
    path = folder / "kv-transfer.key"
    if not path.exists():
        path.write_text(new_key().hex())
    return path


def _pd_config(folder, role: str | None = None, peers=("127.0.0.1",), k: int = 1,
               key_file=None, prefix_cache: bool = False, **server_extra):
    """A PD instance's config; its key file ``key_file``, else the one of ``folder``'s
    parent (so instances made side by side share it)."""
    server = {"inferMode": "dmi", "interCommPort": free_port(), "interCommTLSEnabled": False,
              "pdTransferKeyFile": str(key_file or _key_file(Path(folder).parent)),
              **server_extra}
    if role:
        server.update(pdRole=role, pdPeers=list(peers))
    return make_config(folder, DEMO, model={"plugin_params": _plugins(k, prefix_cache)},
                       server=server, schedule={"cacheBlockSize": 16})


def _metric(d: Daemon, name: str, label: str = "") -> float:
    return metric(d.metrics, name, label)


def _key_of(d: Daemon) -> Path:
    return Path(json.loads(Path(d.config).read_text())["ServerConfig"]["pdTransferKeyFile"])


def _signed_post(d: Daemon, path: str, body: dict, key: bytes) -> httpx.Response:
    """A management call as the coordinator makes it: signed with the KV transfer key."""
    content = json.dumps(body).encode()
    return httpx.post(d.mgmt + path, content=content, timeout=10, headers={
        CALL_HEADER: sign_call(key, "POST", path, content), "content-type": "application/json"})


class Coordinator:
    """``python -m server.pd`` over ``p`` and ``d``, with P's key file (``key_file``)."""

    def __init__(self, folder, p: Daemon, d: Daemon, key_file=None) -> None:
        self.port = free_port()
        cfg = folder / "coordinator.json"
        doc = {"ipAddress": "127.0.0.1", "port": self.port,
               "prefill": [{"business": p.base, "management": p.mgmt}],
               "decode": [{"business": d.base, "management": d.mgmt}],
               "timeouts": {"connect": 5, "request": 120, "start": 120},
               "kvTransferKeyFile": str(key_file or _key_of(p))}
        cfg.write_text(json.dumps(doc))
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "server.pd", "--config-file", str(cfg)],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + 120
        for line in self.proc.stdout:
            if "Coordinator start success" in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("coordinator did not start")
        else:
            raise RuntimeError("coordinator exited")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("colocated")
    d = Daemon(make_config(folder, DEMO, model={"plugin_params": _plugins(1)},
                           schedule={"cacheBlockSize": 16}), env=ENV).start()
    try:
        ref = answers(d.base)
        return ref, (_metric(d, "spec_decode_num_draft_tokens_total"),
                         _metric(d, "spec_decode_num_accepted_tokens_total"))
    finally:
        assert d.terminate() == 0


MAX_EXPORTS = 6


@pytest.fixture(scope="module")
def pd_set(tmp_path_factory):
    # The test holds the deployment's key (as an operator's file) so it can sign params
    # the way the coordinator does; D's prefix cache is on, where poisoned rows would stay.
    key_file = _key_file(tmp_path_factory.mktemp("key"))
    p, d = start_all(Daemon(_pd_config(tmp_path_factory.mktemp("p"), key_file=key_file,
                                       pdMaxExports=MAX_EXPORTS), env=ENV),
                     Daemon(_pd_config(tmp_path_factory.mktemp("d"), key_file=key_file,
                                       prefix_cache=True), env=ENV))
    c = None
    try:
        c = Coordinator(tmp_path_factory.mktemp("c"), p, d, key_file)
        c.key = bytes.fromhex(key_file.read_text())
        yield p, d, c
    finally:
        if c is not None:
            c.stop()
        p.kill()
        d.kill()


def test_instance_without_role_refuses_and_role_api_checks_bodies(tmp_path):
    """Role bodies are checked once the call is authenticated (signed with the key)."""
    d = Daemon(_pd_config(tmp_path), env=ENV).start()
    key = bytes.fromhex(_key_of(d).read_text())
    try:
        r = httpx.post(d.base + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi",
                                                          "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "no role" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        content = b"{not json"
        assert httpx.post(d.mgmt + "/v1/role/decode", content=content, timeout=10, headers={
            CALL_HEADER: sign_call(key, "POST", "/v1/role/decode", content)}).status_code == 422
        r = _signed_post(d, "/v1/role/decode", {"local": {}, "peers": []}, key)
        assert r.status_code == 503 and "Update pd info failed" in r.json()["error"]
        flex = {"local": {}, "peers": [{"host_ip": "127.0.0.1"}]}
        r = _signed_post(d, "/v1/role/flex", flex, key)
        assert r.status_code == 503 and "flex" in r.json()["error"]
        body = {"local": [{"host_ip": "127.0.0.1", "dp_inst_list": []}],
                "peers": [[{"host_ip": "127.0.0.3", "dp_inst_list": []}]]}
        assert httpx.post(d.mgmt + "/v2/role/decode", json=body, timeout=10).status_code == 401
        r = _signed_post(d, "/v2/role/decode", body, key)
        assert r.status_code == 200 and r.json() == {"result": "ok"}
        assert d.status()["pd"]["role"] == "decode" and d.status()["pd"]["peers"] == ["127.0.0.3"]
        # A decode instance pulls only from its peers, whatever a body names.
        r = httpx.post(d.base + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "kv_transfer_params": {
                "remote_host": "127.0.0.9", "remote_port": 1, "remote_request_id": "x"}}, timeout=10)
        # ... and only what the coordinator signed.
        assert r.status_code == 400 and "signed" in r.json()["error"]["message"]
        # 300 MB pushed P from 612 to 1,303 MB: a management body over 1 MB is refused.
        r = httpx.post(d.mgmt + "/v1/role/decode", content=b" " * (2 << 20), timeout=10)
        assert r.status_code == 413
    finally:
        assert d.terminate() == 0


def test_pd_answers_like_colocated_and_moves_the_kv(pd_set, colocated):
    p, d, c = pd_set
    ref, ref_acceptance = colocated
    p_free = p.wait_kv_free()["kv_cache"]["free_blocks"]
    assert answers(c.base) == ref
    sent, received = _metric(p, "kv_transfer_bytes_total", 'direction="sent"'), \
        _metric(d, "kv_transfer_bytes_total", 'direction="received"')
    assert sent == received > 0
    assert _metric(p, "kv_transfers_total", 'direction="sent"') == \
        _metric(d, "kv_transfers_total", 'direction="received"') >= 12
    assert _metric(d, "prefix_cache_hit_tokens_total", 'tier="remote"') > 0
    assert _metric(d, "kv_transfer_failures_total") == 0
    # MTP acceptance on D equals the co-located daemon's (fixed k: same drafts, same checks).
    assert (_metric(d, "spec_decode_num_draft_tokens_total"),
            _metric(d, "spec_decode_num_accepted_tokens_total")) == ref_acceptance
    assert p.wait_kv_free()["kv_cache"]["free_blocks"] == p_free
    d.wait_kv_free()
    assert p.status()["pd"]["exports_held"] == 0


def test_a_pull_from_a_gone_prefill_instance_falls_back_to_computing(pd_set, colocated):
    """D is handed signed params for rows P does not hold (as after P died mid-transfer):
    the failure is counted and D computes the prompt; the answer is the co-located one."""
    p, d, c = pd_set
    ref, _ = colocated
    kv_port = p.status()["pd"]["kv_port"]
    before = _metric(d, "kv_transfer_failures_total")
    client = openai.OpenAI(base_url=d.base + "/v1", api_key="none", timeout=60, max_retries=0)
    params = sign_params(c.key, {"remote_host": "127.0.0.1", "remote_port": kv_port,
                                 "remote_request_id": "cmpl-never-prefilled"})
    r = client.completions.create(model=MODEL_NAME, prompt=LONG, max_tokens=24, temperature=0,
                                  extra_body={"kv_transfer_params": params})
    assert r.choices[0].text == ref[3 * len(QUESTIONS)]
    assert _metric(d, "kv_transfer_failures_total") == before + 1
    d.wait_kv_free()


OTHER = ("Write a long poem about the sea, the wind and the ships that sail between the "
         "islands at night, and about the lighthouse keeper who watches over all of them.")


def _export(p: Daemon, prompt: str) -> dict:
    """What any client can get: P prefills a prompt and names its export."""
    r = httpx.post(p.base + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _ask_d(d: Daemon, prompt: str, params: dict | None) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(d.base + "/v1/completions", json=body, timeout=60)


def test_rows_a_client_offers_never_reach_the_decode_cache(pd_set, colocated):
    """The attacks of the hostile-client review, each ending with a victim asking D (and
    the coordinator) for the attacked prompt and getting the co-located answer."""
    p, d, c = pd_set
    ref, _ = colocated
    want = ref[3 * len(QUESTIONS)]                  # LONG's completion, co-located
    # (1) P's real export of another prompt, as a client offers it: no signature.
    unsigned = _export(p, OTHER)
    r = _ask_d(d, LONG, unsigned)
    assert r.status_code == 400 and "signed" in r.json()["error"]["message"]
    # (2) The same export signed (as if the coordinator had been fooled): D checks the
    # rows' block digests against LONG's tokens and uses none of them.
    params = _export(p, OTHER)
    r = _ask_d(d, LONG, sign_params(c.key, params))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert _metric(d, "kv_transfer_failures_total", 'reason="prompt_mismatch"') >= 1
    n_prompt = r.json()["usage"]["prompt_tokens"]
    # (3) A fake KV server on another port of the peer's address, serving rows of D's
    # layout whose digests claim LONG: refused before any pull.
    layout = d.status()["pd"]["layout"]
    block_bytes = int(dict(part.split("=", 1) for part in layout.split(";")[1:])["bytes"])
    exports = KVExports(30)
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = KVServer(exports)
    loop.run_until_complete(server.start(sock))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        n = (n_prompt - 1) // 16
        exports.reserve("fake", n * block_bytes, tuple(block_digests(c.key, [0] * n_prompt, 16, n)))
        exports.put("fake", KVRows(n, block_bytes, layout, b"\x7f" * (n * block_bytes)))
        params = sign_params(c.key, {"remote_host": "127.0.0.1",
                                     "remote_port": sock.getsockname()[1],
                                     "remote_request_id": "fake"})
        r = _ask_d(d, LONG, params)
        assert r.status_code == 400 and "not the KV port" in r.json()["error"]["message"]
        assert exports.num_held == 1                                  # never pulled
    finally:
        loop.call_soon_threadsafe(loop.stop)
    # The victims: LONG from another client, directly and through the coordinator.
    for base in (d.base, c.base):
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": LONG, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    d.wait_kv_free()
    release = {"remote_request_id": unsigned["remote_request_id"]}   # (1)'s, never pulled
    assert httpx.post(p.mgmt + "/v1/kv/release", json=release, timeout=10).status_code == 401
    assert _signed_post(p, "/v1/kv/release", release, c.key).json() == {"released": True}


def test_exports_are_bounded_and_freed_when_decode_refuses(pd_set):
    p, d, c = pd_set
    ids = []
    codes = []
    for _ in range(MAX_EXPORTS + 3):                 # nobody pulls these
        r = httpx.post(p.base + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": LONG, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})
        codes.append(r.status_code)
        if r.status_code == 200:
            ids.append(r.json()["kv_transfer_params"]["remote_request_id"])
    pd = p.status()["pd"]
    assert pd["exports_held"] <= MAX_EXPORTS and codes.count(503) >= 3
    assert pd["exports_refused"] >= 3
    assert all(r == 503 for r in codes[-3:])
    for rid in ids:                                  # the coordinator's release call
        r = _signed_post(p, "/v1/kv/release", {"remote_request_id": rid}, c.key)
        assert r.status_code == 200 and r.json() == {"released": True}
    assert p.status()["pd"]["exports_held"] == 0
    # Through the coordinator: P accepts, D refuses (min_tokens > max_tokens): the export
    # is released at once, not after its expiry.
    r = httpx.post(c.base + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": LONG, "max_tokens": 2, "min_tokens": 5})
    assert r.status_code == 400
    t0 = time.monotonic()
    while p.status()["pd"]["exports_held"] and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert p.status()["pd"]["exports_held"] == 0


FRESH = ("Describe the old clock tower in the town square, who winds it every morning, and "
         "what the children believe happens inside it when it strikes midnight.")


def _plain_digests(tokens: list[int], n: int) -> tuple[str, ...]:
    """Block digests as they were before issue 58: plain BLAKE2b over the prompt's tokens,
    which anyone who knows the prompt can compute."""
    out, parent = [], b""
    for b in range(n):
        h = hashlib.blake2b(parent, digest_size=16)
        chunk = tokens[b * 16:(b + 1) * 16 + 1]
        h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in chunk))
        parent = h.digest()
        out.append(parent.hex())
    return tuple(out)


def _cached(d: Daemon, prompt: str) -> int:
    """Prompt tokens a request for ``prompt`` found in D's prefix cache."""
    r = httpx.post(d.base + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_role_api_poisoning_is_replayed_end_to_end(pd_set, colocated):
    """Issue 58's probe against 1 P + 1 D + the coordinator, then its victims.  The
    attacker runs a KV server answering random rows with the right plain digests of a
    prompt, posts D a role naming it (with a key of its own), and signs params with that
    key.  Then, as if it had got that role in anyway (the test holds the key and posts
    it), D pulls its rows and uses none; the role change purged what D had loaded from P;
    the coordinator posts its own role back.  A victim's answers equal a plain daemon's."""
    p, d, c = pd_set
    ref, _ = colocated
    want_long = ref[3 * len(QUESTIONS)]
    want_fresh = _ask_d(p, FRESH, None).json()["choices"][0]["text"]   # P serves it plainly
    tokens = Tokenizer.from_dir(DEMO).encode(FRESH, add_special_tokens=True)
    layout = d.status()["pd"]["layout"]
    block_bytes = int(layout_fields(layout)["bytes"])
    n = (len(tokens) - 1) // 16
    exports = KVExports(30)
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    server = KVServer(exports)
    loop.run_until_complete(server.start(sock))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    evil_key = new_key()
    paused = False
    try:
        exports.reserve("evil", n * block_bytes, _plain_digests(tokens, n))
        exports.put("evil", KVRows(n, block_bytes, layout, os.urandom(n * block_bytes)))
        # (1) The probe's role post: no credential.  It was 200.
        evil_role = {"local": {"host_ip": "127.0.0.1"},
                     "peers": [{"server_ip": "127.0.0.1", "kv_port": port}]}
        r = httpx.post(d.mgmt + "/v1/role/decode", timeout=10,
                       json={**evil_role, "kv_transfer_key": evil_key.hex()})
        assert r.status_code == 401, r.text
        st = d.status()["pd"]
        assert st["kv_transfer_key_id"] == key_id(c.key)
        assert port not in st["peer_kv_ports"]["127.0.0.1"]
        # (2) Params signed with its own key, naming its server: refused, nothing pulled.
        evil = {"remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "evil"}
        r = _ask_d(d, FRESH, sign_params(evil_key, evil))
        assert r.status_code == 400 and exports.num_held == 1
        # (3) D holds OTHER's blocks, loaded from P through the coordinator ...
        r = httpx.post(c.base + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": OTHER, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and _cached(d, OTHER) > 0
        # ... until a role change: the attacker's server as D's peer, posted with the key.
        # The coordinator is paused meanwhile: its health pass (every 2 s) would post its own
        # role back before a slow machine got the pull below to D.
        c.proc.send_signal(signal.SIGSTOP)
        paused = True
        assert _signed_post(d, "/v1/role/decode", evil_role, c.key).status_code == 200
        assert _cached(d, OTHER) == 0                   # purged, and what was computed on them
        mismatch = _metric(d, "kv_transfer_failures_total", 'reason="prompt_mismatch"')
        remote = _metric(d, "prefix_cache_hit_tokens_total", 'tier="remote"')
        r = _ask_d(d, FRESH, sign_params(c.key, evil))
        assert r.status_code == 200 and exports.num_held == 0              # pulled ...
        assert r.json()["choices"][0]["text"] == want_fresh                # ... not used
        assert _metric(d, "kv_transfer_failures_total", 'reason="prompt_mismatch"') == mismatch + 1
        assert _metric(d, "prefix_cache_hit_tokens_total", 'tier="remote"') == remote
        # (4) The coordinator sees a role it did not post and posts its own again.
        c.proc.send_signal(signal.SIGCONT)
        paused = False
        p_port = p.status()["pd"]["kv_port"]
        t0 = time.monotonic()
        while d.status()["pd"]["peer_kv_ports"].get("127.0.0.1") != [p_port]:
            assert time.monotonic() - t0 < 15, d.status()["pd"]
            time.sleep(0.1)
    finally:
        if paused:
            c.proc.send_signal(signal.SIGCONT)
        loop.call_soon_threadsafe(loop.stop)
    # The victims, directly on D and through the coordinator.
    for base in (d.base, c.base):
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": LONG, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want_long
    assert _ask_d(d, FRESH, None).json()["choices"][0]["text"] == want_fresh
    d.wait_kv_free()


def test_dead_decode_instance_ends_the_stream_with_an_error_then_dead_prefill_is_a_503(pd_set):
    p, d, c = pd_set
    p_free = p.wait_kv_free()["kv_cache"]["free_blocks"]
    with httpx.stream("POST", c.base + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": LONG, "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "choices" in first
        d.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - t0 < 30
    assert "failed mid-stream" in rest[-1]
    assert p.wait_kv_free()["kv_cache"]["free_blocks"] == p_free     # nothing leaked on P
    assert httpx.get(c.base + "/health", timeout=5).status_code == 503
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait(10)
    t0 = time.monotonic()
    r = httpx.post(c.base + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    # D died first: the coordinator knows no decode instance is up and prefills nothing.
    msg = r.json()["error"]["message"]
    assert r.status_code == 503 and ("no prefill instance" in msg or "no decode instance" in msg)
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("k", [0, 2])
def test_pd_answers_like_colocated_mtp_off_and_k2(tmp_path, k):
    """Fixed roles from the config (pdRole / pdPeers) this time."""
    for sub in ("ref", "p", "d"):
        (tmp_path / sub).mkdir()
    ref_d, p, d = start_all(
        Daemon(make_config(tmp_path / "ref", DEMO, model={"plugin_params": _plugins(k)},
                           schedule={"cacheBlockSize": 16}), env=ENV),
        Daemon(_pd_config(tmp_path / "p", "prefill", k=k), env=ENV),
        Daemon(_pd_config(tmp_path / "d", "decode", k=k), env=ENV))
    try:
        ref = answers(ref_d.base)
        ref_acc = _metric(ref_d, "spec_decode_num_accepted_tokens_total")
    finally:
        assert ref_d.terminate() == 0
    c = None
    try:
        c = Coordinator(tmp_path, p, d)
        assert answers(c.base) == ref
        assert _metric(d, "kv_transfer_bytes_total", 'direction="received"') > 0
        assert _metric(d, "spec_decode_num_accepted_tokens_total") == ref_acc
    finally:
        if c is not None:
            c.stop()
        p.kill()
        d.kill()
