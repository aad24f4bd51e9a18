"""A PD prefill instance flooded with export requests nobody pulls: its memory and refusals.

Any client that reaches P can ask it to prefill a prompt and hold the prompt's KV rows
for a decode instance (``kv_transfer_params: {"do_remote_decode": true}``).  This keeps
``--concurrency`` such clients busy for ``--seconds`` against one prefill instance on the
demo model and reports the answers, the exports held (count and bytes, against the
``pdMaxExports`` / ``pdMaxExportMb`` bound), and the daemon's resident memory (its process
tree) at idle, at its peak and ``--settle`` seconds after the flood, once the exports
were released (as the coordinator does when D refuses).

    python -m benchmarks.pd_flood --seconds 30 --concurrency 8 --cap-mb 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import tempfile
import time
from pathlib import Path

import httpx

from server.pd.trust import CALL_HEADER, sign_call
from server.testing.daemon import DEMO_MODEL, MODEL_NAME, Daemon, free_port, make_config

WORDS = "the fox jumps over a lazy dog while cats sleep in warm sun by the river "


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the engine process), MB."""
    total = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            total += int(line.split()[1]) / 1024
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        total += tree_rss_mb(int(child))
    return total


async def flood(d: Daemon, key: bytes, seconds: float, concurrency: int, chars: int) -> dict:
    """(``key``: the instance's KV transfer key, which its release calls need.)"""
    stop = time.monotonic() + seconds
    codes: dict[int, int] = {}
    peak = {"rss_mb": tree_rss_mb(d.proc.pid), "exports_bytes": 0}
    held: list[str] = []
    async with httpx.AsyncClient(timeout=120) as c:
        async def client(i: int) -> None:
            n = 0
            while time.monotonic() < stop:
                n += 1
                r = await c.post(d.base + "/v1/completions", json={
                    "model": MODEL_NAME, "prompt": f"{i} {n} " + (WORDS * 300)[:chars],
                    "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    held.append(r.json()["kv_transfer_params"]["remote_request_id"])

        async def watch() -> None:
            while time.monotonic() < stop:
                pd = (await c.get(d.mgmt + "/v1/status")).json()["pd"]
                peak["rss_mb"] = max(peak["rss_mb"], tree_rss_mb(d.proc.pid))
                peak["exports_bytes"] = max(peak["exports_bytes"], pd["exports_bytes"])
                await asyncio.sleep(0.25)

        await asyncio.gather(watch(), *(client(i) for i in range(concurrency)))
        pd = (await c.get(d.mgmt + "/v1/status")).json()["pd"]
        for rid in held:                       # what the coordinator does when D refuses
            content = json.dumps({"remote_request_id": rid}).encode()
            await c.post(d.mgmt + "/v1/kv/release", content=content, headers={
                CALL_HEADER: sign_call(key, "POST", "/v1/kv/release", content)})
    return {"codes": codes, "pd": pd, "peak": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--chars", type=int, default=2500, help="prompt length in characters")
    ap.add_argument("--cap-mb", type=int, default=0, help="pdMaxExportMb (0: the default)")
    ap.add_argument("--settle", type=float, default=3.0)
    args = ap.parse_args()
    server = {"inferMode": "dmi", "interCommPort": free_port(), "interCommTLSEnabled": False,
              "pdRole": "prefill", "pdPeers": ["127.0.0.1"], "maxLinkNum": 256}
    if args.cap_mb:
        server["pdMaxExportMb"] = args.cap_mb
    folder = Path(tempfile.mkdtemp(prefix="pd-flood-"))
    key = secrets.token_bytes(32)
    (folder / "kv-transfer.key").write_text(key.hex())
    server["pdTransferKeyFile"] = str(folder / "kv-transfer.key")
    cfg = make_config(folder, DEMO_MODEL, server=server, schedule={"cacheBlockSize": 16},
                      deploy={"maxSeqLen": 4096, "maxInputTokenLen": 4000})
    d = Daemon(cfg, env={"MTP_SERVE_COMPILE": "0"}).start()
    try:
        idle = tree_rss_mb(d.proc.pid)
        out = asyncio.run(flood(d, key, args.seconds, args.concurrency, args.chars))
        time.sleep(args.settle)
        after = tree_rss_mb(d.proc.pid)
        pd, peak = out["pd"], out["peak"]
        print(f"answers {out['codes']}")
        print(f"exports at the end {pd['exports_held']} ({pd['exports_bytes'] / 2**20:.0f} MB), "
              f"refused {pd['exports_refused']}, bound {pd['exports_limit']['count']} exports / "
              f"{pd['exports_limit']['bytes'] / 2**20:.0f} MB; peak held "
              f"{peak['exports_bytes'] / 2**20:.0f} MB")
        print(f"RSS idle {idle:.0f} MB, peak {peak['rss_mb']:.0f} MB (+{peak['rss_mb'] - idle:.0f}), "
              f"{args.settle:g} s after the release {after:.0f} MB (+{after - idle:.0f})")
    finally:
        d.terminate()


if __name__ == "__main__":
    main()
