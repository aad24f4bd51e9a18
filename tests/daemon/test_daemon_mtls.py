"""TLS on every plane with its own MindIE keys, mutual TLS, a CRL and an encrypted key.

The daemon: business on 127.0.0.1 (certificate from CA1, key encrypted, password in
tlsPkPwd, clients must hold a CA1 certificate, CA1's CRL revokes one), management and
metrics on 127.0.0.2 with their own certificates from CA2 and CA2 client certificates
(MindIE: another managementIpAddress means the management keys are used).  Start-up
failures (wrong or missing password, missing CA file) are checked without a model load.
"""
from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.testing.daemon import MODEL_NAME, ROOT, Daemon, free_port, make_config
from tests.daemon.tls_certs import KEY_PASSWORD, Pki, make_pki

pytestmark = pytest.mark.slow          # starts a real daemon


def _layout(folder: Path, pki: Pki, password: str | None = KEY_PASSWORD) -> dict:
    """Copy the PKI into MindIE's folder layout under ``folder``; the ServerConfig keys."""
    files = {"security/certs/server.pem": pki.server[0], "security/keys/server.key.pem": pki.server[1],
             "security/ca/ca.pem": pki.ca1, "security/ca/management_ca.pem": pki.ca2,
             "security/ca/metrics_ca.pem": pki.ca2, "security/certs/server_crl.pem": pki.crl1,
             "security/certs/management/server.pem": pki.mgmt[0],
             "security/keys/management/server.key.pem": pki.mgmt[1],
             "security/certs/metrics/server.pem": pki.metrics[0],
             "security/keys/metrics/server.key.pem": pki.metrics[1]}
    for rel, src in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, folder / rel)
    if password is not None:
        (folder / "security/pass").mkdir(parents=True, exist_ok=True)
        (folder / "security/pass/key_pwd.txt").write_text(password + "\n")
    mport = free_port()
    return {"httpsEnabled": True, "managementIpAddress": "127.0.0.2", "managementPort": mport,
            "metricsPort": free_port(),
            # Written out, as in MindIE's shipped file: CA and CRL keys set = mutual TLS.
            "tlsCaPath": "security/ca/", "tlsCaFile": ["ca.pem"],
            "tlsCrlPath": "security/certs/", "tlsCrlFiles": ["server_crl.pem"],
            "managementTlsCaFile": ["management_ca.pem"],
            "metricsTlsCaFile": ["metrics_ca.pem"]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def daemon(tiny_weights, pki, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtls")
    server = _layout(folder, pki)
    cfg = make_config(folder, tiny_weights, server=server, same_mgmt_metrics=False)
    d = Daemon(cfg).start()
    d.mgmt = f"https://127.0.0.2:{server['managementPort']}"
    d.metrics = f"https://127.0.0.2:{server['metricsPort']}"
    yield d
    d.terminate()
    assert d.proc.returncode == 0


def client_ctx(ca: Path, cert: tuple[Path, Path] | None = None,
               max_version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    if max_version is not None:
        ctx.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
        ctx.maximum_version = max_version
    return ctx


def _get(url: str, ctx: ssl.SSLContext | bool) -> httpx.Response:
    with httpx.Client(verify=ctx, timeout=15) as c:
        return c.get(url)


def _planes(d: Daemon, pki: Pki) -> list[tuple[str, str, Path, tuple]]:
    return [("business", d.base + "/v1/models", pki.ca1, pki.client1),
            ("management", d.mgmt + "/v1/config", pki.ca2, pki.client2),
            ("metrics", d.metrics + "/metrics", pki.ca2, pki.client2)]


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated")
@pytest.mark.parametrize("plane", ["business", "management", "metrics"])
def test_plane_matrix(daemon, pki, plane):
    name, url, ca, good = next(p for p in _planes(daemon, pki) if p[0] == plane)
    # Plain HTTP on a TLS port: refused.
    with pytest.raises(httpx.TransportError):
        _get(url.replace("https://", "http://"), False)
    # TLS, and the plane presents its own certificate (verified against its own CA only).
    r = _get(url, client_ctx(ca, good))
    assert r.status_code == 200, r.text
    # mTLS enforced: no client certificate, or one from an unknown CA, is refused.
    for cert in (None, pki.stranger):
        with pytest.raises((httpx.TransportError, ssl.SSLError)):
            _get(url, client_ctx(ca, cert))
    # Another plane's CA does not vouch for this plane's certificate.
    other = pki.ca2 if ca == pki.ca1 else pki.ca1
    with pytest.raises(httpx.TransportError):
        _get(url, client_ctx(other, pki.client1 if other == pki.ca1 else pki.client2))
    # TLS 1.2 works; 1.1 or older is refused (whatever the local OpenSSL still offers).
    assert _get(url, client_ctx(ca, good, max_version=ssl.TLSVersion.TLSv1_2)).status_code == 200
    with pytest.raises((httpx.TransportError, ssl.SSLError)):
        _get(url, client_ctx(ca, good, max_version=ssl.TLSVersion.TLSv1_1))


def test_revoked_client_certificate_is_refused(daemon, pki):
    with pytest.raises(httpx.TransportError):
        _get(daemon.base + "/v1/models", client_ctx(pki.ca1, pki.revoked))


def test_chat_over_mutual_tls(daemon, pki):
    with httpx.Client(verify=client_ctx(pki.ca1, pki.client1), timeout=60) as c:
        r = c.post(daemon.base + "/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


# ---- start-up refusals: before the checkpoint, before any port, never a prompt ---------

def _start(cfg: Path) -> subprocess.CompletedProcess:
    """Run the daemon with a live (empty, open) stdin: a password prompt would hang it."""
    return subprocess.run([sys.executable, "-m", "server", "--config-file", str(cfg)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          input="")


@pytest.fixture
def broken_weights(tiny_weights, tmp_path):
    """A checkpoint that cannot load: the TLS error must come first."""
    dst = tmp_path / "broken-ckpt"
    shutil.copytree(tiny_weights, dst)
    for f in dst.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    return dst


@pytest.mark.parametrize("case", ["wrong-password", "missing-password", "missing-ca"])
def test_tls_start_up_errors_name_the_file(pki, tmp_path, broken_weights, case):
    server = _layout(tmp_path, pki, password="not-the-password" if case == "wrong-password" else None)
    if case == "missing-ca":
        (tmp_path / "security/pass").mkdir(parents=True, exist_ok=True)
        (tmp_path / "security/pass/key_pwd.txt").write_text(KEY_PASSWORD)
        server["tlsCaFile"] = ["ca.pem", "other_ca.pem"]
    cfg = make_config(tmp_path, broken_weights, server=server, same_mgmt_metrics=False)
    proc = _start(cfg)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Daemon start success!" not in out and "PEM pass phrase" not in out
    expected = {"wrong-password": ("tlsPkPwd", "security/pass/key_pwd.txt", "wrong password"),
                "missing-password": ("tlsPkPwd", "server.key.pem", "encrypted"),
                "missing-ca": ("tlsCaFile", "security/ca/other_ca.pem", "not found")}[case]
    for word in expected:
        assert word in proc.stderr, proc.stderr
    assert "safetensors" not in out.lower() and "checkpoint" not in out.lower()


def test_planes_on_one_address_must_share_tls_files(pki, tmp_path, broken_weights):
    server = _layout(tmp_path, pki)
    server["metricsPort"] = server["managementPort"]
    server["managementTlsCert"] = "security/certs/management/server.pem"
    server["metricsTlsCert"] = "security/certs/metrics/server.pem"
    cfg = make_config(tmp_path, broken_weights, server=server)
    doc = json.loads(cfg.read_text())
    doc["ServerConfig"]["metricsPort"] = doc["ServerConfig"]["managementPort"]
    cfg.write_text(json.dumps(doc))
    proc = _start(cfg)
    assert proc.returncode == 1 and "share 127.0.0.2" in proc.stderr, proc.stderr
