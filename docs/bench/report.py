"""The tables of docs/benchmarks.md, made from the saved JSON reports in this folder.

    python docs/bench/report.py            # print every table
    python docs/bench/report.py --check    # exit 1 if a table in docs/benchmarks.md differs
    python docs/bench/report.py --write    # rewrite those tables in docs/benchmarks.md

In docs/benchmarks.md a table follows a ``<!-- table NAME -->`` line (its lines start with "|").
Standard library only; no project imports.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "benchmarks.md"


def load(name: str) -> dict:
    return json.loads((HERE / name).read_text())


def md(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def x(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def ms(s: float | None, digits: int = 1) -> str:
    return "-" if s is None else f"{s * 1000:.{digits}f} ms"


def acc(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def serve() -> str:
    d = load("serve_ignore_eos.json")
    res, rows = d["results"], []
    for conc in res["off"]:
        off = res["off"][conc]["output_tok_s"]
        for cfg in ("off", "k1", "k2"):
            r = res[cfg][conc]
            steps = r["steps_per_k"]
            total = sum(steps.values())
            share = "/".join(f"{100 * v / total:.0f}%" for v in steps.values()) if cfg != "off" else "-"
            rows.append([cfg, conc, f"{r['output_tok_s']:.1f}", x(r["output_tok_s"], off),
                         ms(r["tpot_median"]), ms(r["ttft_median"], 0), acc(r["acceptance_rate"]),
                         acc(r["mean_accepted_len"]), share])
    return md(["config", "concurrency", "tok/s", "x off", "TPOT p50", "TTFT p50", "acceptance",
               "mean accepted length", "steps at k=0/1/2"], rows)


def transformers() -> str:
    d = load("serve_ignore_eos.json")
    rows = []
    for b in ("1", "16"):
        ours = d["results"]["k1"][b]["output_tok_s"]
        theirs = d["transformers_tok_s"][b]
        rows.append([b, f"{theirs:.1f}", f"{ours:.1f}", x(ours, theirs)])
    return md(["batch / concurrency", "transformers generate() tok/s", "daemon k=1 tok/s", "daemon / transformers"], rows)


def ttft() -> str:
    d = load("serve_ignore_eos.json")
    fwd = d["prefill_forward_200_s"]
    rows = [[cfg, ms(t, 0), ms(fwd, 0), x(t, fwd)] for cfg, t in d["ttft_200_prompt_s"].items()]
    return md(["config", f"TTFT, {d['ttft_prompt_tokens']}-token prompt", "one prefill forward", "TTFT / forward"], rows)


def pair(name: str, a: str, b: str, cols: tuple[str, str], accept: bool = False) -> str:
    res = load(name)["results"]
    rows = []
    for conc in res[a]:
        ra, rb = res[a][conc], res[b][conc]
        row = [conc, f"{ra['output_tok_s']:.1f}", f"{rb['output_tok_s']:.1f}", x(rb["output_tok_s"], ra["output_tok_s"]),
               f"{ms(ra['tpot_median'])} → {ms(rb['tpot_median'])}", f"{ms(ra['ttft_median'], 0)} → {ms(rb['ttft_median'], 0)}"]
        if accept:
            row.append(f"{acc(ra['acceptance_rate'])} / {acc(rb['acceptance_rate'])}")
        rows.append(row)
    head = ["concurrency", f"{cols[0]} tok/s", f"{cols[1]} tok/s", f"{cols[1]} / {cols[0]}",
            "TPOT p50", "TTFT p50"] + (["acceptance"] if accept else [])
    return md(head, rows)


def process() -> str:
    res = load("process.json")["results"]
    rows = []
    for conc in res["t-off"]:
        t0, p0 = res["t-off"][conc]["output_tok_s"], res["p-off"][conc]["output_tok_s"]
        t1, p1 = res["t-k1"][conc]["output_tok_s"], res["p-k1"][conc]["output_tok_s"]
        rows.append([conc, f"{t0:.1f} → {p0:.1f}", x(p0, t0), f"{t1:.1f} → {p1:.1f}", x(p1, t1),
                     f"{ms(res['t-k1'][conc]['tpot_median'])} → {ms(res['p-k1'][conc]['tpot_median'])}"])
    return md(["concurrency", "off: thread → process tok/s", "process / thread", "k=1: thread → process tok/s",
               "process / thread", "k=1 TPOT p50"], rows)


def compile_() -> str:
    d = load("compile.json")
    res, st, cs = d["results"], d["start_s"], d["compiled_s"]
    rows = []
    for conc in res["eager"]:
        e = res["eager"][conc]["output_tok_s"]
        rows.append([f"tok/s, concurrency {conc}", f"{e:.1f}"] + [
            f"{res[k][conc]['output_tok_s']:.1f} ({x(res[k][conc]['output_tok_s'], e)})" for k in ("cold", "warm")])
    for conc in res["eager"]:
        rows.append([f"TPOT p50, concurrency {conc}"] + [ms(res[k][conc]["tpot_median"]) for k in ("eager", "cold", "warm")])
    rows.append(["launch to ready"] + [f"{st[k]} s" for k in ("eager", "cold", "warm")])
    rows.append(["launch to compiled step in use", "-", f"{cs['cold']} s", f"{cs['warm']} s"])
    return md(["", "uncompiled", "compiled, first start", "compiled, later start"], rows)


def kvpool() -> str:
    d = load("kvpool.json")
    res, rows = d["results"], []
    base = res["no-tier"]["ttft_1000_s"]
    for name, label in (("no-tier", "no KV pool"), ("host-tier", "host tier")):
        r = res[name]
        rows.append([label, f"{r['hit_rate']:.3f}", f"{r['device_hit_rate']:.3f}", f"{r['host_hit_rate']:.3f}",
                     f"{r['ttft_1000_s']:.3f} s ({min(r['ttft_all_s']):.3f}-{max(r['ttft_all_s']):.3f})",
                     "1.00x" if name == "no-tier" else f"{base / r['ttft_1000_s']:.1f}x lower"])
    dr = d["disk_restart"]
    rows.append(["host + disk tier, after a restart", "", "", "",
                 f"{dr['ttft_1000_s']:.3f} s ({min(dr['ttft_all_s']):.3f}-{max(dr['ttft_all_s']):.3f})",
                 f"{base / dr['ttft_1000_s']:.1f}x lower"])
    return md(["", "hit rate", "device", "host", "TTFT, ~1,000-token prompt (range of 5)", "vs no pool"], rows)


def structured() -> str:
    res, rows = load("structured.json")["results"], []
    for sched, r in res.items():
        for conc in r["plain"]:
            p, j = r["plain"][conc], r["json_schema"][conc]
            rows.append([sched, conc, f"{p['output_tok_s']:.1f}", f"{j['output_tok_s']:.1f}",
                         x(j["output_tok_s"], p["output_tok_s"]),
                         f"{acc(p['acceptance_rate'])} → {acc(j['acceptance_rate'])}",
                         f"{p['tokens_per_request']:.1f} / {j['tokens_per_request']:.1f}", f"{100 * j['valid']:.0f}%"])
    return md(["scheduling", "concurrency", "plain tok/s", "json_schema tok/s", "json / plain", "acceptance",
               "tokens per answer plain / json", "valid JSON"], rows)


TABLES = {
    "serve": serve, "transformers": transformers, "ttft": ttft,
    "async": lambda: pair("async.json", "sync", "async", ("sync", "async")),
    "process": process, "compile": compile_, "kvpool": kvpool,
    "quant": lambda: pair("quant.json", "float", "int8", ("float", "int8"), accept=True),
    "kv_int8": lambda: pair("kv_int8.json", "kvfp", "kvint8", ("float KV", "int8 KV")),
    "tp": lambda: pair("tp.json", "tp1", "tp2", ("tp=1", "tp=2")),
    "structured": structured,
}
BLOCK = re.compile(r"(<!-- table (\w+) -->\n)((?:\|.*\n)*)")


def main(argv: list[str]) -> int:
    if not argv:
        for name, fn in TABLES.items():
            print(f"<!-- table {name} -->\n{fn()}\n")
        return 0
    text = DOC.read_text()
    new = BLOCK.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + "\n", text)
    if argv[0] == "--write":
        DOC.write_text(new)
        return 0
    stale = [m.group(2) for m in BLOCK.finditer(text) if m.group(3) != TABLES[m.group(2)]() + "\n"]
    for name in stale:
        print(f"docs/benchmarks.md: table {name} differs from docs/bench/", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
