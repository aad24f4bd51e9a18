"""TLS for each plane, from MindIE's keys, checked in full before any port is bound.

With ``httpsEnabled`` every plane serves HTTPS (TLS 1.2 or newer):

  business    tlsCert, tlsPk, tlsPkPwd, tlsCaPath + tlsCaFile, tlsCrlPath + tlsCrlFiles
  management  managementTlsCert, managementTlsPk, managementTlsPkPwd,
              tlsCaPath + managementTlsCaFile, managementTlsCrlPath + managementTlsCrlFiles
  metrics     the same with ``metrics``

As in MindIE, the management and metrics planes use their own keys when they listen on
another IP than the business plane (``managementIpAddress`` != ``ipAddress``); otherwise
they share the business plane's.

- **Password.**  ``*PkPwd`` names a file holding the key's password (plain text; MindIE
  encrypts it with KMC, which is not available here).  OpenSSL is always handed a
  password *callable*, so an encrypted key never makes it prompt on standard input; a
  wrong or missing password is a start-up error naming the key and the password file.
- **Mutual TLS.**  When the file sets a plane's CA file key to a non-empty list (MindIE's
  shipped file does), clients must present a certificate signed by one of those CAs, and
  each CA file must exist.  ``[]`` or leaving the key out: no client certificate is
  checked.  CRL files of a mutual-TLS plane that exist are loaded and a revoked client
  certificate is refused; a named CRL file that does not exist is skipped with a warning
  (MindIE's shipped file names one that few installations have).

Here: which files each plane uses (``plane_tls``) and one context per listener; the file
set and the context it gives are server/web/tls_files.py, shared with the KV link.
"""
from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from server.web.tls_files import PlaneTls, TlsError, resolve, server_context

PLANE_PREFIX = {"business": "tls", "management": "managementTls", "metrics": "metricsTls"}


def _field(server: Any, alias: str) -> tuple[str, Any, bool]:
    """(attribute name, value, set in the file) of ServerConfig key ``alias``."""
    for name, info in type(server).model_fields.items():
        if info.alias == alias:
            return name, getattr(server, name), name in server.model_fields_set
    raise KeyError(alias)


def plane_tls(cfg: Any, plane: str) -> PlaneTls:
    """The files ``plane`` uses under ``cfg`` (httpsEnabled assumed true)."""
    s = cfg.server
    base = Path(cfg.source).parent if cfg.source else Path.cwd()
    own = plane != "business" and cfg.management_ip != s.ip_address
    p = PLANE_PREFIX[plane if own else "business"]
    cert_key, key_key, pwd_key = p + "Cert", p + "Pk", p + "PkPwd"
    ca_key = "tlsCaFile" if p == "tls" else p + "CaFile"
    crl_key = p + "CrlFiles"
    _, cert, _ = _field(s, cert_key)
    _, key, _ = _field(s, key_key)
    _, pwd, _ = _field(s, pwd_key)
    _, ca_files, ca_set = _field(s, ca_key)
    _, crl_files, crl_set = _field(s, crl_key)
    ca_dir = resolve(s.tls_ca_path, base)
    _, crl_dir, _ = _field(s, p + "CrlPath")
    crl_dir = resolve(crl_dir, base)
    return PlaneTls(
        cert=resolve(cert, base), key=resolve(key, base),
        password_file=resolve(pwd, base) if pwd else None,
        ca_files=tuple(resolve(f, ca_dir) for f in ca_files) if ca_set else (),
        crl_files=tuple(resolve(f, crl_dir) for f in crl_files) if ca_set and crl_set else (),
        # (CRL files matter only when client certificates are checked)
        keys=(cert_key, key_key, pwd_key, ca_key, crl_key))


def listener_contexts(cfg: Any, listeners: list[Any]) -> list[ssl.SSLContext | None]:
    """One SSLContext per listener (None without httpsEnabled), all built and checked now.

    Planes sharing an ip:port share one server, so they must use the same files."""
    if not cfg.server.https_enabled:
        return [None] * len(listeners)
    out = []
    for lst in listeners:
        planes = [p for p in ("business", "management", "metrics") if p in lst.planes]
        chosen = {plane: plane_tls(cfg, plane) for plane in planes}
        distinct = {(t.cert, t.key, t.password_file, t.ca_files, t.crl_files)
                    for t in chosen.values()}
        if len(distinct) > 1:
            raise TlsError(f"planes {' and '.join(planes)} share {lst.host}:{lst.port} but "
                           "are configured with different TLS files; give them one address "
                           "each or the same files")
        out.append(server_context(chosen[planes[0]]))
    return out
