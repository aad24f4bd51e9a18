"""What the daemon adds to a decode step: the engine alone against the daemon's streamed
time per output token, on the same weights, alternating in one run.

Why: the llama.cpp comparison (benchmarks.peers) is engine level, and the daemon rows
(benchmarks.serve) are taken minutes apart on a host whose memory speed changes within
minutes, so neither says what the HTTP hop, the scheduler, detokenizing and streaming
cost.  Here one daemon (MTP off, its compiled step in use) and one in-process engine on
the same checkpoint take turns: each round the engine decodes ``--tokens`` for
``concurrency`` requests of random prompt ids (the median ``engine.step()`` after the
prefill), then the daemon streams the same number of tokens for as many concurrent
requests, each its own bench prompt of about the same length (the median gap between
streamed chunks after the first two).  Reported per concurrency: both medians, the ratio
of each round's pair (daemon / engine) and the median of those ratios.  Only one of the
two runs at a time; the idle daemon waits on its queue.

Usage (from the repository root; the checkpoint from benchmarks.models):
  python -m benchmarks.hop --concurrency 1,8 --rounds 6 --json hop.json
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.models import model_dir


def bench_prompts(n: int) -> list[str]:
    """``n`` different prompts (the bench set's, cycled): every stream its own, as the
    engine's requests are.  Why: 8 streams of one prompt decode 8 identical greedy
    sequences, whose tokens all choose the same 4 experts a layer where 8 different ones
    choose ~14 of the 0.5b model's 16 (the first version of this benchmark timed the
    daemon at 0.88x the engine that way)."""
    texts = [p[-1]["content"] for p in harness.load_prompts()["prompts"]]
    return [texts[i % len(texts)] for i in range(n)]


def chunk_gaps(arrivals: list[float], skip: int = 2) -> list[float]:
    """Seconds between streamed chunks, the first ``skip`` left out (the first chunk
    carries the time to first token, the second may wait for the compiled step)."""
    return [b - a for a, b in zip(arrivals[skip:], arrivals[skip + 1:])]


def paired(engine: list[float], daemon: list[float]) -> dict:
    """Each round's daemon / engine, and their median and range."""
    return harness.round_ratios(daemon, engine)


def engine_step_s(eng, vocab: int, batch: int, tokens: int, seed: int, prompt_len: int) -> float:
    """The median decode step of ``batch`` greedy requests of ``tokens`` tokens after
    ``prompt_len`` random prompt ids (the daemon's prompt's length: the same context)."""
    from benchmarks.engine_step import make_prompts
    from server.engine.protocol import EngineRequest, SamplingParams
    for j, ids in enumerate(make_prompts(batch, vocab, seed, prompt_len)):
        eng.add_request(EngineRequest(f"hop{seed}_{j}_{time.time_ns()}", ids,
                                      SamplingParams(max_tokens=tokens, temperature=0)))
    eng.step()                                                   # the prefill
    steps = []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    return statistics.median(steps)


def daemon_tpot_s(base_url: str, model: str, prompts: list[str], tokens: int) -> float:
    """The median gap between streamed chunks over one concurrent request a prompt."""
    gaps: list[float] = []
    lock = threading.Lock()

    def one(prompt: str) -> None:
        arrivals = []
        with httpx.stream("POST", base_url + "/v1/completions", timeout=300,
                          json={"model": model, "prompt": prompt, "max_tokens": tokens,
                                "temperature": 0, "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    arrivals.append(time.perf_counter())
        with lock:
            gaps.extend(chunk_gaps(arrivals))
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(gaps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__.split("\n", 1)[0])
    ap.add_argument("--weights", type=Path, default=model_dir("0.5b"),
                    help="the checkpoint (default: benchmarks.models' 0.5b folder)")
    ap.add_argument("--config", type=Path, default=harness.ROOT / "conf" / "config.json")
    ap.add_argument("--concurrency", default="1", help="comma-separated (default 1)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not (args.weights / "config.json").is_file():
        ap.error(f"no checkpoint at {args.weights}: python -m benchmarks.models --size 0.5b")
    levels = harness.levels(args.concurrency, "1")

    import torch
    torch.set_num_threads(args.threads)
    from server.engine.config import EngineConfig
    from server.engine.core import LLMEngine
    from server.model import load_checkpoint

    target = harness.start_daemon("off", args.config, 0, args.threads, weights=args.weights)
    try:
        model_name = asyncio.run(harness.model_id(target))
        model, _ = load_checkpoint(args.weights)
        eng = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64 * max(levels), num_speculative_tokens=0,
                                            max_queue_delay_us=0, max_batch_size=max(levels),
                                            max_seq_len=2048, compile="on", compile_wait=True),
                        eos_token_ids=set())
        vocab = model.config.vocab_size
        prompts = bench_prompts(max(levels))
        prompt_len = int(statistics.median(
            httpx.post(target.base_url + "/v1/completions", timeout=120,
                       json={"model": model_name, "prompt": p, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
            for p in prompts))
        rows = {}
        for c in levels:
            engine_step_s(eng, vocab, c, args.tokens, 0, prompt_len)           # warm-up, both sides
            daemon_tpot_s(target.base_url, model_name, prompts[:c], args.tokens)
            e_s, d_s = [], []
            for r in range(args.rounds):
                e_s.append(engine_step_s(eng, vocab, c, args.tokens, r + 1, prompt_len))
                d_s.append(daemon_tpot_s(target.base_url, model_name, prompts[:c], args.tokens))
                print(f"c={c} round {r + 1}/{args.rounds}: engine step {e_s[-1] * 1e3:.2f} ms, "
                      f"daemon TPOT {d_s[-1] * 1e3:.2f} ms", file=sys.stderr, flush=True)
            rows[str(c)] = {"engine_step_s": e_s, "daemon_tpot_s": d_s,
                            "engine_median_s": statistics.median(e_s),
                            "daemon_median_s": statistics.median(d_s), "daemon_over_engine": paired(e_s, d_s)}
        memory = harness.memory_bandwidth_gbps(args.threads)
    finally:
        harness.stop_daemon(target)
    print(f"# benchmarks.hop {harness.machine()}  weights {harness.shown_path(args.weights)}  MTP off  "
          f"prompts of {prompt_len} tokens (median), {args.tokens} tokens a request  {args.rounds} rounds  threads {args.threads}")
    print("| concurrency | engine step (median) | daemon TPOT (median) | daemon / engine, round by round |")
    print("|---|---|---|---|")
    for c, r in rows.items():
        p = r["daemon_over_engine"]
        print(f"| {c} | {r['engine_median_s'] * 1e3:.2f} ms | {r['daemon_median_s'] * 1e3:.2f} ms | "
              f"{p['median']:.3f}x ({p['min']:.2f}-{p['max']:.2f}) |")
    print(f"# memory read bandwidth after the rounds: {memory['gbps']:.1f} GB/s")
    harness.save_report({**harness.report_header(), "weights": harness.shown_path(args.weights),
                         "prompt_tokens": prompt_len, "tokens": args.tokens, "rounds": args.rounds, "threads": args.threads,
                         "memory": memory, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
