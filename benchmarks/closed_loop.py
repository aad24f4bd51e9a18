"""Adaptive speculation against MTP off in a closed loop, engines taking turns in one process.

Why: the daemon's rows (benchmarks.serve) at concurrency 8 are one burst a mode, minutes
apart, on a host whose speed swings 20-40% (or 4x) within minutes, and every request there
asks the same number of tokens, so under MTP off all 8 end in one step and their
replacements are prefilled together, which any drafting undoes.  Here every mode is an
in-process engine on one shared checkpoint; each round each of them serves ``--requests``
requests at ``--concurrency`` streams, each replaced as it ends (greedy, the bench
prompts in the checkpoint's chat template), the modes' order reversed every other round.  A
round's tokens/s over MTP off's of the same round is the figure; ``--lengths 32-96`` gives
each request its own length (mean 64), so that MTP off's requests drift apart as real ones do.

Modes: off, k1 / k2 (adaptive speculation, the daemon's default), f1 / f2 (fixed k); any
of them with ``+sb``: with MindIE's supportSelectBatch (a step prefills only, or decodes
only, by its trade-off of ``--select-batch`` prefillTimeMsPerReq / decodeTimeMsPerReq), so
replacements that arrive steps apart can be prefilled together.

Usage (from the repository root; the checkpoint from benchmarks.models):
  python -m benchmarks.closed_loop --concurrency 8 --modes off,k1,k2 --rounds 8 --lengths 32-96
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.models import model_dir

MODES = {"off": (0, True), "k1": (1, True), "k2": (2, True), "f1": (1, False), "f2": (2, False)}
SELECT_BATCH = "+sb"


def mode_settings(mode: str) -> tuple[int, bool, bool] | None:
    """(k, adaptive, supportSelectBatch) of a mode name; None for an unknown one."""
    base, sb = (mode[:-len(SELECT_BATCH)], True) if mode.endswith(SELECT_BATCH) else (mode, False)
    return (*MODES[base], sb) if base in MODES else None


def request_lengths(spec: str):
    """``"64"``: every request 64 tokens; ``"32-96"``: request i gets 32 + (37 i mod 65)
    tokens, a fixed spread over the range (the same for every mode and round)."""
    if "-" not in spec:
        return lambda i: int(spec)
    lo, hi = (int(x) for x in spec.split("-"))
    return lambda i: harness.spread_length(lo, hi, i)


def serve_round(eng, prompts: list[list[int]], concurrency: int, total: int, lengths,
                tag: str) -> float:
    """Tokens/s of ``total`` requests at ``concurrency`` streams, each replaced as it ends."""
    from server.engine.protocol import EngineRequest, SamplingParams
    sent = 0
    tokens = 0

    def add() -> None:
        nonlocal sent, tokens
        n = lengths(sent)
        eng.add_request(EngineRequest(f"{tag}-{sent}", prompts[sent % len(prompts)],
                                      SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
        sent += 1
        tokens += n
    for _ in range(min(concurrency, total)):
        add()
    t0 = time.perf_counter()
    while eng.has_unfinished():
        for out in eng.step() or []:
            if out.finished and sent < total:
                add()
    return tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path, default=model_dir("0.5b"))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--modes", default="off,k1,k2", help=f"first is the baseline; of {', '.join(MODES)}")
    ap.add_argument("--requests", type=int, default=16, help="requests a round and mode")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--lengths", default="64", help="tokens a request: N, or LO-HI")
    ap.add_argument("--select-batch", default="150/50",
                    help="prefillTimeMsPerReq/decodeTimeMsPerReq of the +sb modes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := [m for m in modes if mode_settings(m) is None]:
        ap.error(f"unknown modes {unknown}; known: {', '.join(MODES)}, each also with {SELECT_BATCH}")
    try:
        prefill_ms, decode_ms = (int(v) for v in args.select_batch.split("/"))
    except ValueError:
        ap.error(f"--select-batch takes PREFILL_MS/DECODE_MS, not {args.select_batch!r}")
    if not (args.weights / "config.json").is_file():
        ap.error(f"no checkpoint at {args.weights}: python -m benchmarks.models --size 0.5b")
    import torch
    from server.engine.config import EngineConfig
    from server.engine.core import LLMEngine
    from server.model import load_checkpoint
    torch.set_num_threads(args.threads)
    model, _ = load_checkpoint(str(args.weights))
    prompts = harness.chat_prompt_ids(args.weights)
    lengths = request_lengths(args.lengths)
    engines = {}
    for m in modes:
        k, adaptive, select = mode_settings(m)
        cfg = EngineConfig(block_size=16, num_blocks=800, num_speculative_tokens=k,
                           max_queue_delay_us=0, max_batch_size=max(8, args.concurrency),
                           max_seq_len=2048, compile="on", compile_wait=True,
                           adaptive_speculation=adaptive, support_select_batch=select,
                           prefill_time_ms_per_req=prefill_ms, decode_time_ms_per_req=decode_ms)
        engines[m] = LLMEngine(model, cfg, eos_token_ids=set())
    t0 = time.perf_counter()
    for m in modes:                                  # warm-up, not in the rounds
        serve_round(engines[m], prompts, args.concurrency, args.concurrency, lengths, f"w{m}")
    warm_s = time.perf_counter() - t0
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            rates[m].append(serve_round(engines[m], prompts, args.concurrency, args.requests,
                                        lengths, f"r{r}{m}"))
        print(f"round {r}: " + "  ".join(f"{m} {rates[m][-1]:.1f}" for m in modes),
              file=sys.stderr, flush=True)
    base = modes[0]
    print(f"machine: {harness.machine()}   concurrency {args.concurrency}   lengths {args.lengths}   "
          f"{args.requests} requests x {args.rounds} rounds   threads {args.threads}   "
          f"warm-up {warm_s:.1f} s (compile included)")
    results = {}
    for m in modes:
        st = engines[m].stats()
        results[m] = {"tok_s": rates[m], "median_tok_s": statistics.median(rates[m]),
                      f"x_{base}": harness.round_ratios(rates[m], rates[base]),
                      "steps_per_k": list(st.steps_per_k)}
        ratio = results[m][f"x_{base}"]
        ks = "/".join(str(s) for s in st.steps_per_k) if len(st.steps_per_k) > 1 else "-"
        print(f"{m:4s} {statistics.median(rates[m]):7.1f} tok/s  x {base} {ratio['median']:.2f} "
              f"(rounds {ratio['min']:.2f}-{ratio['max']:.2f})  steps at k=0/1/2 {ks}")
    harness.save_report(harness.report_header(
        weights=harness.shown_path(args.weights), concurrency=args.concurrency,
        lengths=args.lengths, select_batch=args.select_batch, requests=args.requests,
        rounds=args.rounds, threads=args.threads,
        warm_up_s=round(warm_s, 1), results=results), args.json)


if __name__ == "__main__":
    main()
