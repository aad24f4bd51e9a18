"""A TLS file set and the server SSLContext it gives, shared by the HTTP planes
(server/api/tls.py: MindIE's per-plane keys) and the PD KV link (server/pd/tls.py: the
``interComm*`` keys).

``PlaneTls`` holds the absolute paths and the config keys that named them, so that every
error names the key and the file.  A relative path is resolved from the config folder
(``resolve``).  An encrypted key's password is read from its password file
(``key_password``): OpenSSL is always handed a password *callable*, so it never prompts on
standard input.
"""
from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("server.daemon")


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


def resolve(path: str, base: Path) -> Path:
    """``path`` as given when absolute, else under ``base`` (the config folder, or a CA
    or CRL folder)."""
    p = Path(path)
    return p if p.is_absolute() else base / p


def key_password(tls: PlaneTls) -> bytes | None:
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
    password = key_password(tls)
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
