"""What a decode instance trusts, and what a prefill instance's KV port and exports hold:
no engine, no daemon.

D takes kv_transfer_params only as the coordinator signed them, pulls only from the
peer's KV port, and uses only blocks computed for its own prompt's tokens; P's exports
are bounded by count and bytes and released when nobody will pull them; the KV port cuts
readers that stop reading, refuses connections past its cap, and answers a malformed
request line with an error header instead of an exception.  Issue 58: block digests are
keyed (rows with digests anyone can compute are not used), rows of other weights are
refused (the layout names the weights by their content), a malformed signature is a 400
and not a 500, PD 503s say when to retry, management calls are signed, and key files
that are not small regular files are refused without waiting.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import socket
import struct
import threading
from types import SimpleNamespace

import pytest

from server.api.errors import api_error
from server.config.checkpoint.fingerprint import weights_fingerprint
from server.config.pd_link import KeyFileError, read_key_file
from server.engine.protocol import EngineRequest, SamplingParams
from server.pd.coordinator.config import CoordinatorConfig, CoordinatorConfigError
from server.pd.errors import PDError
from server.pd.instance import PDInstance, PDSettings
from server.pd.kv_exports import KVExports
from server.pd.kv_server import KVServer
from server.pd.roles import RoleError, RoleState
from server.pd.trust import (block_digests, key_id, new_key, sign_call, sign_params,
                             verify_call)
from server.pd.wire import KVRows, MAX_HEADER

BS = 4
ROW = 8                                       # bytes per block of the fake runtime
RUNTIME = SimpleNamespace(num_kv_layers=2, block_size=BS, kv_block_bytes=ROW,
                          kv_cache_dtype="bfloat16", mtp_enabled=True)


def _listen() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _settings(role: str, port: int, key: bytes | None, **kw) -> PDSettings:
    kw.setdefault("model_fingerprint", "f00d")
    return PDSettings(role, ("127.0.0.1",), "127.0.0.1", port, 2.0, 2.0, key, **kw)


def _request(rid: str, tokens: list[int]) -> EngineRequest:
    return EngineRequest(rid, tokens, SamplingParams(max_tokens=4))


PROMPT_A = list(range(10, 27))                # 17 tokens: 4 full blocks and the next token
# Shares A's first 8 tokens, so only block 0 agrees: block 1's rows also depend on the
# token after it (the MTP layer's last slot), which differs.
PROMPT_B = list(range(10, 18)) + list(range(90, 99))


class _Pair:
    """P with its KV server on a loopback port, and D with P as its peer."""

    def __init__(self, key: bytes | None = None, d_key: bytes | None = None,
                 d_model: str = "f00d", **p_kw) -> None:
        self.key = key if key is not None else new_key()
        self.sock = _listen()
        self.kv_port = self.sock.getsockname()[1]
        self.p = PDInstance(_settings("prefill", self.kv_port, self.key, **p_kw), RUNTIME)
        self.d = PDInstance(_settings("decode", self.kv_port, d_key or self.key,
                                      model_fingerprint=d_model), RUNTIME)
        self.server = KVServer(self.p.exports)

    async def __aenter__(self) -> "_Pair":
        await self.server.start(self.sock)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.close()

    async def prefill(self, rid: str, tokens: list[int]) -> dict:
        """P's side of one request: reserve, export (as the engine would), answer."""
        er = await self.p.prepare(_request(rid, tokens), {"do_remote_decode": True})
        n = (len(tokens) - 1) // BS
        self.p.on_export(rid, n, bytes(range(n * ROW)))
        return self.p.response_params(er)["kv_transfer_params"]


