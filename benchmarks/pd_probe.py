"""Issue 58's PD probe, replayed for its figures: 1 P + 1 D + the coordinator, demo model.

  * a 300 MB body to D's management plane, with ``Content-Length`` and chunked: the answer,
    when it came, how much the client pushed, and D's memory (its process tree) before
    and after;
  * the probe's role post (a peer and a key of the attacker's, no credential): its answer;
  * ``--clients`` concurrent requests through the coordinator with ``pdMaxExports``
    ``--max-exports``: the answers, the 503s' ``Retry-After``, and whether the coordinator
    still serves right after (before issue 58, one "exports full" marked the only P down);
  * the same number of clients holding P's exports through its business port, then five
    coordinator users: their answers, and whether P stayed up.

    python -m benchmarks.pd_probe --clients 24 --max-exports 16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.pd_flood import tree_rss_mb
from server.testing.daemon import (COORDINATOR_READY, DEMO_MODEL, MODEL_NAME, Daemon, free_port,
                                   make_config, start_all)

PROMPT = "Tell me about the sea and the ships " * 8
MB300 = 300 << 20


def _instance(folder: Path, key_file: Path, **server) -> Daemon:
    folder.mkdir()
    cfg = make_config(folder, DEMO_MODEL, schedule={"cacheBlockSize": 16}, server={
        "inferMode": "dmi", "interCommPort": free_port(), "interCommTLSEnabled": False,
        "pdTransferKeyFile": str(key_file), "maxLinkNum": 64, **server})
    return Daemon(cfg, env={"MTP_SERVE_COMPILE": "0"})


def _coordinator(folder: Path, p: Daemon, d: Daemon, key_file: Path) -> Daemon:
    cfg = folder / "coordinator.json"
    cfg.write_text(json.dumps({
        "ipAddress": "127.0.0.1", "port": free_port(), "kvTransferKeyFile": str(key_file),
        "prefill": [{"business": p.base, "management": p.mgmt}],
        "decode": [{"business": d.base, "management": d.mgmt}]}))
    return Daemon(cfg, log_level=None, module="server.pd", ready=COORDINATOR_READY).start()


def big_bodies(d: Daemon) -> None:
    rss = tree_rss_mb(d.proc.pid)
    port = int(d.mgmt.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/role/decode HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     + str(MB300).encode() + b"\r\n\r\n")
        stop = threading.Event()

        def push() -> None:
            try:
                while not stop.is_set():
                    sock.sendall(b" " * 65536)
            except OSError:
                pass

        pusher = threading.Thread(target=push)
        pusher.start()
        sock.settimeout(10)
        head = sock.recv(4096).split(b"\r\n", 1)[0].decode()
        took = time.monotonic() - t0
        stop.set()
    pusher.join()
    print(f"300 MB with Content-Length: {head!r} after {took * 1000:.0f} ms")
    sent = [0]

    def chunks():
        for _ in range(MB300 // 65536):
            sent[0] += 65536
            yield b" " * 65536

    t0 = time.monotonic()
    try:
        r = httpx.post(d.mgmt + "/v1/role/decode", content=chunks(), timeout=60)
        answer = str(r.status_code)
    except httpx.TransportError as exc:
        answer = f"connection closed ({type(exc).__name__})"
    print(f"300 MB chunked: {answer} after {(time.monotonic() - t0) * 1000:.0f} ms, the client "
          f"pushed {sent[0] / 2**20:.1f} MB")
    time.sleep(1)
    print(f"D's memory: {rss:.0f} MB before, {tree_rss_mb(d.proc.pid):.0f} MB after")


def probe_role_post(d: Daemon) -> None:
    r = httpx.post(d.mgmt + "/v1/role/decode", timeout=10, json={
        "local": {"host_ip": "127.0.0.1"}, "peers": [{"server_ip": "127.0.0.1", "kv_port": 9}],
        "kv_transfer_key": secrets.token_hex(32)})
    print(f"the probe's role post: {r.status_code} {r.text[:120]}")


async def through_the_coordinator(c: Daemon, p: Daemon, clients: int) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        async def ask(base: str, **extra) -> httpx.Response:
            return await client.post(base + "/v1/completions", json={
                "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra})

        answers = await asyncio.gather(*(ask(c.base) for _ in range(clients)))
        codes = [r.status_code for r in answers]
        after = (await client.get(c.base + "/health")).status_code, (await ask(c.base)).status_code
        print(f"{clients} clients through the coordinator: "
              f"{ {k: codes.count(k) for k in sorted(set(codes))} }, Retry-After on the 503s "
              f"{sorted({r.headers.get('retry-after') for r in answers if r.status_code == 503})}; "
              f"right after: /health {after[0]}, a request {after[1]}")
        hogs = [r.status_code for r in await asyncio.gather(*(ask(
            p.base, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            for _ in range(clients)))]
        users = [(await ask(c.base)).status_code for _ in range(5)]
        health = (await client.get(c.base + "/health")).status_code
        print(f"{clients} clients holding P's exports: "
              f"{ {k: hogs.count(k) for k in sorted(set(hogs))} }; "
              f"then 5 coordinator users {users}; coordinator /health {health}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--max-exports", type=int, default=16)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="pd-probe-"))
    key_file = folder / "kv-transfer.key"
    key_file.write_text(secrets.token_hex(32))
    key_file.chmod(0o600)
    p, d = start_all(_instance(folder / "p", key_file, pdMaxExports=args.max_exports),
                     _instance(folder / "d", key_file))
    c = None
    try:
        c = _coordinator(folder, p, d, key_file)
        big_bodies(d)
        probe_role_post(d)
        asyncio.run(through_the_coordinator(c, p, args.clients))
    finally:
        for daemon in (c, p, d):
            if daemon is not None:
                daemon.kill()


if __name__ == "__main__":
    main()
