"""Parallel layouts through the daemon (``benchmarks.serve --compare parallel``): one
process vs tensor parallel vs attention data parallel, and a long prompt's TTFT with
context parallel.

Rows, every daemon MTP k=1 (the seed's rule with sp/cp), uncompiled (the striped layouts
serve the eager step, so every row does: the comparison is of layouts, not of compiled
against uncompiled steps; ``--compare tp`` compares compiled tp=2 with one process):

  one   worldSize 1
  tp2   worldSize 2, tp 2 (moe_tp 2)
  dp2   worldSize 2, dp 2, tp 1, moe_ep 2 (each dp group its own requests and KV)
  sp2   worldSize 2, tp 2, sp 2 (the latent cache striped over the ranks)
  cp2   worldSize 4, tp 2, sp 2, cp 2, moe_ep 4 (a step's tokens split over 2 cp ranks)

one, tp2 and dp2 serve greedy chat bursts at each concurrency (output tokens/s, medians
of ``--reps``); every row is timed on a long prompt (``--long-tokens``, default 4,000 or
the model's context less 64): TTFT, streamed, medians.  KV tokens come from /v1/status.
Each daemon's greedy answer to the same prompt is printed: they must agree.

What 2 cores can and cannot show: every rank is a process and the ranks share the two
cores, so a layout of 2 ranks has half a core per rank and one of 4 a quarter; their
collectives run over loopback (gloo).  A layout's speed here says what its overhead
costs, not what it gains on devices of its own; the KV tokens are what it gains anywhere.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import Target, start_daemon, status_of, stop_daemon

LAYOUTS = {                      # name: (worldSize, ModelConfig keys, in the bursts?)
    "one": (1, {}, True),
    "tp2": (2, {"tp": 2}, True),
    "dp2": (2, {"dp": 2, "tp": 1, "moe_ep": 2}, True),
    "sp2": (2, {"tp": 2, "sp": 2}, False),
    "cp2": (4, {"tp": 2, "sp": 2, "cp": 2, "moe_ep": 4}, False),
}


def _start(name: str, args, weights: Path | None) -> Target:
    world, keys, _ = LAYOUTS[name]

    def edit(cfg: dict) -> None:
        dep = cfg["BackendConfig"]["ModelDeployConfig"]
        mc = dep["ModelConfig"][0]
        mc.update(keys)
        # A pool sized by memory, so a striped cache's gain shows in its KV tokens.
        mc["npuMemSize"] = args.kv_gib if args.kv_gib is not None else 1
        longest = args.long_tokens + args.max_tokens + 64
        dep["maxSeqLen"] = max(int(dep.get("maxSeqLen", 0)), longest)
        dep["maxInputTokenLen"] = max(int(dep.get("maxInputTokenLen", 0)), args.long_tokens + 64)
        cfg["BackendConfig"]["ScheduleConfig"]["maxPrefillTokens"] = max(
            int(cfg["BackendConfig"]["ScheduleConfig"].get("maxPrefillTokens", 0)), longest)
    return start_daemon(f"par-{name}", args.config_file, 1, args.threads, weights=weights,
                        extra_env={"MTP_SERVE_COMPILE": "0"}, world_size=world, edit_config=edit,
                        timeout=900.0)


def run(args) -> int:
    from benchmarks.serve import burst_size, long_prompt, sample_answer
    weights = args.model.resolve() if args.model else harness.weights_of(args.config_file)
    context = json.loads((weights / "config.json").read_text()).get("max_position_embeddings", 4096)
    if getattr(args, "long_tokens", None) is None:
        args.long_tokens = min(4000, context - args.max_tokens - 64)
    levels = harness.levels(args.concurrency, "1,16" if args.model else "1,16,64")
    reps = args.reps or (1 if args.quick else 3)
    prompts = harness.load_prompts()["prompts"]
    long = long_prompt(weights, args.long_tokens)
    report = harness.report_header(compare="parallel", weights=harness.shown_path(weights), levels=levels, reps=reps,
                                   long_tokens=args.long_tokens, layouts={})
    for name, (world, keys, in_bursts) in LAYOUTS.items():
        print(f"starting daemon {name} (worldSize {world}, {keys}) ...", file=sys.stderr)
        t = _start(name, args, weights if args.model else None)
        try:
            model = asyncio.run(harness.model_id(t))
            row = {"world_size": world, "keys": keys, "start_s": t.start_s,
                   "warmup": harness.chat_warm_up(t, model, prompts),
                   "answer": sample_answer(t, model, prompts[0])}
            kv = status_of(t)["kv_cache"]
            row["kv_tokens"] = kv["total_blocks"] * kv["block_size"]
            if in_bursts:
                row["tok_s"] = {}
                for c in levels:
                    runs = [asyncio.run(harness.burst(t, model, prompts, c, burst_size(c, args.quick),
                                                      args.max_tokens)) for _ in range(reps)]
                    row["tok_s"][c] = statistics.median(r["output_tok_s"] for r in runs)
            ttfts = [asyncio.run(harness.burst(t, model, [long], 1, 1, 4)) for _ in range(reps)]
            row["long_ttft_s"] = statistics.median(r["ttft_median"] for r in ttfts)
            row["long_prompt_tokens"] = int(ttfts[0]["prompt_tokens"])
            report["layouts"][name] = row
        finally:
            stop_daemon(t)
    print_report(report)
    harness.save_report(report, args.json)
    answers = {r["answer"] for r in report["layouts"].values()}
    return 0 if len(answers) == 1 else 1


def print_report(rep: dict) -> None:
    rows = rep["layouts"]
    one = rows["one"]
    print(f"# parallel layouts, MTP k=1, uncompiled; medians of {rep['reps']}; {harness.machine()}")
    head = " ".join(f"{'c=' + str(c):>10}" for c in rep["levels"])
    print(f"{'layout':8} {'ranks':>5} {'KV tokens':>10} {head} {'long TTFT s':>12} {'vs one':>7}")
    for name, r in rows.items():
        cells = " ".join(
            f"{r['tok_s'][c]:6.1f} {r['tok_s'][c] / one['tok_s'][c]:.2f}x" if "tok_s" in r else f"{'-':>10}"
            for c in rep["levels"])
        print(f"{name:8} {r['world_size']:5d} {r['kv_tokens']:10d} {cells} {r['long_ttft_s']:12.2f} "
              f"{r['long_ttft_s'] / one['long_ttft_s']:6.2f}x")
    print(f"# long prompt: {one['long_prompt_tokens']} tokens; c=N cells: output tokens/s and x one process")
    answers = {name: r["answer"] for name, r in rows.items()}
    same = len(set(answers.values())) == 1
    print(f"# greedy answers {'identical' if same else 'DIFFER: ' + repr(answers)}")
