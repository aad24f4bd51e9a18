"""The serving path of two checkouts, side by side: this one and ``--base`` (for example
``git worktree add /tmp/base HEAD~1``), each a daemon on the demo model with MTP k=1.

Rows, medians over alternating requests (one client, so the two daemons share the machine
the same way): ``GET /v1/models`` (the HTTP stack alone), a non-streamed chat answer of
one token (HTTP, planning, the engine hand-off and one prefill), and a streamed answer to
a bench prompt (greedy, up to 64 tokens, stopping at EOS): its TTFT and its whole time.
The queue delay is 500 us (its minimum), so it does not hide the rest.  Per-request costs
show at concurrency 1 and in short answers, where the bench's tokens/s ratios of MTP on
vs off are diluted by them.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.harness import DEFAULT_CONFIG, ROOT, start_daemon, stop_daemon, stream_chat


def _min_delay(cfg: dict) -> None:
    cfg["BackendConfig"]["ScheduleConfig"]["maxQueueDelayMicroseconds"] = 500


async def _measure(targets: list, prompts: list, n: int) -> dict[str, dict[str, list[float]]]:
    model = await harness.model_id(targets[0])
    rows = {t.name: {"GET /v1/models": [], "1-token chat": [], "streamed TTFT": [],
                     "streamed answer": []} for t in targets}
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(n):
            messages = prompts[i % len(prompts)]
            for t in targets:
                row = rows[t.name]
                t0 = time.perf_counter()
                (await client.get(t.base_url + "/v1/models")).raise_for_status()
                row["GET /v1/models"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                (await client.post(t.base_url + "/v1/chat/completions", json={
                    "model": model, "messages": messages, "max_tokens": 1})).raise_for_status()
                row["1-token chat"].append(time.perf_counter() - t0)
                r = await stream_chat(client, t.base_url, model, messages, 64)
                row["streamed TTFT"].append(r.ttft)
                row["streamed answer"].append(r.latency)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the other checkout")
    ap.add_argument("--requests", type=int, default=80, help="of each kind, per daemon")
    args = ap.parse_args(argv)
    prompts = harness.load_prompts()["prompts"]
    targets = []
    try:
        for name, root in (("base", args.base.resolve()), ("this", ROOT)):
            targets.append(start_daemon(name, DEFAULT_CONFIG, 1, 1, edit_config=_min_delay, root=root))
        rows = asyncio.run(_measure(targets, prompts, args.requests))
        print(f"{'median, ms':24s}" + "".join(f"{t.name:>10s}" for t in targets))
        for row in rows[targets[0].name]:
            print(f"{row:24s}" + "".join(f"{statistics.median(rows[t.name][row]) * 1e3:10.2f}"
                                          for t in targets))
    finally:
        for t in targets:
            stop_daemon(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
