"""TLS on the KV link between PD instances (interCommTLSEnabled, the interComm* keys).

P's KV server demands a client certificate from the CA files; D checks P's certificate
(IP address included) and presents its own.  A client without a certificate, with one
from an unknown CA, or with a revoked one gets no KV; an encrypted key without its
password file is a start-up error naming the key.
"""
from __future__ import annotations

import asyncio
import socket
import ssl

import pytest

from server.config import load_config
from server.pd.kv_client import pull_kv
from server.pd.kv_exports import KVExports
from server.pd.kv_server import KVServer
from server.pd.tls import kv_link_contexts
from server.pd.wire import KVRows, TransferError
from server.testing.daemon import make_config, tiny_checkpoint
from server.web.tls_files import TlsError
from tests.daemon.tls_certs import KEY_PASSWORD, _leaf, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    pki = make_pki(folder)
    # One certificate per instance serves both ends of the link (MindIE: interCommTlsCert).
    pki.link = _leaf(folder, "link", (pki.ca1, folder / "ca1.key"),
                     "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth")
    return pki


def _cfg(tmp_path, pki, **extra):
    weights = tiny_checkpoint(tmp_path / "w")
    server = {"inferMode": "dmi", "interCommPort": 1399, "interCommTLSEnabled": True,
              "interCommTlsCert": str(pki.link[0]), "interCommPk": str(pki.link[1]),
              "interCommTlsCaPath": str(pki.ca1.parent), "interCommTlsCaFiles": [pki.ca1.name],
              "interCommTlsCrlPath": str(pki.crl1.parent), "interCommTlsCrlFiles": [pki.crl1.name],
              **extra}
    return load_config(make_config(tmp_path, weights, server=server), env={})


def _client(pki, cert=None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(pki.ca1))
    if cert is not None:
        ctx.load_cert_chain(*map(str, cert))
    return ctx


async def _pull(server_ctx, client_ctx) -> bytes:
    ex = KVExports(30)
    ex.reserve("r", 6)
    ex.put("r", KVRows(2, 3, "L", b"abcdef"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    srv = KVServer(ex)
    await srv.start(sock, server_ctx)
    try:
        rows = await pull_kv("127.0.0.1", sock.getsockname()[1], "r", connect_timeout_s=5,
                             transfer_timeout_s=5, ssl_ctx=client_ctx)
        return rows.payload
    finally:
        await srv.close()


def test_mutual_tls_link(tmp_path, pki):
    server_ctx, client_ctx = kv_link_contexts(_cfg(tmp_path, pki))
    assert server_ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert asyncio.run(_pull(server_ctx, client_ctx)) == b"abcdef"
    for who in (None, pki.stranger, pki.revoked):       # no cert, unknown CA, revoked
        with pytest.raises(TransferError):
            asyncio.run(_pull(server_ctx, _client(pki, who)))
    with pytest.raises(TransferError):                   # and plain TCP gets nothing either
        asyncio.run(_pull(server_ctx, None))


def test_encrypted_key_without_password_is_a_start_error(tmp_path, pki):
    cfg = _cfg(tmp_path, pki, interCommPk=str(pki.server[1]), interCommTlsCert=str(pki.server[0]))
    with pytest.raises(TlsError, match="interCommPk .* is encrypted"):
        kv_link_contexts(cfg)
    pwd = tmp_path / "pwd.txt"
    pwd.write_text(KEY_PASSWORD)
    cfg = _cfg(tmp_path, pki, interCommPk=str(pki.server[1]), interCommTlsCert=str(pki.server[0]),
               interCommPkPwd=str(pwd))
    assert kv_link_contexts(cfg)[0] is not None
