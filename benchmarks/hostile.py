"""Do hostile requests slow everyone else, or keep memory?  Bounded, one command.

    .venv/bin/python -m benchmarks.hostile [--rounds 3]

Starts the daemon (bundled demo model, MTP k=1, maxRequestLength 40 MB) and

1. times 16 concurrent users, each asking for 128 tokens (ignore_eos), first alone, then
   while 4 clients repeat requests that used to reach the engine and fail its step
   (``top_k`` 2**63, a ``logit_bias`` key "²"); prints median and worst latency and what
   the hostile clients got;
2. sends three 39 MB chat bodies, one after the other, and prints the daemon's RSS
   before, at its highest while they were handled, and 2 s after the last.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks import harness
from server.testing.daemon import DEMO_MODEL, MODEL_NAME, Daemon, make_config

USER = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count to one hundred."}],
        "max_tokens": 128, "ignore_eos": True, "temperature": 0}
POISON = [{**USER, "max_tokens": 8, "top_k": 2 ** 63},
          {**USER, "max_tokens": 8, "logit_bias": {"\u00b2": 1.0}}]


async def users(client: httpx.AsyncClient, base: str) -> list[float]:
    async def one() -> float:
        t0 = time.monotonic()
        r = await client.post(base + "/v1/chat/completions", json=USER, timeout=300)
        assert r.status_code == 200, r.text
        return time.monotonic() - t0
    return list(await asyncio.gather(*(one() for _ in range(16))))


async def run(base: str, rounds: int) -> dict:
    out: dict = {"alone": [], "with_poison": [], "poison_statuses": Counter()}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        await users(client, base)                               # warm-up
        for _ in range(rounds):
            out["alone"] += await users(client, base)
            stop = asyncio.Event()

            async def poison(i: int) -> None:
                while not stop.is_set():
                    r = await client.post(base + "/v1/chat/completions", json=POISON[i % 2],
                                          timeout=60)
                    out["poison_statuses"][r.status_code] += 1

            tasks = [asyncio.create_task(poison(i)) for i in range(4)]
            out["with_poison"] += await users(client, base)
            stop.set()
            await asyncio.gather(*tasks)
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def big_bodies(base: str, pid: int) -> dict:
    body = {**USER, "messages": [{"role": "user", "content": "x" * (39 * 1024 * 1024)}]}
    before, peak, statuses = rss_mb(pid), 0.0, Counter()
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(3):
            task = asyncio.create_task(client.post(base + "/v1/chat/completions", json=body))
            while not task.done():
                peak = max(peak, rss_mb(pid))
                await asyncio.sleep(0.02)
            statuses[task.result().status_code] += 1
    await asyncio.sleep(2)
    return {"before": before, "peak": peak, "after": rss_mb(pid), "statuses": dict(statuses)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="poison-") as tmp:
        cfg = make_config(Path(tmp), DEMO_MODEL, deploy={"maxSeqLen": 512},
                          server={"maxRequestLength": 40},
                          schedule={"maxBatchSize": 32, "maxIterTimes": 256})
        daemon = Daemon(cfg, log_level="error").start(timeout_s=600)
        try:
            res = asyncio.run(run(daemon.base, args.rounds))
            big = asyncio.run(big_bodies(daemon.base, daemon.proc.pid))
        finally:
            daemon.terminate(timeout_s=120)
    for key in ("alone", "with_poison"):
        xs = res[key]
        print(f"{key:12s} 16 users x 128 tokens, {len(xs)} requests: median "
              f"{statistics.median(xs):.2f} s, worst {max(xs):.2f} s")
    print("hostile requests answered:", dict(res["poison_statuses"]))
    print(f"3 x 39 MB bodies answered {big['statuses']}; daemon RSS {big['before']:.0f} MB "
          f"before, {big['peak']:.0f} MB at most, {big['after']:.0f} MB 2 s after")
    return 0 if set(res["poison_statuses"]) <= {400} and set(big["statuses"]) <= {400} else 1


if __name__ == "__main__":
    sys.exit(main())
