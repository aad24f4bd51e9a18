"""PD disaggregation through real daemons: 1 prefill + 1 decode instance + the coordinator.

Against a co-located daemon with the same MTP k on the demo model: identical answers
(greedy and seeded, streamed and not, tools and reasoning), the KV really moved (bytes
on both instances' /metrics, remote prefix hits on D), MTP acceptance on D equal to the
co-located daemon's; then faults: P gone (a pull fails: D computes the prompt itself and
the answer is unchanged; through the coordinator: a clear 503), D killed mid-stream (the
stream ends with an error event; P's pool is back to its start count).  And hostile
clients: rows a client offers D (unsigned, another prompt's, or from a fake KV server on
another port) never reach D's prefix cache, and P's exports stay within their bound.
"""
from __future__ import annotations

import asyncio
import json
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
from server.pd.trust import block_digests, new_key, sign_params
from server.pd.wire import KVRows
from server.testing.daemon import (MODEL_NAME, ROOT, Daemon, demo_model_ready, free_port, make_config,
                                   start_all)
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
    server = {"inferMode": "dmi", "interCommPort": free_port(), "interCommTLSEnabled": False,
              **server_extra}
    if role:
        server.update(pdRole=role, pdPeers=list(peers))
    if key_file is not None:
        server["pdTransferKeyFile"] = str(key_file)
    return make_config(folder, DEMO, model={"plugin_params": _plugins(k, prefix_cache)},
                       server=server, schedule={"cacheBlockSize": 16})


def _metric(d: Daemon, name: str, label: str = "") -> float:
    return metric(d.metrics, name, label)


class Coordinator:
    def __init__(self, folder, p: Daemon, d: Daemon, key_file=None) -> None:
        self.port = free_port()
        cfg = folder / "coordinator.json"
        doc = {"ipAddress": "127.0.0.1", "port": self.port,
               "prefill": [{"business": p.base, "management": p.mgmt}],
               "decode": [{"business": d.base, "management": d.mgmt}],
               "timeouts": {"connect": 5, "request": 120, "start": 120}}
        if key_file is not None:
            doc["kvTransferKeyFile"] = str(key_file)
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
    d = Daemon(_pd_config(tmp_path), env=ENV).start()
    try:
        r = httpx.post(d.base + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi",
                                                          "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "no role" in r.json()["error"]["message"]
        assert httpx.post(d.mgmt + "/v1/role/decode", content=b"{not json",
                          timeout=10).status_code == 422
        r = httpx.post(d.mgmt + "/v1/role/decode", json={"local": {}, "peers": []}, timeout=10)
        assert r.status_code == 503 and "Update pd info failed" in r.json()["error"]
        r = httpx.post(d.mgmt + "/v1/role/flex", json={"local": {}, "peers": [{"host_ip": "127.0.0.1"}]},
                       timeout=10)
        assert r.status_code == 503 and "flex" in r.json()["error"]
        body = {"local": [{"host_ip": "127.0.0.1", "dp_inst_list": []}],
                "peers": [[{"host_ip": "127.0.0.3", "dp_inst_list": []}]]}
        r = httpx.post(d.mgmt + "/v2/role/decode", json=body, timeout=10)
        assert r.status_code == 200 and r.json() == {"result": "ok"}
        assert d.status()["pd"]["role"] == "decode" and d.status()["pd"]["peers"] == ["127.0.0.3"]
        # A decode instance pulls only from its peers, whatever a body names.
        r = httpx.post(d.base + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "kv_transfer_params": {
                "remote_host": "127.0.0.9", "remote_port": 1, "remote_request_id": "x"}}, timeout=10)
        # ... and only what the coordinator signed: this instance holds no key yet.
        assert r.status_code == 400 and "key" in r.json()["error"]["message"]
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
        exports.reserve("fake", n * block_bytes, tuple(block_digests([0] * n_prompt, 16, n)))
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
    r = httpx.post(p.mgmt + "/v1/kv/release", timeout=10,       # (1)'s export, never pulled
                   json={"remote_request_id": unsigned["remote_request_id"]})
    assert r.json() == {"released": True}


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
    for rid in ids:                                  # the coordinator's release call
        r = httpx.post(p.mgmt + "/v1/kv/release", json={"remote_request_id": rid}, timeout=10)
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
