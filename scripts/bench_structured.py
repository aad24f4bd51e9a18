#!/usr/bin/env python
"""Throughput cost of constraints (``scripts/bench.py --compare structured``): daemons on the
demo model with MTP k=1 (synchronous scheduling, and asynchronous with the worker
process), the same chat prompts with and without a ``json_schema`` ``response_format``,
greedy, at each concurrency level (default 16).

Bursts alternate between the two kinds (plain, constrained, plain, ...) so that machine
drift hits both, and the table reports medians over repetitions: output tokens/s, the
constrained/plain ratio, MTP acceptance rate, and the share of constrained outputs that
validate against the schema.  The prompts are weather questions the demo model answers
with a tool call when left free, so both kinds run about the same number of tokens.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import _machine, model_id, scrape, start_daemon, stop_daemon  # noqa: E402

CITIES = ["Paris", "Tokyo", "London", "Cairo", "Madrid", "Oslo", "Rome", "Berlin", "Lima", "Perth",
          "Seattle", "Milan", "Naples", "Dublin", "Vienna", "Prague"]
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
    "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
    "required": ["city", "temperature_c", "conditions"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


async def _burst(base: str, metrics: str, model: str, constrained: bool, concurrency: int,
                 n: int, max_tokens: int) -> dict:
    before = await scrape(metrics)
    sem = asyncio.Semaphore(concurrency)
    tokens, valid, errors = [], [], []
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i: int) -> None:
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [
                {"role": "user", "content": f"What is the weather in {CITIES[i % len(CITIES)]}?"}]}
            if constrained:
                body["response_format"] = FORMAT
            async with sem:
                r = await client.post(base + "/v1/chat/completions", json=body)
            if r.status_code != 200:
                errors.append(r.text[:200])
                return
            data = r.json()
            tokens.append(data["usage"]["completion_tokens"])
            if constrained:
                try:
                    obj = json.loads(data["choices"][0]["message"]["content"])
                    valid.append(set(obj) == set(SCHEMA["required"]))
                except ValueError:
                    valid.append(False)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    after = await scrape(metrics)
    drafts = after.get("spec_decode_num_draft_tokens_total", 0) - before.get("spec_decode_num_draft_tokens_total", 0)
    acc = after.get("spec_decode_num_accepted_tokens_total", 0) - before.get("spec_decode_num_accepted_tokens_total", 0)
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
    return {"output_tok_s": sum(tokens) / wall, "tokens_per_request": statistics.mean(tokens),
            "acceptance_rate": acc / drafts if drafts else None,
            "valid": (sum(valid) / len(valid)) if valid else None}


def mask_cost(weights: Path, batch: int = 16, k: int = 1, threads: int = 1) -> dict:
    """In-process cost of the grammar work of one verify step at ``batch`` constrained
    requests holding ``k`` drafts each: llguidance masks for every row (grammar.window_masks),
    the tensor op that applies them, and the commit of the emitted tokens; averaged over
    the tokens of a schema-valid answer."""
    import torch
    torch.set_num_threads(threads)            # as the daemons run (OMP_NUM_THREADS=--threads)
    from server.api.grammars import response_format_grammar
    from server.engine.sample import grammar as G
    from server.engine.sample import grammar_masks as GM
    from server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(weights)
    vocab = json.loads((weights / "config.json").read_text())["vocab_size"]
    book = G.GrammarBook(str(weights), vocab)
    g = response_format_grammar(FORMAT).grammar
    book.compile(g)
    ids = tok.encode(json.dumps({"city": "Paris", "temperature_c": 21, "conditions": "sunny"}))
    applier = GM.MaskApplier(vocab, torch.device("cpu"))
    logits = torch.randn(batch * (k + 1), vocab)
    masks_s = apply_s = 0.0
    for _ in range(5):
        ms = [book.matcher(g, []) for _ in range(batch)]
        for j in range(len(ids) - k):
            t0 = time.perf_counter()
            rows, bm = GM.window_masks(ms, [ids[j + 1:j + 1 + k]] * batch, book.words)
            t1 = time.perf_counter()
            applier.apply(logits, torch.tensor(rows), bm)
            t2 = time.perf_counter()
            for m in ms:
                G.commit(m, ids[j:j + 1], False)
            masks_s += t1 - t0
            apply_s += t2 - t1
    steps = 5 * (len(ids) - k)
    return {"batch": batch, "k": k, "masks_ms_per_step": 1e3 * masks_s / steps,
            "apply_ms_per_step": 1e3 * apply_s / steps}


def main(args) -> int:
    """Two daemons, MTP k=1: synchronous scheduling and asynchronous (worker process)."""
    levels = [int(x) for x in (args.concurrency or "16").split(",")]
    reps = args.reps or (1 if args.quick else 3)
    kinds = ("plain", "json_schema")
    targets = []
    raw: dict[str, dict[str, dict[int, list[dict]]]] = {}
    try:
        for name, on in (("sync", False), ("async", True)):
            print(f"starting daemon {name} ...", file=sys.stderr)
            targets.append(start_daemon(name, args.config_file, 1, args.threads, on))
            raw[name] = {kind: {c: [] for c in levels} for kind in kinds}
        model = asyncio.run(model_id(targets[0]))
        for t in targets:        # warm-up; compiles the grammar
            for constrained in (True, False):
                asyncio.run(_burst(t.base_url, t.metrics_url, model, constrained, 4, 4, 8))
        for _ in range(reps):
            for c in levels:
                n = max(3 * c, 8)
                for t in targets:
                    for kind in kinds:        # alternate so drift hits every row
                        r = asyncio.run(_burst(t.base_url, t.metrics_url, model,
                                               kind == "json_schema", c, n, args.max_tokens))
                        raw[t.name][kind][c].append(r)
                        print(f"  {t.name} {kind} c={c}: {r['output_tok_s']:.1f} tok/s", file=sys.stderr)
    finally:
        for t in targets:
            stop_daemon(t)
    med = {name: {kind: {c: {key: (statistics.median(r[key] for r in runs) if runs[0][key] is not None
                                   else None) for key in runs[0]} for c, runs in per.items()}
                  for kind, per in by_kind.items()} for name, by_kind in raw.items()}
    print(f"\nconstraints, MTP k=1, demo model, {_machine()}, {reps} rep(s), max_tokens {args.max_tokens}")
    print(f"{'sched':>6} {'c':>4} {'plain tok/s':>12} {'json_schema tok/s':>18} {'ratio':>6} "
          f"{'accept plain':>13} {'accept json':>12} {'tokens/req plain':>17} {'json':>5} {'valid':>6}")
    for name in med:
        for c in levels:
            p, j = med[name]["plain"][c], med[name]["json_schema"][c]
            print(f"{name:>6} {c:>4} {p['output_tok_s']:>12.1f} {j['output_tok_s']:>18.1f} "
                  f"{j['output_tok_s'] / p['output_tok_s']:>6.2f} {p['acceptance_rate'] or 0:>13.2f} "
                  f"{j['acceptance_rate'] or 0:>12.2f} {p['tokens_per_request']:>17.1f} "
                  f"{j['tokens_per_request']:>5.1f} {j['valid']:>6.2f}")
    base_cfg = json.loads(args.config_file.read_text())
    weights = Path(base_cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"])
    if not weights.is_absolute():
        weights = (args.config_file.parent / weights).resolve()
    cost = mask_cost(weights, batch=max(levels), threads=args.threads)
    print(f"grammar work per verify step, {cost['batch']} constrained requests x {cost['k'] + 1} rows: "
          f"masks {cost['masks_ms_per_step']:.2f} ms, applying them {cost['apply_ms_per_step']:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps({"machine": _machine(), "reps": reps, "max_tokens": args.max_tokens,
                                         "results": med, "mask_cost": cost,
                                         "command": " ".join(sys.argv)}, indent=2))
    return 0
