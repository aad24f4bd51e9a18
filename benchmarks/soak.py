"""Soak and chaos run against a real daemon: bounded, reproducible, one command.

    .venv/bin/python -m benchmarks.soak --minutes 20 --concurrency 64 --out soak.json

Starts the daemon on free loopback ports with the bundled demo model, MTP k=1 and the
prefix cache on, and keeps ``--concurrency`` clients busy for ``--minutes`` with a seeded
mix: streamed and whole chat completions, tool calls, reasoning, completions, a few
malformed bodies (400 expected), clients that vanish mid-stream (abort), clients whose
own timeout fires mid-request, and half-sent bodies (408 expected).  Every
``--sample-s`` it records the daemon's RSS, open descriptors, threads and asyncio tasks
and its KV pool.  At the end it waits for the pool to empty and checks:

- every request is accounted for: answered, or counted with its cause;
- no 5xx;
- RSS growth after warm-up (the first fifth of the run) at most ``--max-rss-growth`` %;
- the KV pool back to 100 % free, descriptors, threads and tasks back to their level.

Exit code 0 when every check holds, 1 otherwise.  Not part of ``scripts/test.sh``.
What it cannot inject from outside: a step that raises inside the engine (every value
that made one is now refused with 400 before the engine).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks import harness
from server.testing.daemon import DEMO_MODEL, MODEL_NAME, Daemon, make_config

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
QUESTIONS = ["What is 12 plus 30?", "What is the capital of France?", "Name three colours.",
             "Explain what a list is in Python.", "What is 7 times 8?", "Say hello."]
KINDS = [("stream", 30), ("whole", 20), ("tools", 10), ("reasoning", 10), ("completion", 10),
         ("invalid", 5), ("abort", 7), ("client_timeout", 5), ("half_sent", 3)]


def proc_sample(pid: int) -> dict:
    """RSS (MB), open descriptors and threads of ``pid`` from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
            "fds": len(list(Path(f"/proc/{pid}/fd").iterdir())),
            "os_threads": int(fields["Threads"])}


async def sample(client: httpx.AsyncClient, daemon: Daemon, t0: float) -> dict:
    st = (await client.get(daemon.mgmt + "/v1/status")).json()
    kv = st["kv_cache"]
    return {"t_s": round(time.monotonic() - t0, 1), **proc_sample(daemon.proc.pid),
            "asyncio_tasks": st["process"]["asyncio_tasks"],
            "threads": st["process"]["threads"], "in_flight": st["in_flight"],
            "kv_free_blocks": kv["free_blocks"], "kv_total_blocks": kv["total_blocks"]}


def body(kind: str, rng: random.Random) -> tuple[str, dict]:
    q = rng.choice(QUESTIONS)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": q}],
            "max_tokens": rng.randint(8, 48), "temperature": rng.choice([0, 0.7])}
    if kind == "tools":
        return "/v1/chat/completions", {**chat, "tools": [WEATHER],
                                        "messages": [{"role": "user",
                                                      "content": "What is the weather in Paris?"}]}
    if kind == "reasoning":
        return "/v1/chat/completions", {**chat, "chat_template_kwargs": {"thinking": True},
                                        "stream": rng.random() < 0.5}
    if kind == "completion":
        return "/v1/completions", {"model": MODEL_NAME, "prompt": q, "max_tokens": 24,
                                   "temperature": 0}
    if kind == "invalid":
        return "/v1/chat/completions", rng.choice([
            {**chat, "top_k": 2 ** 63}, {**chat, "logit_bias": {"\u00b2": 1}},
            {**chat, "max_tokens": "3"}, {**chat, "messages": []}])
    return "/v1/chat/completions", {**chat, "stream": kind in ("stream", "abort",
                                                               "client_timeout")}


async def half_sent(daemon: Daemon) -> str:
    """Headers and 12 bytes of a 1000-byte body, then wait for the daemon's 408."""
    host, port = daemon.base.rsplit("//", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                 b"\r\n{\"messages\":")
    await writer.drain()
    try:
        line = await asyncio.wait_for(reader.readline(), timeout=30)
    finally:
        writer.close()
    return "408 (half-sent body, expected)" if b" 408 " in line else f"half-sent: {line[:40]!r}"


async def one(client: httpx.AsyncClient, daemon: Daemon, kind: str, rng: random.Random) -> str:
    """Run one request of ``kind``; returns its outcome label."""
    if kind == "half_sent":
        return await half_sent(daemon)
    if kind == "client_timeout":          # the client gives up 0.2 s in, whatever it got
        try:
            return await asyncio.wait_for(_request(client, daemon, kind, rng), timeout=0.2)
        except asyncio.TimeoutError:
            return "client timeout (injected)"
    return await _request(client, daemon, kind, rng)


async def _request(client: httpx.AsyncClient, daemon: Daemon, kind: str,
                   rng: random.Random) -> str:
    path, payload = body(kind, rng)
    url = daemon.base + path
    try:
        if payload.get("stream"):
            async with client.stream("POST", url, json=payload, timeout=120) as r:
                if r.status_code != 200:
                    await r.aread()
                    return _status(r, kind)
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        n += 1
                        if kind == "abort" and n >= 3:
                            return "aborted by the client mid-stream (injected)"
                        if line == "data: [DONE]":
                            return "200"
                        if '"error"' in line[:20]:
                            return "error event in stream"
                return "stream ended without [DONE]"
        r = await client.post(url, json=payload, timeout=120)
        return _status(r, kind)
    except httpx.TimeoutException:
        return "client timeout"
    except httpx.TransportError as exc:
        return f"transport error: {type(exc).__name__}"


