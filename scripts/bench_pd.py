#!/usr/bin/env python
"""PD benchmark (``scripts/bench.py --compare pd``): a co-located daemon vs 1 prefill + 1
decode instance behind the coordinator, all on this machine, MTP k=1, the demo model.

Rows per concurrency (the bench prompt set, streamed, greedy): tokens/s, TTFT and TPOT
medians, and the KV moved from P to D during the burst (MB/s over the burst's wall time,
from the instances' kv_transfer_bytes_total).  A last row sends ~860-token prompts one
at a time, where PD's KV transfer (instead of D prefilling) is the point.  On one machine
P and D share its cores, so PD cannot win here what it wins on separate nodes (prefill
and decode no longer slow each other down); the figures show its overhead honestly.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (ROOT, Target, _free_port, _machine, _median_dict, burst,  # noqa: E402
                   model_id, scrape, start_daemon, stop_daemon)


def _start_instance(name: str, base: Path, threads: int, role: str) -> Target:
    def as_pd(cfg: dict) -> None:
        cfg["ServerConfig"].update(inferMode="dmi", interCommPort=_free_port(),
                                   interCommTLSEnabled=False, pdRole=role, pdPeers=["127.0.0.1"])
    # Uncompiled like the co-located row, so the rows differ only in PD.
    return start_daemon(name, base, 1, threads, extra_env={"MTP_SERVE_COMPILE": "0"},
                        edit_config=as_pd)


def _start_coordinator(p: Target, d: Target) -> Target:
    workdir = Path(tempfile.mkdtemp(prefix="bench-pd-coord-"))
    port = _free_port()
    mgmt = {t.name: t.metrics_url.rsplit("/", 1)[0] for t in (p, d)}
    (workdir / "coordinator.json").write_text(json.dumps({
        "ipAddress": "127.0.0.1", "port": port, "assignRoles": False,
        "prefill": [{"business": p.base_url, "management": mgmt[p.name]}],
        "decode": [{"business": d.base_url, "management": mgmt[d.name]}]}))
    log = open(workdir / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "server.pd", "--config-file",
                             str(workdir / "coordinator.json")], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        if "Coordinator start success" in (workdir / "daemon.log").read_text(errors="replace"):
            return Target("pd", f"http://127.0.0.1:{port}", d.metrics_url, proc, workdir,
                          max(p.start_s, d.start_s) + time.monotonic() - t0)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the coordinator did not start")


def _long_prompts(n: int) -> list[list[dict]]:
    words = ("the prefill instance computes the prompt and the decode instance pulls its blocks "
             "before it drafts with the multi token prediction layer").split()
    return [[{"role": "user", "content": " ".join(words[(i * 7 + j) % len(words)]
                                                 for j in range(420))}] for i in range(n)]


def main(args) -> int:
    prompts = json.loads((ROOT / "scripts" / "bench_prompts.json").read_text())["prompts"]
    levels = [int(x) for x in (args.concurrency or "1,16").split(",")]
    reps = args.reps or (1 if args.quick else 3)
    max_tokens = 32 if args.quick and args.max_tokens == 64 else args.max_tokens
    targets, instances = [], []
    failed = True
    try:
        print("starting the co-located daemon, P, D and the coordinator ...", file=sys.stderr)
        targets.append(start_daemon("colocated", args.config_file, 1, args.threads,
                                    extra_env={"MTP_SERVE_COMPILE": "0"}))
        p = _start_instance("prefill", args.config_file, args.threads, "prefill")
        d = _start_instance("decode", args.config_file, args.threads, "decode")
        instances += [p, d]
        targets.append(_start_coordinator(p, d))
        model = asyncio.run(model_id(targets[0]))
        for t in targets:                            # warm-up
            asyncio.run(burst(t, model, prompts, 4, 4, 8))
        rows: dict[str, dict[str, list[dict]]] = {t.name: {} for t in targets}
        cases = [(f"c={c}", prompts, c, max(c * (2 if args.quick else 3), 4)) for c in levels]
        cases.append(("long c=1", _long_prompts(6), 1, 6))
        for _ in range(reps):
            for label, ps, c, n in cases:
                for t in targets:
                    before = asyncio.run(scrape(d.metrics_url))
                    t0 = time.perf_counter()
                    r = asyncio.run(burst(t, model, ps, c, n, max_tokens))
                    wall = time.perf_counter() - t0
                    after = asyncio.run(scrape(d.metrics_url))
                    moved = sum(v for k, v in after.items() if k.startswith("kv_transfer_bytes_total")) \
                        - sum(v for k, v in before.items() if k.startswith("kv_transfer_bytes_total"))
                    r["kv_mb_s"] = moved / wall / 1e6 if t.name == "pd" else None
                    rows[t.name].setdefault(label, []).append(r)
                    print(f"  {t.name} {label}: {r['output_tok_s']:.1f} tok/s", file=sys.stderr)
        failed = any(r.get("errors") for per in rows.values() for runs in per.values() for r in runs)
    finally:
        for t in targets + instances:
            stop_daemon(t, keep_logs=failed)
    table = {name: {label: _median_dict(runs) for label, runs in per.items()}
             for name, per in rows.items()}
    for name in table:
        for label in table[name]:
            mbs = [r["kv_mb_s"] for r in rows[name][label] if r.get("kv_mb_s") is not None]
            table[name][label]["kv_mb_s"] = statistics.median(mbs) if mbs else None
    report = {"machine": _machine(), "threads": args.threads, "reps": reps, "max_tokens": max_tokens,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": table,
              "start_s": {t.name: round(t.start_s, 1) for t in targets},
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}
    print(f"\nmachine: {report['machine']}   date: {report['date']}   reps: {reps} (medians)   "
          f"threads: {args.threads}   max_tokens: {max_tokens}")
    print(f"{'config':10} {'load':9} {'tok/s':>7} {'x coloc':>7} {'TTFT p50':>9} {'TPOT p50':>9} "
          f"{'KV MB/s':>8}")
    for label in table["colocated"]:
        base = table["colocated"][label]["output_tok_s"]
        for name in ("colocated", "pd"):
            r = table[name][label]
            tp = f"{r['tpot_median'] * 1e3:.1f}ms" if r.get("tpot_median") else "-"
            mb = f"{r['kv_mb_s']:.2f}" if r.get("kv_mb_s") is not None else "-"
            print(f"{name:10} {label:9} {r['output_tok_s']:7.1f} {r['output_tok_s'] / base:7.2f} "
                  f"{r['ttft_median'] * 1e3:7.0f}ms {tp:>9} {mb:>8}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0