def test_d_takes_signed_params_for_its_own_prompt_only():
    async def run():
        async with _Pair() as pair:
            params = await pair.prefill("a", PROMPT_A)
            signed = sign_params(pair.key, params)
            er = await pair.d.prepare(_request("d1", PROMPT_A), signed)
            assert len(er.remote_kv) == 4                       # every block: same prompt
            # A client's own params (no signature, or signed with another key): refused.
            params = await pair.prefill("a2", PROMPT_A)
            for bad in (params, sign_params(new_key(), params), {**signed, "signature": 5}):
                with pytest.raises(PDError) as e:
                    await pair.d.prepare(_request("d2", PROMPT_B), bad)
                assert e.value.status == 400 and "signed" in e.value.message
            # P's real export of prompt A offered with prompt B: only the agreeing block counts.
            er = await pair.d.prepare(_request("d3", PROMPT_B), sign_params(pair.key, params))
            assert len(er.remote_kv) == 1
            assert pair.d.metrics.failures.labels("prompt_mismatch")._value.get() == 1
    asyncio.run(run())


def test_d_pulls_only_from_the_peers_kv_port():
    async def run():
        async with _Pair() as pair:
            fake = _listen()                   # another port of the peer's address
            fake_exports = KVExports(30)
            fake_server = KVServer(fake_exports)
            await fake_server.start(fake)
            try:
                port = fake.getsockname()[1]
                digests = tuple(block_digests(pair.key, PROMPT_B, BS, 4))
                fake_exports.reserve("x", 4 * ROW, digests)
                fake_exports.put("x", KVRows(4, ROW, pair.d.layout, b"\xff" * 4 * ROW))
                params = sign_params(pair.key, {"remote_host": "127.0.0.1", "remote_port": port,
                                                "remote_request_id": "x"})
                with pytest.raises(PDError) as e:
                    await pair.d.prepare(_request("d", PROMPT_B), params)
                assert e.value.status == 400 and "not the KV port" in e.value.message
                assert fake_exports.num_held == 1                  # never pulled from
            finally:
                await fake_server.close()
    asyncio.run(run())


def test_a_role_change_under_a_request_is_a_503():
    async def run():
        async with _Pair() as pair:
            with pytest.raises(PDError) as e:
                await pair.p.prepare(_request("r", PROMPT_A), {"remote_request_id": "x",
                                                               "remote_host": "127.0.0.1",
                                                               "remote_port": 1})
            assert e.value.status == 503
            with pytest.raises(PDError) as e:
                await pair.d.prepare(_request("r", PROMPT_A), {"do_remote_decode": True})
            assert e.value.status == 503
    asyncio.run(run())


def test_exports_are_bounded_and_released():
    async def run():
        async with _Pair(max_exports=2, max_export_bytes=10 * ROW) as pair:
            await pair.prefill("a", PROMPT_A)                     # 4 blocks
            await pair.prefill("b", PROMPT_A)                     # 8 of 10 blocks' bytes
            with pytest.raises(PDError) as e:                    # a third: past the count
                await pair.prefill("c", PROMPT_A)
            assert e.value.status == 503 and "pdMaxExports" in e.value.message
            assert pair.p.release("a") and not pair.p.release("a")
            with pytest.raises(PDError):                         # 4 + 4 > 10 - 4: past the bytes
                await pair.prefill("c", PROMPT_A + PROMPT_A)
            await pair.prefill("c", PROMPT_A)
            # A request that ends without its answer (failed, client gone) drops its export.
            pair.p.release("b")
            er = await pair.p.prepare(_request("gone", PROMPT_A[:9]), {"do_remote_decode": True})
            pair.p.finish([er])
            assert pair.p.exports.num_held == 1 and pair.p.exports.bytes_held == 4 * ROW
            # Rows filed after their reservation went are dropped, not held.
            pair.p.on_export("gone", 2, bytes(2 * ROW))
            assert "gone" not in pair.p.exports
    asyncio.run(run())


