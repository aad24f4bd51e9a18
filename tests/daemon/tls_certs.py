"""Test PKI made with the openssl command line (the venv has no ``cryptography``).

``make_pki(folder)`` writes two CAs, server certificates for 127.0.0.1 and 127.0.0.2
(one with an encrypted key), client certificates (valid, revoked, from an unknown CA)
and a CRL of the first CA that revokes one client.  EC P-256 keys: fast to make.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

KEY_PASSWORD = "s3cret-pass"


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _key(path: Path) -> Path:
    _run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-out", str(path), cwd=path.parent)
    return path


def _ca(folder: Path, name: str) -> tuple[Path, Path]:
    key = _key(folder / f"{name}.key")
    cert = folder / f"{name}.pem"
    _run("req", "-x509", "-new", "-key", str(key), "-subj", f"/CN={name}", "-days", "2",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", str(cert), cwd=folder)
    return cert, key


def _leaf(folder: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    key = _key(folder / f"{name}.key")
    csr, cert, extfile = folder / f"{name}.csr", folder / f"{name}.pem", folder / f"{name}.ext"
    extfile.write_text(ext + "\n")
    _run("req", "-new", "-key", str(key), "-subj", f"/CN={name}", "-out", str(csr), cwd=folder)
    _run("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
         "-CAcreateserial", "-days", "2", "-extfile", str(extfile), "-out", str(cert), cwd=folder)
    return cert, key


def _crl(folder: Path, ca: tuple[Path, Path], revoke: Path) -> Path:
    (folder / "index.txt").write_text("")
    (folder / "crlnumber").write_text("01\n")
    cnf = folder / "ca.cnf"
    cnf.write_text(f"""[ ca ]
default_ca = CA_default
[ CA_default ]
database = {folder / 'index.txt'}
certificate = {ca[0]}
private_key = {ca[1]}
crlnumber = {folder / 'crlnumber'}
default_md = sha256
default_crl_days = 2
""")
    _run("ca", "-config", str(cnf), "-revoke", str(revoke), cwd=folder)
    out = folder / "ca1.crl.pem"
    _run("ca", "-config", str(cnf), "-gencrl", "-out", str(out), cwd=folder)
    return out


@dataclass
class Pki:
    ca1: Path
    ca2: Path
    crl1: Path                      # CA1's CRL: revokes ``revoked``
    server: tuple[Path, Path]       # 127.0.0.1, CA1, key encrypted with KEY_PASSWORD
    mgmt: tuple[Path, Path]         # 127.0.0.2, CA2
    metrics: tuple[Path, Path]      # 127.0.0.2, CA2
    client1: tuple[Path, Path]      # CA1
    client2: tuple[Path, Path]      # CA2
    revoked: tuple[Path, Path]      # CA1, in crl1
    stranger: tuple[Path, Path]     # an unknown CA


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca1, ca2, ca3 = _ca(folder, "ca1"), _ca(folder, "ca2"), _ca(folder, "ca3")
    server_ext = "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"
    other_ext = "subjectAltName=IP:127.0.0.2\nextendedKeyUsage=serverAuth"
    client_ext = "extendedKeyUsage=clientAuth"
    server = _leaf(folder, "server", ca1, server_ext)
    encrypted = folder / "server.enc.key"
    _run("pkey", "-in", str(server[1]), "-aes256", "-passout", f"pass:{KEY_PASSWORD}",
         "-out", str(encrypted), cwd=folder)
    revoked = _leaf(folder, "revoked", ca1, client_ext)
    return Pki(ca1=ca1[0], ca2=ca2[0], crl1=_crl(folder, ca1, revoked[0]),
               server=(server[0], encrypted),
               mgmt=_leaf(folder, "mgmt", ca2, other_ext),
               metrics=_leaf(folder, "metrics", ca2, other_ext),
               client1=_leaf(folder, "client1", ca1, client_ext),
               client2=_leaf(folder, "client2", ca2, client_ext),
               revoked=revoked, stranger=_leaf(folder, "stranger", ca3, client_ext))