def _status(r: httpx.Response, kind: str) -> str:
    if r.status_code == 200:
        return "200"
    if r.status_code == 400 and kind == "invalid":
        return "400 (malformed on purpose, expected)"
    try:
        msg = r.json()["error"]["message"][:60]
    except Exception:
        msg = r.text[:60]
    return f"{r.status_code}: {msg}"


EXPECTED = ("200", "400 (malformed", "aborted by the client", "client timeout (injected)",
            "408 (half-sent")


async def drive(daemon: Daemon, minutes: float, concurrency: int, sample_s: float,
                seed: int) -> dict:
    rng = random.Random(seed)
    kinds = [k for k, w in KINDS for _ in range(w)]
    outcomes: Counter = Counter()
    started = [0]
    samples: list[dict] = []
    t0 = time.monotonic()
    deadline = t0 + minutes * 60
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client, \
            httpx.AsyncClient(timeout=30) as probe:
        async def worker(i: int) -> None:
            wrng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                started[0] += 1
                try:
                    outcome = await one(client, daemon, wrng.choice(kinds), wrng)
                except Exception as exc:      # counted with its cause, never dropped
                    outcome = f"client-side exception: {type(exc).__name__}"
                outcomes[outcome] += 1

        async def sampler() -> None:
            while time.monotonic() < deadline:
                samples.append(await sample(probe, daemon, t0))
                await asyncio.sleep(sample_s)

        idle = await sample(probe, daemon, t0)
        await asyncio.gather(sampler(), *(worker(i) for i in range(concurrency)))
        # Drain: the pool must empty once the last answers are out.
        end_by = time.monotonic() + 30
        while True:
            last = await sample(probe, daemon, t0)
            if (last["kv_free_blocks"] == last["kv_total_blocks"] and last["in_flight"] == 0) \
                    or time.monotonic() > end_by:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(6)            # idle keep-alive connections close after 5 s
        settled = await sample(probe, daemon, t0)
    del rng
    return {"idle": idle, "samples": samples, "end": last, "settled": settled,
            "outcomes": dict(outcomes.most_common()), "started": started[0]}


def verdict(rep: dict, max_rss_growth: float) -> dict:
    samples = rep["samples"]
    warm = samples[max(1, len(samples) // 5)] if len(samples) > 1 else rep["idle"]
    end, settled, idle = rep["end"], rep["settled"], rep["idle"]
    growth = 100.0 * (settled["rss_mb"] - warm["rss_mb"]) / warm["rss_mb"]
    early_max = max(s["threads"] for s in samples[:max(1, len(samples) // 2)])
    unexpected = {k: v for k, v in rep["outcomes"].items() if not k.startswith(EXPECTED)}
    server_errors = {k: v for k, v in rep["outcomes"].items() if k[:1] == "5"}
    checks = {
        "requests": sum(rep["outcomes"].values()),
        "no_5xx": not server_errors,
        "started": rep["started"],
        "every_request_accounted": rep["started"] == sum(rep["outcomes"].values()),
        "unexpected_outcomes": unexpected,
        "rss_mb_after_warmup": round(warm["rss_mb"], 1),
        "rss_mb_end": round(settled["rss_mb"], 1),
        "rss_growth_pct": round(growth, 2),
        "rss_ok": growth <= max_rss_growth,
        "kv_free_at_end": f"{end['kv_free_blocks']}/{end['kv_total_blocks']}",
        "kv_ok": end["kv_free_blocks"] == end["kv_total_blocks"],
        # Idle before and after: descriptors and tasks back to their level.  Thread pools
        # start lazily and their size follows the load (16-23 in a 64-client run), so
        # threads at the end are compared with the most seen in the first half of the run,
        # with a margin of 4 for that jitter: a leak outgrows it.
        "fds_idle_start_end": (idle["fds"], settled["fds"]),
        "fds_ok": settled["fds"] <= idle["fds"] + 2,
        "threads_start_early_max_end": (idle["threads"], early_max, settled["threads"]),
        "threads_ok": settled["threads"] <= early_max + 4,
        "tasks_idle_start_end": (idle["asyncio_tasks"], settled["asyncio_tasks"]),
        "tasks_ok": settled["asyncio_tasks"] <= idle["asyncio_tasks"] + 2,
    }
    checks["ok"] = all(checks[k] for k in ("no_5xx", "every_request_accounted", "rss_ok", "kv_ok", "fds_ok",
                                           "threads_ok", "tasks_ok")) and not unexpected
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--max-rss-growth", type=float, default=5.0, help="percent")
    ap.add_argument("--out", type=Path, help="write the report (JSON) here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        cfg = make_config(Path(tmp), DEMO_MODEL, server={
            "maxLinkNum": max(64, args.concurrency), "tokenTimeout": 60, "e2eTimeout": 300,
            "clientHeaderTimeout": 5, "clientBodyTimeout": 5, "maxRequestLength": 4},
            model={"plugin_params": json.dumps({"plugin_type": "mtp,prefix_cache",
                                                "num_speculative_tokens": 1})},
            deploy={"maxSeqLen": 1024, "maxInputTokenLen": 512},
            schedule={"maxBatchSize": 64, "maxIterTimes": 128})
        daemon = Daemon(cfg, log_level="error").start(timeout_s=600)
        try:
            rep = asyncio.run(drive(daemon, args.minutes, args.concurrency, args.sample_s,
                                    args.seed))
        finally:
            code = daemon.terminate(timeout_s=120)
    rep["exit_code"] = code
    rep["checks"] = verdict(rep, args.max_rss_growth)
    rep["args"] = {k: str(v) for k, v in vars(args).items()}
    text = json.dumps(rep, indent=2)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({"checks": rep["checks"], "outcomes": rep["outcomes"],
                      "daemon_exit_code": code}, indent=2))
    return 0 if rep["checks"]["ok"] and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