def test_exports_expire_and_a_pull_takes_them_once():
    now = [0.0]
    ex = KVExports(30, reserve_ttl_s=100, clock=lambda: now[0])
    assert ex.reserve("r", 6) and not ex.put("other", KVRows(2, 3, "L", b"abcdef"))
    now[0] = 99.0
    assert ex.put("r", KVRows(2, 3, "L", b"abcdef"))             # filed: 30 s from now
    now[0] = 128.0
    rows = ex.take("r")
    assert rows is not None and ex.take("r") is None and ex.bytes_sending == 6
    ex.done_sending(rows)
    assert ex.bytes_held == 0
    ex.reserve("s", 6)
    now[0] = 300.0
    assert ex.num_held == 0 and ex.num_expired == 1


async def _raw(port: int, payload: bytes, read: bool = True) -> dict | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    try:
        if not read:
            return None
        (n,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), 5))
        return json.loads(await reader.readexactly(n))
    finally:
        writer.close()


def test_kv_port_answers_malformed_request_lines_with_an_error_header():
    async def run():
        failures = []
        ex = KVExports(30)
        server = KVServer(ex, on_failed=failures.append)
        sock = _listen()
        await server.start(sock)
        port = sock.getsockname()[1]
        try:
            cases = [b"[" * 100_000 + b"\n",                          # deep JSON
                     b'{"op": "pull", "request_id": "' + b"x" * (MAX_HEADER + 10) + b'"}\n',
                     b"y" * (1 << 20),                                  # 1 MB, no newline
                     b"not json\n", b'{"op": "push", "request_id": "r"}\n', b'[1]\n']
            for payload in cases:
                header = await _raw(port, payload)
                assert header["status"] == "error", payload[:40]
            assert failures == ["bad_request"] * len(cases)
        finally:
            await server.close()
    asyncio.run(run())


def test_kv_port_cuts_a_reader_that_stops_reading_and_caps_connections():
    async def run():
        ex = KVExports(30, max_bytes=1 << 30)
        failures = []
        server = KVServer(ex, on_failed=failures.append, max_connections=3, write_timeout_s=0.5)
        sock = _listen()
        await server.start(sock)
        port = sock.getsockname()[1]
        size = 64 << 20                               # far past the socket buffers
        ex.reserve("big", size)
        ex.put("big", KVRows(1, size, "L", bytes(size)))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1024)
            writer.write(b'{"op": "pull", "version": 1, "request_id": "big"}\n')
            await writer.drain()                      # then never read
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            header = await _raw(port, b"")                       # the 4th connection
            assert header["status"] == "error" and "connections open" in header["error"]
            for _, w in idle:
                w.close()
            await asyncio.sleep(1.5)
            assert "write_timeout" in failures and ex.bytes_held == 0
            writer.close()
        finally:
            await server.close()
    asyncio.run(run())


def test_role_bodies_carry_the_key_and_kv_ports_and_refuse_integer_addresses():
    roles = RoleState()
    key = new_key()
    roles.assign("decode", {"local": {}, "kv_transfer_key": key.hex(),
                            "peers": [{"server_ip": "10.0.0.2", "kv_port": 1500}]})
    assert roles.key == key and roles.kv_ports_of("10.0.0.2", 1121) == {1500}
    roles.assign("decode", {"local": {}, "peers": [{"server_ip": "10.0.0.3"},
                                                   {"server_ip": "10.0.0.4", "kv_port": 1500},
                                                   {"server_ip": "10.0.0.4", "kv_port": 1501}]})
    assert roles.key == key and roles.kv_ports_of("10.0.0.3", 1121) == {1121}   # key kept
    assert roles.kv_ports_of("10.0.0.4", 1121) == {1500, 1501}     # two P on one host
    for body, why in [({"local": {}, "peers": [{"server_ip": 2130706433}]}, "string"),
                      ({"local": {}, "peers": [{"server_ip": "10.0.0.2", "kv_port": "1"}]}, "port"),
                      ({"local": {}, "peers": [{"server_ip": "10.0.0.2"}], "kv_transfer_key": "ab"},
                       "hex digits")]:
        with pytest.raises(RoleError, match=why):
            roles.assign("decode", body)
    assert roles.peers == {"10.0.0.3", "10.0.0.4"}                          # previous kept


