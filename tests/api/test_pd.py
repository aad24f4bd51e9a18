"""PD disaggregation through real daemons: 1 prefill + 1 decode instance + the coordinator.

Against a co-located daemon with the same MTP k on the demo model: identical answers
(greedy and seeded, streamed and not, tools and reasoning), the KV really moved (bytes
on both instances' /metrics, remote prefix hits on D), MTP acceptance on D equal to the
co-located daemon's; then faults: P gone (a pull fails: D computes the prompt itself and
the answer is unchanged; through the coordinator: a clear 503), D killed mid-stream (the
stream ends with an error event; P's pool is back to its start count).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from answers import LONG, QUESTIONS, answers, metric
from daemon_proc import MODEL_NAME, ROOT, Daemon, demo_model_ready, free_port, make_config

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.demo,
              pytest.mark.skipif(not demo_model_ready(), reason="demo model not present")]
DEMO = ROOT / "models" / "deepseek-v3-tiny-mtp"
ENV = {"MTP_SERVE_COMPILE": "0"}


def _plugins(k: int) -> str:
    return (f'{{"plugin_type":"mtp","num_speculative_tokens":{k},"adaptive_speculation":false}}'
            if k else "")


def _pd_config(folder, role: str | None = None, peers=("127.0.0.1",), k: int = 1):
    server = {"inferMode": "dmi", "interCommPort": free_port(), "interCommTLSEnabled": False}
    if role:
        server.update(pdRole=role, pdPeers=list(peers))
    return make_config(folder, DEMO, model={"plugin_params": _plugins(k)}, server=server,
                       schedule={"cacheBlockSize": 16})


def _metric(d: Daemon, name: str, label: str = "") -> float:
    return metric(d.metrics, name, label)


class Coordinator:
    def __init__(self, folder, p: Daemon, d: Daemon) -> None:
        self.port = free_port()
        cfg = folder / "coordinator.json"
        cfg.write_text(json.dumps({
            "ipAddress": "127.0.0.1", "port": self.port,
            "prefill": [{"business": p.base, "management": p.mgmt}],
            "decode": [{"business": d.base, "management": d.mgmt}],
            "timeouts": {"connect": 5, "request": 120, "start": 120}}))
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


@pytest.fixture(scope="module")
def pd_set(tmp_path_factory):
    p = Daemon(_pd_config(tmp_path_factory.mktemp("p")), env=ENV).start()
    d = Daemon(_pd_config(tmp_path_factory.mktemp("d")), env=ENV).start()
    c = None
    try:
        c = Coordinator(tmp_path_factory.mktemp("c"), p, d)
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
        assert r.status_code == 400 and "not a peer" in r.json()["error"]["message"]
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
    """D is handed params for rows P does not hold (as after P died mid-transfer): the
    failure is counted and D computes the prompt; the answer is the co-located one."""
    p, d, c = pd_set
    ref, _ = colocated
    kv_port = p.status()["pd"]["kv_port"]
    before = _metric(d, "kv_transfer_failures_total")
    client = openai.OpenAI(base_url=d.base + "/v1", api_key="none", timeout=60, max_retries=0)
    r = client.completions.create(model=MODEL_NAME, prompt=LONG, max_tokens=24, temperature=0,
                                  extra_body={"kv_transfer_params": {
                                      "remote_host": "127.0.0.1", "remote_port": kv_port,
                                      "remote_request_id": "cmpl-never-prefilled"}})
    assert r.choices[0].text == ref[3 * len(QUESTIONS)]
    assert _metric(d, "kv_transfer_failures_total") == before + 1
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
    assert r.status_code == 503 and "no prefill instance" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("k", [0, 2])
def test_pd_answers_like_colocated_mtp_off_and_k2(tmp_path, k):
    """Fixed roles from the config (pdRole / pdPeers) this time."""
    for sub in ("ref", "p", "d"):
        (tmp_path / sub).mkdir()
    ref_d = Daemon(make_config(tmp_path / "ref", DEMO, model={"plugin_params": _plugins(k)},
                               schedule={"cacheBlockSize": 16}), env=ENV).start()
    try:
        ref = answers(ref_d.base)
        ref_acc = _metric(ref_d, "spec_decode_num_accepted_tokens_total")
    finally:
        assert ref_d.terminate() == 0
    p = Daemon(_pd_config(tmp_path / "p", "prefill", k=k), env=ENV).start()
    d = Daemon(_pd_config(tmp_path / "d", "decode", k=k), env=ENV).start()
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
