"""TLS for the KV link between PD instances (``interCommTLSEnabled``, MindIE's keys).

Both ends use the ``interComm*`` files: the certificate and key (``interCommTlsCert``,
``interCommPk``, ``interCommPkPwd`` naming the key's password file), the CA files
(``interCommTlsCaPath`` + ``interCommTlsCaFiles``) and CRLs (``interCommTlsCrlPath`` +
``interCommTlsCrlFiles``).  P's KV server requires a client certificate signed by those CAs
(mutual TLS; a revoked one is refused when a CRL file exists); D checks P's certificate,
host name (IP address) included, and presents its own.  TLS 1.2 or newer.  Every file is
checked at start-up, before any port is bound.
"""
from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from server.api.tls import PlaneTls, TlsError, _password, server_context


def inter_comm_tls(cfg: Any) -> PlaneTls:
    s = cfg.server
    base = Path(cfg.source).parent if cfg.source else Path.cwd()

    def at(path: str, folder: Path = base) -> Path:
        p = Path(path)
        return p if p.is_absolute() else folder / p
    ca_dir, crl_dir = at(s.inter_comm_tls_ca_path), at(s.inter_comm_tls_crl_path)
    return PlaneTls(cert=at(s.inter_comm_tls_cert), key=at(s.inter_comm_pk),
                    password_file=at(s.inter_comm_pk_pwd) if s.inter_comm_pk_pwd else None,
                    ca_files=tuple(at(f, ca_dir) for f in s.inter_comm_tls_ca_files),
                    crl_files=tuple(at(f, crl_dir) for f in s.inter_comm_tls_crl_files),
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
    password = _password(tls)
    client.load_cert_chain(tls.cert, tls.key, password=lambda: password or b"")
    return server, client