def test_status_names_the_key_without_showing_it():
    key = new_key()
    inst = PDInstance(_settings("decode", 1500, key), RUNTIME)
    st = inst.status()
    assert st["kv_transfer_key_id"] == key_id(key) and key.hex() not in json.dumps(st)
    assert dataclasses.replace(_settings("decode", 1, None)).key is None


# ---- issue 58: keyed digests, other weights, malformed signatures, key files -------------

def _plain_digests(tokens: list[int], n: int) -> tuple[str, ...]:
    """The digests as they were before issue 58: BLAKE2b over the tokens, no key (anyone
    who knows the prompt can compute them)."""
    out, parent = [], b""
    for b in range(n):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b"".join(t.to_bytes(4, "little", signed=True)
                          for t in tokens[b * BS:(b + 1) * BS + 1]))
        parent = h.digest()
        out.append(parent.hex())
    return tuple(out)


def test_rows_with_digests_made_without_the_key_are_not_used():
    """A KV server D pulls from (its peer's port, as the role API once let anyone name)
    that answers random rows with the prompt's plain digests, or digests under another
    key: D loads none of them; with the deployment's key they would pass."""
    async def run():
        key = new_key()
        sock = _listen()
        port = sock.getsockname()[1]
        d = PDInstance(_settings("decode", port, key), RUNTIME)
        exports = KVExports(30)
        server = KVServer(exports)
        await server.start(sock)
        try:
            for rid, digests, used in [
                    ("plain", _plain_digests(PROMPT_A, 4), 0),
                    ("other", tuple(block_digests(new_key(), PROMPT_A, BS, 4)), 0),
                    ("keyed", tuple(block_digests(key, PROMPT_A, BS, 4)), 4)]:
                exports.reserve(rid, 4 * ROW, digests)
                exports.put(rid, KVRows(4, ROW, d.layout, bytes(4 * ROW)))
                params = sign_params(key, {"remote_host": "127.0.0.1", "remote_port": port,
                                           "remote_request_id": rid})
                er = await d.prepare(_request(f"d-{rid}", PROMPT_A), params)
                assert len(er.remote_kv) == used, rid
            assert d.metrics.failures.labels("prompt_mismatch")._value.get() == 2
        finally:
            await server.close()
    asyncio.run(run())


def test_rows_of_other_weights_are_refused():
    """P and D on two checkpoints of one shape: the layouts name the weights, D computes
    the prompt itself (a co-located answer) instead of loading P's rows."""
    async def run():
        async with _Pair(d_model="beef") as pair:
            assert "model=f00d" in pair.p.layout and "model=beef" in pair.d.layout
            params = await pair.prefill("a", PROMPT_A)
            er = await pair.d.prepare(_request("d", PROMPT_A), sign_params(pair.key, params))
            assert er.remote_kv == ()
            assert pair.d.metrics.failures.labels("model")._value.get() == 1
            assert pair.d.status()["model_fingerprint"] == "beef"
    asyncio.run(run())


@pytest.mark.parametrize("signature", ["é" * 64, "\udcff" * 64, "0" * 63 + "é", ["x"], None])
def test_a_malformed_signature_is_a_400(signature):
    """compare_digest raises TypeError on a str with non-ASCII characters: it was a 500."""
    async def run():
        async with _Pair() as pair:
            params = sign_params(pair.key, await pair.prefill("a", PROMPT_A))
            with pytest.raises(PDError) as e:
                await pair.d.prepare(_request("d", PROMPT_A), {**params, "signature": signature})
            assert e.value.status == 400
    asyncio.run(run())


