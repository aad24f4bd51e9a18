"""TLS for the KV link between PD instances (``interCommTLSEnabled``, MindIE's keys).

Both ends use the ``interComm*`` files: the certificate and key (``interCommTlsCert``,
``interCommPk``, ``interCommPkPwd`` naming the key's password file), the CA files
(``interCommTlsCaPath`` + ``interCommTlsCaFiles``) and CRLs (``interCommTlsCrlPath`` +
``interCommTlsCrlFiles``).  P's KV server requires a client certificate signed by those CAs
(mutual TLS; a revoked one is refused when a CRL file exists); D checks P's certificate,
host name (IP address) included, and presents its own.  TLS 1.2 or newer.  Every file is
checked at start-up, before any port is bound.  The file set, its password and the server
context are server/web/tls_files.py, shared with the HTTP planes.
"""
from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from server.web.tls_files import PlaneTls, TlsError, key_password, resolve, server_context


def inter_comm_tls(cfg: Any) -> PlaneTls:
    s = cfg.server
    base = Path(cfg.source).parent if cfg.source else Path.cwd()
    ca_dir = resolve(s.inter_comm_tls_ca_path, base)
    crl_dir = resolve(s.inter_comm_tls_crl_path, base)
    pwd = resolve(s.inter_comm_pk_pwd, base) if s.inter_comm_pk_pwd else None
    return PlaneTls(cert=resolve(s.inter_comm_tls_cert, base),
                    key=resolve(s.inter_comm_pk, base), password_file=pwd,
                    ca_files=tuple(resolve(f, ca_dir) for f in s.inter_comm_tls_ca_files),
                    crl_files=tuple(resolve(f, crl_dir) for f in s.inter_comm_tls_crl_files),
                    keys=("interCommTlsCert", "interCommPk", "interCommPkPwd",
                          "interCommTlsCaFiles", "interCommTlsCrlFiles"))


def kv_link_contexts(cfg: Any) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server context for P's KV port, client context for D's pulls); (None, None) when
    interCommTLSEnabled is false.  TlsError names the key and file that cannot be used."""
    if not cfg.server.inter_comm_tls_enabled:
        return None, None
    tls = inter_comm_tls(cfg)
    if not tls.ca_files:
        raise TlsError("interCommTLSEnabled is true but interCommTlsCaFiles is empty: the KV "
                       "link checks both ends' certificates")
    server = server_context(tls)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_2
    for path in tls.ca_files:
        client.load_verify_locations(cafile=str(path))
    password = key_password(tls)
    client.load_cert_chain(tls.cert, tls.key, password=lambda: password or b"")
    return server, client
