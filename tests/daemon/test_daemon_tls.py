"""httpsEnabled: refuse to start without the files, serve TLS with them; three separate ports.

The TLS daemon also runs with MIES_SERVICE_MONITOR_MODE=0 (metrics off) and the metrics
plane on its own port.
"""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from server.testing.daemon import MODEL_NAME, ROOT, Daemon, make_config

pytestmark = pytest.mark.slow          # starts a real daemon


def test_https_without_cert_refuses_to_start(tiny_weights, tmp_path):
    cfg = make_config(tmp_path, tiny_weights, server={"httpsEnabled": True})
    proc = subprocess.run([sys.executable, "-m", "server", "--config-file", str(cfg)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Daemon start success!" not in proc.stdout
    assert "tlsCert" in proc.stderr and str(tmp_path) in proc.stderr


@pytest.fixture(scope="module")
def tls_daemon(tiny_weights, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    (folder / "security" / "certs").mkdir(parents=True)
    (folder / "security" / "keys").mkdir(parents=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:3072", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(folder / "security/keys/server.key.pem"),
                    "-out", str(folder / "security/certs/server.pem")],
                   check=True, capture_output=True, timeout=120)
    # tlsCaFile []: no client certificates (test_daemon_mtls.py checks mutual TLS).
    cfg = make_config(folder, tiny_weights, server={"httpsEnabled": True, "tlsCaFile": []},
                      same_mgmt_metrics=False)
    d = Daemon(cfg, env={"MIES_SERVICE_MONITOR_MODE": "0"}).start()
    yield d
    assert d.terminate() == 0


def test_https_serves_all_planes(tls_daemon):
    d = tls_daemon
    assert d.base.startswith("https://") and len({d.base, d.mgmt, d.metrics}) == 3
    with httpx.Client(verify=False, timeout=60) as c:
        assert c.get(d.base + "/v1/models").json()["data"][0]["id"] == MODEL_NAME
        r = c.post(d.base + "/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
        assert c.get(d.mgmt + "/v1/status").json()["status"] == "running"
        metrics = c.get(d.metrics + "/metrics")
    # Monitoring off: MindIE answers 500 in its own error shape.
    assert metrics.status_code == 500
    assert set(metrics.json()) == {"error", "error_type"}
    with pytest.raises(httpx.TransportError):
        httpx.get(d.base.replace("https", "http") + "/health", timeout=5)