def test_pd_503s_say_when_to_retry():
    async def run():
        async with _Pair(max_exports=1) as pair:
            await pair.prefill("a", PROMPT_A)
            with pytest.raises(PDError) as full:
                await pair.prefill("b", PROMPT_A)
            with pytest.raises(PDError) as flip:
                await pair.d.prepare(_request("r", PROMPT_A), {"do_remote_decode": True})
        for e in (full, flip):
            err = api_error(e.value)
            assert err.status == 503 and err.retry_after == 1
        assert api_error(PDError("x")).retry_after is None
    asyncio.run(run())


def test_management_call_signatures():
    key, body = new_key(), b'{"local": {}}'
    sig = sign_call(key, "POST", "/v1/role/decode", body, now=1000)
    assert verify_call(key, "POST", "/v1/role/decode", body, sig, now=1100)
    for args in [(new_key(), "POST", "/v1/role/decode", body, sig),      # another key
                 (key, "POST", "/v1/role/prefill", body, sig),           # another path
                 (key, "POST", "/v1/role/decode", body + b" ", sig),     # another body
                 (None, "POST", "/v1/role/decode", body, sig),           # no key here
                 (key, "POST", "/v1/role/decode", body, sig + "é"),
                 (key, "POST", "/v1/role/decode", body, "é" + sig),
                 (key, "POST", "/v1/role/decode", body, None)]:
        assert not verify_call(*args, now=1100), args
    assert not verify_call(key, "POST", "/v1/role/decode", body, sig, now=1000 + 301)


def _blocks_reading(path) -> bool:
    """Whether ``read_key_file(path)`` hangs (given 5 s), as it did on a FIFO."""
    done = threading.Event()

    def read():
        try:
            read_key_file(path)
        except KeyFileError:
            pass
        done.set()

    threading.Thread(target=read, daemon=True).start()
    hung = not done.wait(5)
    if hung:                                        # release the stuck reader
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    return hung


def test_key_files_that_are_not_small_regular_files_are_refused_without_waiting(tmp_path):
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo)
    assert not _blocks_reading(fifo)
    with pytest.raises(KeyFileError, match="not a regular file"):
        read_key_file(fifo)
    with pytest.raises(KeyFileError, match="not a regular file"):
        read_key_file(tmp_path)
    big = tmp_path / "big.key"
    big.write_text("0" * 10_000)
    with pytest.raises(KeyFileError, match="more than"):
        read_key_file(big)
    good = tmp_path / "good.key"
    good.write_text(new_key().hex() + "\n")
    link = tmp_path / "link.key"                    # Kubernetes mounts secrets as links
    link.symlink_to(good)
    assert read_key_file(link) == read_key_file(good)
    # The coordinator's config and key file are read the same way.
    with pytest.raises(CoordinatorConfigError, match="not a regular file"):
        CoordinatorConfig.load(fifo)
    with pytest.raises(CoordinatorConfigError, match="not a regular file"):
        CoordinatorConfig.from_dict({"kvTransferKeyFile": str(fifo), "prefill": [], "decode": []})


def _checkpoint(folder, tensors: dict[str, bytes], config: str = '{"model_type": "deepseek_v3"}'):
    """A safetensors checkpoint of byte tensors (dtype U8) and its config.json."""
    folder.mkdir()
    header, data = {}, b""
    for name, raw in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(raw)],
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + data)
    (folder / "config.json").write_text(config)
    return folder


def test_weights_fingerprint_names_the_content_not_the_path(tmp_path):
    tensors = {"a": bytes(range(200)), "b": bytes(1000)}
    a = weights_fingerprint(_checkpoint(tmp_path / "a", tensors))
    assert a == weights_fingerprint(_checkpoint(tmp_path / "copy", tensors))   # another path
    retrained = {"a": bytes(range(200)), "b": b"\x01" + bytes(999)}            # same shapes
    assert weights_fingerprint(_checkpoint(tmp_path / "other", retrained)) != a
    other_config = _checkpoint(tmp_path / "cfg", tensors, '{"model_type": "x"}')
    assert weights_fingerprint(other_config) != a
    (tmp_path / "copy" / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError):
        weights_fingerprint(tmp_path / "copy")
