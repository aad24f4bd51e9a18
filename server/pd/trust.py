"""What makes a decode instance trust KV rows: a signature from the deployment, the peer's
own KV port, and digests that bind the rows to the prompt's tokens.  No torch.

Rows loaded into D's pool become prefix-cache blocks that later requests of any client
hit, so a row that does not belong to its prompt is served as a wrong answer with HTTP
200.  Three checks, each enough to stop one way in:

  * ``kv_transfer_params`` carry ``signature``: HMAC-SHA256, under the deployment's KV
    transfer key, of the fields D acts on (``sign_params``).  The coordinator holds the
    key and signs the params P gave it; it hands the key to the instances with their role
    (MindIE's role body, our ``kv_transfer_key`` field) or both read it from a file.  A
    client cannot make params D accepts, so D pulls only what the coordinator arranged.
  * D pulls only from a peer's configured KV port (the role body's ``kv_port``).
  * P's pull answer names each exported block by a digest chained over its tokens and the
    token after it (``block_digests``: with MTP the block's last MTP slot depends on that
    token).  D computes the same digests for its own prompt and uses only the leading
    blocks that agree, so P's real rows for prompt A never become prompt B's prefix.

Digests are BLAKE2b over int32 token ids keyed with the transfer key, not Python's
``hash()`` (P and D may run different Python builds), and not plain BLAKE2b: anyone can
compute a plain digest of a prompt's tokens, so a KV server that is not the deployment's
could send random rows that pass; without the key it cannot.

The same key authenticates the calls that change an instance's PD state (its role, its
peers, the key itself, a KV release: server/api/planes/pd_routes.py): the caller sends
``X-MTP-PD-Auth: <unix time>.<HMAC-SHA256 over method, path, time and the body's
SHA-256>`` (``sign_call``), taken within ``CALL_WINDOW_S`` of the instance's clock
(``verify_call``).  Before, anyone who reached the management port could post a role with
a key of their own.

Every comparison takes the text as ASCII first: ``hmac.compare_digest`` raises TypeError on
a ``str`` with other characters, which a client turned into a 500.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from typing import Any, Sequence

from server.config.pd_link import KEY_BYTES, KeyFileError, parse_key, read_key_file

__all__ = ["CALL_HEADER", "KEY_BYTES", "KeyFileError", "TrustError", "block_digests",
           "key_id", "new_key", "num_matching", "parse_key", "read_key_file", "same_text",
           "sign_call", "sign_params", "verify_call", "verify_params"]
SIGNED_FIELDS = ("remote_host", "remote_port", "remote_request_id")
CALL_HEADER = "X-MTP-PD-Auth"
CALL_WINDOW_S = 300           # clocks of the coordinator and an instance may differ this much
_DIGEST_PERSON = b"mtp-kv-block"


class TrustError(ValueError):
    """The params or the rows cannot be trusted (the message says which check failed)."""


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def key_id(key: bytes | None) -> str | None:
    """A short public name of a key (status pages show it; the coordinator compares it)."""
    return None if key is None else hashlib.sha256(b"kv-transfer-key:" + key).hexdigest()[:12]


def _canonical(params: dict[str, Any]) -> bytes:
    return json.dumps([params.get(k) for k in SIGNED_FIELDS], separators=(",", ":")).encode()


def sign_params(key: bytes, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with its ``signature`` (the coordinator, before forwarding to D)."""
    mac = hmac.new(key, _canonical(params), hashlib.sha256).hexdigest()
    return {**params, "signature": mac}


def same_text(given: Any, want: str) -> bool:
    """``given == want`` in constant time, False for anything but an ASCII string."""
    return isinstance(given, str) and given.isascii() and hmac.compare_digest(given, want)


def verify_params(key: bytes | None, params: dict[str, Any]) -> None:
    if key is None:
        raise TrustError("this decode instance holds no KV transfer key yet (the coordinator "
                         "hands it over with the role), so it takes no kv_transfer_params")
    want = hmac.new(key, _canonical(params), hashlib.sha256).hexdigest()
    if not same_text(params.get("signature"), want):
        raise TrustError("kv_transfer_params are accepted only as the PD coordinator signed "
                         "them (signature missing or wrong)")


def _call_mac(key: bytes, method: str, path: str, stamp: str, body: bytes) -> str:
    msg = b"\n".join((b"mtp-serve pd call", method.upper().encode(), path.encode(),
                      stamp.encode(), hashlib.sha256(body).digest()))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign_call(key: bytes, method: str, path: str, body: bytes, now: float | None = None) -> str:
    """The ``CALL_HEADER`` value for one management call (``body``: its exact bytes)."""
    stamp = str(int(time.time() if now is None else now))
    return f"{stamp}.{_call_mac(key, method, path, stamp, body)}"


def verify_call(key: bytes | None, method: str, path: str, body: bytes, header: str | None,
                now: float | None = None) -> bool:
    """Whether ``header`` is ``sign_call``'s value for this call under ``key``, made within
    ``CALL_WINDOW_S`` of now."""
    if key is None or not isinstance(header, str) or not header.isascii():
        return False
    stamp, _, mac = header.partition(".")
    if not stamp.isdigit() or len(stamp) > 12:
        return False
    if abs(int(stamp) - (time.time() if now is None else now)) > CALL_WINDOW_S:
        return False
    return same_text(mac, _call_mac(key, method, path, stamp, body))


def block_digests(key: bytes | None, token_ids: Sequence[int], block_size: int,
                  num_blocks: int) -> list[str]:
    """Hex digest of each of the first ``num_blocks`` full blocks, chained and keyed with
    the transfer key: block b covers every token up to and including the first token of
    block b + 1.  No key, no digests (nothing can be checked, so nothing is trusted)."""
    out: list[str] = []
    if key is None:
        return out
    parent = b""
    for b in range(num_blocks):
        end = (b + 1) * block_size + 1
        if end > len(token_ids):
            break
        chunk = token_ids[b * block_size:end]
        h = hashlib.blake2b(parent, digest_size=16, key=key, person=_DIGEST_PERSON)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk))
        parent = h.digest()
        out.append(parent.hex())
    return out


def num_matching(ours: Sequence[str], theirs: Sequence[Any]) -> int:
    """Leading blocks whose digests agree (the rest are not this prompt's)."""
    n = 0
    for a, b in zip(ours, theirs):
        if not same_text(b, a):
            break
        n += 1
    return n
