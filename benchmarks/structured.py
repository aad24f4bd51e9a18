"""Throughput cost of constraints (``python -m benchmarks.structured``, or
``benchmarks.serve --compare structured``): daemons on the
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
import sys
import time
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.harness import RequestResult, Target, burst_of, start_daemon, stop_daemon

CITIES = ["Paris", "Tokyo", "London", "Cairo", "Madrid", "Oslo", "Rome", "Berlin", "Lima", "Perth",
          "Seattle", "Milan", "Naples", "Dublin", "Vienna", "Prague"]
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
    "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
    "required": ["city", "temperature_c", "conditions"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


def _request(base_url: str, model: str, constrained: bool, max_tokens: int) -> harness.Request:
    """A whole (not streamed) greedy weather question, with the schema when ``constrained``;
    valid: the answer parses as the schema's object (constrained only)."""
    async def request(client: httpx.AsyncClient, i: int) -> RequestResult:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [
            {"role": "user", "content": f"What is the weather in {CITIES[i % len(CITIES)]}?"}]}
        if constrained:
            body["response_format"] = FORMAT
        data, latency = await harness.post_chat(client, base_url, body)
        valid = None
        if constrained:
            try:
                valid = set(json.loads(data["choices"][0]["message"]["content"])) == set(SCHEMA["required"])
            except ValueError:
                valid = False
        return RequestResult(latency, latency, data["usage"]["completion_tokens"],
                             data["usage"]["prompt_tokens"], valid)
    return request


def _burst(t: Target, model: str, constrained: bool, concurrency: int, n: int,
           max_tokens: int) -> dict:
    r = asyncio.run(burst_of(t, concurrency, n, _request(t.base_url, model, constrained, max_tokens)))
    if r["errors"]:
        raise RuntimeError(f"{t.name}: {r['errors']} failed requests")
    return r


def mask_cost(weights: Path, batch: int = 16, k: int = 1, threads: int = 1) -> dict:
    """In-process cost of the grammar work of one verify step at ``batch`` constrained
    requests holding ``k`` drafts each: llguidance masks for every row (grammar.window_masks),
    the tensor op that applies them, and the commit of the emitted tokens; averaged over
    the tokens of a schema-valid answer."""
    import torch
    torch.set_num_threads(threads)            # as the daemons run (OMP_NUM_THREADS=--threads)
    from server.api.openai.grammars import response_format_grammar
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


def run(args) -> int:
    """Two daemons, MTP k=1: synchronous scheduling and asynchronous (worker process)."""
    levels = harness.levels(args.concurrency, "16")
    reps = args.reps or (1 if args.quick else 3)
    kinds = ("plain", "json_schema")
    targets = []
    raw: dict[str, dict[str, dict[int, list[dict]]]] = {}
    try:
        for name, on in (("sync", False), ("async", True)):
            print(f"starting daemon {name} ...", file=sys.stderr)
            targets.append(start_daemon(name, args.config_file, 1, args.threads, on))
            raw[name] = {kind: {c: [] for c in levels} for kind in kinds}
        model = asyncio.run(harness.model_id(targets[0]))
        warmup = {f"{t.name} {kind}": harness.warm_up(t, _request(t.base_url, model, kind == "json_schema", 8))
                  for t in targets for kind in ("json_schema", "plain")}     # compiles the grammar
        for _ in range(reps):
            for c in levels:
                n = max(3 * c, 8)
                for t in targets:
                    for kind in kinds:        # alternate so drift hits every row
                        r = _burst(t, model, kind == "json_schema", c, n, args.max_tokens)
                        raw[t.name][kind][c].append(r)
                        print(f"  {t.name} {kind} c={c}: {r['output_tok_s']:.1f} tok/s", file=sys.stderr)
    finally:
        for t in targets:
            stop_daemon(t)
    med = {name: {kind: {c: harness.medians(runs) for c, runs in per.items()}
                  for kind, per in by_kind.items()} for name, by_kind in raw.items()}
    print(f"\nconstraints, MTP k=1, demo model, {harness.machine()}, {reps} rep(s), max_tokens {args.max_tokens}")
    print(f"{'sched':>6} {'c':>4} {'plain tok/s':>12} {'json_schema tok/s':>18} {'ratio':>6} "
          f"{'accept plain':>13} {'accept json':>12} {'tokens/req plain':>17} {'json':>5} {'valid':>6}")
    for name in med:
        for c in levels:
            p, j = med[name]["plain"][c], med[name]["json_schema"][c]
            print(f"{name:>6} {c:>4} {p['output_tok_s']:>12.1f} {j['output_tok_s']:>18.1f} "
                  f"{j['output_tok_s'] / p['output_tok_s']:>6.2f} {p['acceptance_rate'] or 0:>13.2f} "
                  f"{j['acceptance_rate'] or 0:>12.2f} {p['tokens_per_request']:>17.1f} "
                  f"{j['tokens_per_request']:>5.1f} {j['valid']:>6.2f}")
    cost = mask_cost(harness.weights_of(args.config_file), batch=max(levels), threads=args.threads)
    print(f"grammar work per verify step, {cost['batch']} constrained requests x {cost['k'] + 1} rows: "
          f"masks {cost['masks_ms_per_step']:.2f} ms, applying them {cost['apply_ms_per_step']:.2f} ms")
    print("warm-up (4 requests of 8 tokens, not in the medians): " + ", ".join(
        f"{n} {w['output_tok_s']:.1f} tok/s" for n, w in warmup.items()))
    harness.save_report({**harness.report_header(reps=reps, max_tokens=args.max_tokens),
                         "results": med, "mask_cost": cost, "warmup": warmup}, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, "default 16")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
