"""PD benchmark (``python -m benchmarks.pd``, or ``benchmarks.serve --compare pd``): a co-located daemon vs 1 prefill + 1
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
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import Target, burst, scrape, start_daemon, stop_daemon
from server.testing.daemon import COORDINATOR_READY, Daemon, free_port


def _start_instance(name: str, base: Path, threads: int, role: str, key_file: Path,
                    kv_port: int, peers: list[str]) -> Target:
    """A PD instance with a fixed role, its KV port ``kv_port``; ``peers``: "ip" or
    "ip:kv_port" of the other role's instances."""
    def as_pd(cfg: dict) -> None:
        cfg["ServerConfig"].update(inferMode="dmi", interCommPort=kv_port, interCommTLSEnabled=False,
                                   pdRole=role, pdPeers=peers, pdTransferKeyFile=str(key_file))
    # Uncompiled like the co-located row, so the rows differ only in PD.
    return start_daemon(name, base, 1, threads, extra_env={"MTP_SERVE_COMPILE": "0"},
                        edit_config=as_pd)


def start_coordinator(p: Target, d: Target, key_file: Path, timeout: float = 120) -> Target:
    """The PD coordinator (python -m server.pd) in front of prefill ``p`` and decode ``d``
    (their roles fixed in their configs, the KV transfer key in ``key_file``); its target
    reads D's metrics.  start_s: the later instance's start plus its own."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-pd-coord-"))
    cfg = workdir / "coordinator.json"
    cfg.write_text(json.dumps({
        "ipAddress": "127.0.0.1", "port": free_port(), "assignRoles": False,
        "kvTransferKeyFile": str(key_file),
        "prefill": [{"business": p.base_url, "management": p.mgmt_url}],
        "decode": [{"business": d.base_url, "management": d.mgmt_url}]}))
    try:
        coord = Daemon(cfg, log_level=None, module="server.pd", ready=COORDINATOR_READY,
                       new_session=True).start(timeout)
    except RuntimeError:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Target("pd", coord.base, d.metrics_url, coord, workdir,
                  max(p.start_s, d.start_s) + coord.start_s)


def _long_prompts(n: int) -> list[list[dict]]:
    words = ("the prefill instance computes the prompt and the decode instance pulls its blocks "
             "before it drafts with the multi token prediction layer").split()
    return [[{"role": "user", "content": " ".join(words[(i * 7 + j) % len(words)]
                                                 for j in range(420))}] for i in range(n)]


def run(args) -> int:
    """The comparison, on parsed flags (``main``'s, or benchmarks.serve's)."""
    prompts = harness.load_prompts()["prompts"]
    levels = harness.levels(args.concurrency, "1,16")
    reps = args.reps or (1 if args.quick else 3)
    max_tokens = 32 if args.quick and args.max_tokens == 64 else args.max_tokens
    targets, instances = [], []
    key_dir = Path(tempfile.mkdtemp(prefix="bench-pd-key-"))
    key_file = key_dir / "kv-transfer.key"          # the deployment's KV transfer key
    key_file.write_text(secrets.token_hex(32))
    failed = True
    try:
        print("starting the co-located daemon, P, D and the coordinator ...", file=sys.stderr)
        targets.append(start_daemon("colocated", args.config_file, 1, args.threads,
                                    extra_env={"MTP_SERVE_COMPILE": "0"}))
        p_kv = free_port()
        p = _start_instance("prefill", args.config_file, args.threads, "prefill", key_file, p_kv,
                            ["127.0.0.1"])
        d = _start_instance("decode", args.config_file, args.threads, "decode", key_file, free_port(),
                            [f"127.0.0.1:{p_kv}"])
        instances += [p, d]
        targets.append(start_coordinator(p, d, key_file))
        model = asyncio.run(harness.model_id(targets[0]))
        warmup = {t.name: harness.chat_warm_up(t, model, prompts) for t in targets}
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
        shutil.rmtree(key_dir, ignore_errors=True)
    table = {name: {label: harness.medians(runs) for label, runs in per.items()}
             for name, per in rows.items()}
    for name in table:
        for label in table[name]:
            mbs = [r["kv_mb_s"] for r in rows[name][label] if r.get("kv_mb_s") is not None]
            table[name][label]["kv_mb_s"] = statistics.median(mbs) if mbs else None
    report = {**harness.report_header(threads=args.threads), "reps": reps, "max_tokens": max_tokens,
              "results": table, "start_s": {t.name: round(t.start_s, 1) for t in targets},
              "warmup": warmup}
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
    print("warm-up (4 requests of 8 tokens, not in the medians): " + ", ".join(
        f"{n} {w['output_tok_s']:.1f} tok/s" for n, w in warmup.items()))
    harness.save_report(report, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, "default 1,16")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
