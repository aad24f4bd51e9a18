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
"""
from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("server.daemon")
PLANE_PREFIX = {"business": "tls", "management": "managementTls", "metrics": "metricsTls"}


class TlsError(RuntimeError):
    """A TLS file or password that cannot be used; the message names the key and file."""


@dataclass(frozen=True)
class PlaneTls:
    """The files one plane serves with (absolute paths); equal values: same TLS."""
    cert: Path
    key: Path
    password_file: Path | None
    ca_files: tuple[Path, ...]
    crl_files: tuple[Path, ...]
    keys: tuple[str, str, str, str, str]     # config keys: cert, key, pwd, CA, CRL

    @property
    def mutual(self) -> bool:
        return bool(self.ca_files)


def _field(server: Any, alias: str) -> tuple[str, Any, bool]:
    """(attribute name, value, set in the file) of ServerConfig key ``alias``."""
    for name, info in type(server).model_fields.items():
        if info.alias == alias:
            return name, getattr(server, name), name in server.model_fields_set
    raise KeyError(alias)


def _resolve(path: str, base: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else base / p


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
    ca_dir = _resolve(s.tls_ca_path, base)
    _, crl_dir, _ = _field(s, p + "CrlPath")
    crl_dir = _resolve(crl_dir, base)
    return PlaneTls(
        cert=_resolve(cert, base), key=_resolve(key, base),
        password_file=_resolve(pwd, base) if pwd else None,
        ca_files=tuple(_resolve(f, ca_dir) for f in ca_files) if ca_set else (),
        crl_files=tuple(_resolve(f, crl_dir) for f in crl_files) if ca_set and crl_set else (),
        # (CRL files matter only when client certificates are checked)
        keys=(cert_key, key_key, pwd_key, ca_key, crl_key))


def _password(tls: PlaneTls) -> bytes | None:
    """The key's password, or None when the key is not encrypted."""
    encrypted = b"ENCRYPTED" in tls.key.read_bytes()[:4096]
    pwd_key = tls.keys[2]
    if not encrypted:
        return None
    if tls.password_file is None or not tls.password_file.is_file():
        where = f" ({tls.password_file} not found)" if tls.password_file else ""
        raise TlsError(f"{tls.keys[1]} {tls.key} is encrypted and its password file "
                       f"{pwd_key}{where} cannot be read; provide the file")
    return tls.password_file.read_bytes().strip()


def server_context(tls: PlaneTls) -> ssl.SSLContext:
    """A server SSLContext for ``tls``, or TlsError naming what is wrong."""
    names = tls.keys
    for key, path in ((names[0], tls.cert), (names[1], tls.key)):
        if not path.is_file():
            raise TlsError(f"httpsEnabled is true but {key} {path} not found (relative paths "
                           "are resolved from the config folder); provide the file or set "
                           "httpsEnabled to false")
    for path in tls.ca_files:
        if not path.is_file():
            raise TlsError(f"{names[3]} names {path}, which is not found (CA files are "
                           "resolved from tlsCaPath); provide it, or set the key to [] for "
                           "no client-certificate check")
    crls = [p for p in tls.crl_files if p.is_file()]
    for path in sorted(set(tls.crl_files) - set(crls)):
        log.warning("%s names %s, which is not found: revocation is not checked against it",
                    names[4], path)
    password = _password(tls)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # A callable, never None: with None OpenSSL would prompt on stdin for a password.
        ctx.load_cert_chain(tls.cert, tls.key, password=lambda: password or b"")
    except ssl.SSLError as exc:
        if password is not None:
            raise TlsError(f"{names[1]} {tls.key} cannot be decrypted with the password in "
                           f"{names[2]} {tls.password_file} (wrong password?): "
                           f"{exc.reason or exc}") from None
        raise TlsError(f"{names[0]} {tls.cert} and {names[1]} {tls.key} cannot be loaded "
                       f"(not PEM, or not a matching pair): {exc.reason or exc}") from None
    if tls.ca_files:
        for path in tls.ca_files:
            _load(ctx, path, names[3])
        ctx.verify_mode = ssl.CERT_REQUIRED
    if crls:
        for path in crls:
            _load(ctx, path, names[4])
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


def _load(ctx: ssl.SSLContext, path: Path, key: str) -> None:
    try:
        ctx.load_verify_locations(cafile=str(path))
    except (ssl.SSLError, ValueError) as exc:
        raise TlsError(f"{key} {path} is not a PEM certificate or CRL: {exc}") from None


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
