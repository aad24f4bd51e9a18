"""Serving benchmark: MTP off vs MTP k=1 vs k=2, and our daemon vs transformers generate(),
over a concurrency sweep; or another comparison of daemons on the same work (--compare).

Why ratios from one run: the machines are shared and noisy, so absolute figures drift
between runs.  Every configuration runs in the same process lifetime, bursts alternate
between configurations (off, k1, k2, off, k1, k2, ...) so that drift hits all of them,
and the table reports medians over repetitions plus ratios against MTP off.

Usage (from the repository root; scripts/bench.sh runs it in .venv with the bench extra):
  python -m benchmarks.serve [--quick] [--json out.json] [--plot out.png]
  python -m benchmarks.serve --compare async [--concurrency 1,16,64]   # MINDIE_ASYNC_SCHEDULING_ENABLE 1 vs 0
  python -m benchmarks.serve --compare quant --quantized DIR             # MTP k=1: float vs an int8 checkpoint
                                                                       # (DIR from python -m training.quantize)
  python -m benchmarks.serve --compare kv                                # MTP k=1: float vs int8 KV cache
  python -m benchmarks.serve --compare compile                           # MTP k=1: uncompiled vs compiled
  python -m benchmarks.serve --compare process                           # MTP off and k=1: the engine on a
                                                                       # thread vs in its own process
  python -m benchmarks.serve --compare tp                                # MTP k=1: one process vs tp=2 ranks
  python -m benchmarks.serve --compare pd                                # MTP k=1: co-located vs 1P + 1D + coordinator
                                                                       # (benchmarks.pd)
  python -m benchmarks.serve --compare kvpool                            # prefix cache without / with the
                                                                       # host KV tier (benchmarks.kvpool)
  python -m benchmarks.serve --compare structured [--concurrency 16]     # MTP k=1: with vs without a
                                                                       # json_schema (benchmarks.structured)
  python -m benchmarks.serve --compare prediction [--realistic 0.5b]     # MTP k=1 alone vs with a
                                                                       # prediction (benchmarks.prediction)
  python -m benchmarks.serve --url http://127.0.0.1:1025 --metrics-url http://127.0.0.1:1027/metrics  # a running daemon
  python -m benchmarks.serve --model DIR                                 # any checkpoint folder instead of the config's
  python -m benchmarks.serve --realistic 0.5b [--modes off,k1] [--concurrency 1,8,16,64]
                                                                       # a realistic-size bf16 model (benchmarks.models,
                                                                       # built on first use), every row also as a share
                                                                       # of the memory's read bandwidth

Realistic-size rows (``--realistic``, or any ``--model``): the memory's read bandwidth
(harness.memory_bandwidth_gbps: a plain streaming read of 1 GiB at the daemons' thread
count, median of 7) is measured in this process before and after the bursts (the daemons
idle meanwhile), torch's GEMV rates beside it as a kernel diagnostic
(harness.gemv_rates_gbps: not the limit).  Every row reports the weight bytes a step reads
at its concurrency (harness.step_weight_bytes at the k its steps ran, weighted by the
daemon's steps per k) and its share of the bandwidth: bytes a step x steps/s / GB/s,
steps/s being tok/s / (concurrency x tokens a sequence gets a step: 1, or the mean
accepted length on the steps that drafted); once over tok/s (the burst, TTFT included)
and once over concurrency / TPOT p50 (decode alone).  Defaults with
``--realistic``: concurrency 1,8; transformers generate() at batch 1 in the checkpoint's
dtype; each daemon's KV pool ``--kv-gib`` GiB; ``--daemon-compile wait``: each daemon
compiles its step graphs in its own process before it reports ready (into a cache private
to the run), because graphs compiled in the background by the compile children answered
token 0 for every position on bf16 checkpoints (2026-12-04, the tiny checkpoint in bf16
too; float32 was right), and start-up (the compile) is reported apart.  Every daemon
then answers one greedy 16-token chat, printed, and a daemon answering no text is flagged:
its rows are not valid.
"""
from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import Target, burst, start_daemon, stop_daemon


# --------------------------------------------------------------------------- references

def burst_size(concurrency: int, quick: bool, requests: int | None = None) -> int:
    """Requests per burst at a concurrency level (the transformers rows do the same work).

    At least 12 (8 with --quick): a burst of 4 requests at concurrency 1 lasted well under
    a second, and on the shared machine the per-burst TPOT of one configuration ranged
    2.2-3.2 ms, which the medians of three repetitions did not smooth out.  ``requests``
    (--requests) overrides it."""
    if requests:
        return requests
    return max(concurrency * (2 if quick else 3), 8 if quick else 12)


class TransformersPeer:
    """tokens/s of transformers generate() (greedy) on the same checkpoint and the same
    work as the daemon's burst at that concurrency: the same requests (burst_size of them,
    the prompts in the same order) in batches of that size, stopping where the daemon
    does (at EOS, or at max_tokens with --ignore-eos), tokens counted as the daemon's
    usage counts them (through the EOS), prefill included.

    Why the same work: timing transformers on 64 forced tokens of one prompt while the
    daemon's requests stop at EOS after ~11 tokens compared decode speed against mostly
    prefill and TTFT (the 1.69x of Run 7).  Why ``measure`` once per repetition, between
    the daemons' bursts: timed only after them, a machine that sped up 1.5x in the
    meantime moved the ratio by as much."""

    def __init__(self, weights: Path, prompts: list[list[dict]], max_tokens: int,
                 batch_sizes: list[int], ignore_eos: bool, quick: bool,
                 requests: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.torch = torch
        tok = AutoTokenizer.from_pretrained(weights)
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        self.pad_id = tok.pad_token_id
        self.model = AutoModelForCausalLM.from_pretrained(weights, torch_dtype=checkpoint_dtype(weights)).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.max_tokens, self.ignore_eos = max_tokens, ignore_eos
        self.batches: dict[int, list] = {}
        for bs in batch_sizes:
            texts = [tok.apply_chat_template(prompts[i % len(prompts)], tokenize=False, add_generation_prompt=True)
                     for i in range(burst_size(bs, quick, requests))]
            self.batches[bs] = [tok(texts[i:i + bs], return_tensors="pt", padding=True, add_special_tokens=False)
                                for i in range(0, len(texts), bs)]
        self.rates: dict[int, list[float]] = {bs: [] for bs in batch_sizes}
        with torch.inference_mode():             # warm-up: first call pays one-off costs
            self.model.generate(**self.batches[batch_sizes[0]][0], max_new_tokens=2, do_sample=False,
                                pad_token_id=self.pad_id)

    def measure(self) -> None:
        """One timing of every batch size."""
        forced = {"min_new_tokens": self.max_tokens} if self.ignore_eos else {}
        for bs, batches in self.batches.items():
            tokens, t0 = 0, time.perf_counter()
            for enc in batches:
                with self.torch.inference_mode():
                    gen = self.model.generate(**enc, max_new_tokens=self.max_tokens, do_sample=False,
                                              pad_token_id=self.pad_id, **forced)
                for row in gen[:, enc["input_ids"].shape[1]:].tolist():
                    stop = None if self.ignore_eos else next((j for j, t in enumerate(row) if t in self.eos), None)
                    tokens += len(row) if stop is None else stop + 1
            self.rates[bs].append(tokens / (time.perf_counter() - t0))

    def medians(self) -> dict[int, float]:
        return {bs: statistics.median(r) for bs, r in self.rates.items() if r}


def checkpoint_dtype(weights: Path):
    """The torch dtype a checkpoint folder's config.json names (the daemon serves in it)."""
    import json
    from server.model.config import TORCH_DTYPES
    return TORCH_DTYPES[json.loads((weights / "config.json").read_text()).get("torch_dtype") or "float32"]


def prefill_forward_seconds(weights: Path, num_tokens: int, reps: int = 5) -> float:
    """Median wall time of one no-cache forward over `num_tokens` tokens with our model,
    in the checkpoint's dtype (as the daemon serves it)."""
    import torch
    from server.model.loading import load_checkpoint
    model, _ = load_checkpoint(weights, dtype=checkpoint_dtype(weights))
    ids = torch.randint(0, model.config.vocab_size, (1, num_tokens))
    times = []
    with torch.inference_mode():
        model.compute_logits(model.forward_full(ids)[0, -1:])
        for _ in range(reps):
            t0 = time.perf_counter()
            model.compute_logits(model.forward_full(ids)[0, -1:])
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def long_prompt(weights: Path, num_tokens: int) -> list[dict]:
    """A user message whose text is ``num_tokens`` tokens in the model's tokenizer (the chat
    template adds a few; the daemon's usage.prompt_tokens is what the prefill is sized to)."""
    from server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(weights)
    words = ("the engine verifies each draft token against the main model and keeps the "
             "accepted prefix before it drafts again").split()
    n = num_tokens
    while True:
        text = " ".join(words[i % len(words)] for i in range(n))
        if len(tok.encode(text)) <= num_tokens or n <= 1:
            return [{"role": "user", "content": text}]
        n -= 1


# --------------------------------------------------------------------------- main

class Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.monotonic()

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = int(width * self.done / self.total)
        el = time.monotonic() - self.t0
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{el:6.0f}s {label:<28}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, "default 1,4,16,64 (mtp) or 1,16,64 (async)")
    ap.add_argument("--url", help="benchmark a running daemon instead of starting three")
    ap.add_argument("--metrics-url", help="its /metrics URL (with --url)")
    ap.add_argument("--compare", choices=("mtp", "async", "quant", "kv", "compile", "kvpool", "tp", "pd",
                                          "structured", "process", "parallel", "prediction", "greedy"),
                    default="mtp",
                    help="mtp: MTP off / k=1 / k=2 and transformers; greedy: MTP off with the "
                         "whole head vs the screened one (MTP_SERVE_GREEDY_HEAD); async: MTP k=1 with "
                         "asynchronous scheduling off vs on; quant: MTP k=1 on the float "
                         "checkpoint vs --quantized; kv: MTP k=1 with a float vs an int8 KV cache")
    ap.add_argument("--quantized", type=Path, help="an int8 checkpoint (with --compare quant)")
    ap.add_argument("--prediction-tokens", default="64",
                    help="--compare prediction: comma-separated MTP_SERVE_PREDICTION_TOKENS values")
    ap.add_argument("--long-tokens", type=int, default=None,
                    help="--compare parallel: the long prompt's tokens (default 4000, or the "
                         "model's context less 64 + --max-tokens)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="run every request to max_tokens (past the model's answer) instead of stopping at EOS")
    ap.add_argument("--spread-max-tokens", action="store_true",
                    help="each request's max_tokens spread over max_tokens/2 .. 3 x max_tokens/2 "
                         "(harness.spread_max_tokens), so requests' ends drift apart as answers' do")
    ap.add_argument("--no-peer", action="store_true", help="skip the transformers reference rows")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--model", type=Path, default=None,
                    help="serve this checkpoint folder (every daemon) instead of the config's modelWeightPath")
    ap.add_argument("--realistic", choices=("0.5b", "1.6b"), default=None,
                    help="serve a realistic-size bf16 model (benchmarks.models; built under --models-dir "
                         "when missing) and report MTP-off rows against the weight-streaming limit")
    ap.add_argument("--models-dir", type=Path, default=None,
                    help="where --realistic finds or builds its checkpoint (default .cache/bench-models)")
    ap.add_argument("--modes", default="off,k1,k2",
                    help="with --compare mtp: which of off,k1,k2 to start (default all three)")
    ap.add_argument("--async-scheduling", choices=("off", "on", "both"), default="off",
                    help="with --compare mtp: MINDIE_ASYNC_SCHEDULING_ENABLE of every daemon; both: "
                         "each mode twice, sync then async (\"off-async\", ...)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per burst (default: 3 x the concurrency, at least 12; 8 with --quick)")
    ap.add_argument("--daemon-compile", choices=("background", "wait", "off"), default=None,
                    help="background: the daemon's default (compile children, switch when ready); wait: "
                         "MTP_SERVE_COMPILE_WAIT=1 with a cache private to the run; off: MTP_SERVE_COMPILE=0. "
                         "Default wait with --model/--realistic, else background")
    ap.add_argument("--kv-gib", type=int, default=None,
                    help="each daemon's KV pool in GiB (npuMemSize; default 1 with --model/--realistic, "
                         "else the config's)")
    args = ap.parse_args(argv)
    if args.spread_max_tokens and args.compare == "mtp" and not (args.no_peer or args.url):
        ap.error("--spread-max-tokens: add --no-peer (the transformers rows run fixed lengths)")
    if args.realistic:
        if args.model:
            ap.error("--realistic picks its own model; drop --model")
        from benchmarks import models
        args.model = models.ensure(args.realistic, args.models_dir or models.DEFAULT_DIR,
                                   log=lambda m: print(m, file=sys.stderr))
    realistic = args.model is not None
    if args.compare in ("kvpool", "pd", "structured", "parallel", "prediction"):   # their own rows
        import importlib
        return importlib.import_module(f"benchmarks.{args.compare}").run(args)

    levels = harness.levels(args.concurrency, "1,8" if args.realistic else
                            "1,4,16,64" if args.compare == "mtp" else "1,16,64")
    if args.compare == "quant" and not args.quantized:
        ap.error("--compare quant needs --quantized DIR (made by python -m training.quantize)")
    compile_dir = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    fresh = {"MTP_SERVE_COMPILE": "1", "MTP_SERVE_COMPILE_CACHE": str(compile_dir / "artifacts"),
             "TORCHINDUCTOR_CACHE_DIR": str(compile_dir / "inductor")}
    plan = {"async": (("sync", 1, False, None, False), ("async", 1, True, None, False)),
            # MTP k=1 uncompiled, compiled from empty caches (first start), compiled again
            # on the caches the first one filled (a later start)
            "compile": (("eager", 1, False, None, False, {"MTP_SERVE_COMPILE": "0"}),
                        ("cold", 1, False, None, False, fresh), ("warm", 1, False, None, False, fresh)),
            "quant": (("float", 1, False, None, False), ("int8", 1, False, args.quantized, False)),
            "kv": (("kvfp", 1, False, None, False), ("kvint8", 1, False, None, True)),
            # MTP k=1 on one process vs two tensor-parallel ranks, the static step compiled
            # on both (start-up waits for the graphs: the cache's, or made then)
            "tp": (("tp1", 1, False, None, False, {"MTP_SERVE_COMPILE": "1", "MTP_SERVE_COMPILE_WAIT": "1"}, 1),
                   ("tp2", 1, False, None, False, {"MTP_SERVE_COMPILE": "1", "MTP_SERVE_COMPILE_WAIT": "1"}, 2)),
            # MTP off and k=1 with the engine on a thread of the serving process vs in its
            # own process (the daemon's default)
            "process": (("t-off", 0, False, None, False, {"MTP_SERVE_ENGINE_PROCESS": "0"}),
                        ("t-k1", 1, False, None, False, {"MTP_SERVE_ENGINE_PROCESS": "0"}),
                        ("p-off", 0, False, None, False, {"MTP_SERVE_ENGINE_PROCESS": "1"}),
                        ("p-k1", 1, False, None, False, {"MTP_SERVE_ENGINE_PROCESS": "1"})),
            # MTP off reading the whole head vs screening it (engine/sample/screened_head.py)
            "greedy": (("whole", 0, False, None, False, {"MTP_SERVE_GREEDY_HEAD": "model"}),
                       ("screened", 0, False, None, False, {"MTP_SERVE_GREEDY_HEAD": "auto"})),
            "mtp": (("off", 0, False, None, False), ("k1", 1, False, None, False),
                    ("k2", 2, False, None, False))}[args.compare]
    if args.compare == "mtp":
        modes = args.modes.split(",")
        if not modes or set(modes) - {"off", "k1", "k2"}:
            ap.error("--modes: a comma-separated subset of off,k1,k2")
        plan = tuple(p for p in plan if p[0] in modes)
        plan = async_plan(plan, args.async_scheduling)
    import torch
    torch.set_num_threads(args.threads)                # the reference rows run in this process
    reps = args.reps or (1 if args.quick else 3)
    max_tokens = 32 if args.quick and args.max_tokens == 64 else args.max_tokens
    prompt_set = harness.load_prompts()
    prompts = prompt_set["prompts"]
    weights = args.model.resolve() if args.model else harness.weights_of(args.config_file)
    kv_gib = args.kv_gib if args.kv_gib is not None else (1 if realistic else None)

    daemon_compile = args.daemon_compile or ("wait" if realistic else "background")
    compile_env = {"wait": {"MTP_SERVE_COMPILE_WAIT": "1", "MTP_SERVE_COMPILE_CACHE": str(compile_dir / "run"),
                            "TORCHINDUCTOR_CACHE_DIR": str(compile_dir / "run-inductor")},
                   "off": {"MTP_SERVE_COMPILE": "0"}}.get(daemon_compile, {})

    def edit(cfg: dict) -> None:
        if kv_gib is not None:
            cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["npuMemSize"] = kv_gib

    targets: list[Target] = []
    failed = True
    try:
        if args.url:
            targets.append(Target("url", args.url.rstrip("/"), args.metrics_url or args.url + "/metrics"))
        else:
            for name, k, async_on, target_weights, kv_int8, *extra in plan:
                print(f"starting daemon {name} ...", file=sys.stderr)
                targets.append(start_daemon(name, args.config_file, k, args.threads, async_on,
                                            target_weights or args.model, kv_int8,
                                            extra_env={**compile_env, **(extra[0] if extra else {})},
                                            timeout=1800.0 if daemon_compile == "wait" else 300.0,
                                            world_size=extra[1] if len(extra) > 1 else 1,
                                            edit_config=edit))
        model = asyncio.run(harness.model_id(targets[0]))
        runtimes = {t.name: harness.runtime_of(t) for t in targets}
        ttft_prompt = long_prompt(weights, 200)
        peer = None
        if not args.url and not args.no_peer and args.compare == "mtp":
            print("loading the transformers reference ...", file=sys.stderr)
            peer = TransformersPeer(weights, prompts, max_tokens,
                                    [1] if realistic else [1, 16] if 16 in levels or not args.quick else [1],
                                    args.ignore_eos, args.quick, args.requests)
        total = reps * len(levels) * len(targets) + reps * len(targets) + (reps if peer else 0)
        prog = Progress(total)
        raw: dict[str, dict[int, list[dict]]] = {t.name: {c: [] for c in levels} for t in targets}
        ttft_raw: dict[str, list[float]] = {t.name: [] for t in targets}
        ttft_prompt_tokens = 0
        warmup = {t.name: harness.chat_warm_up(t, model, prompts) for t in targets}
        samples = {t.name: sample_answer(t, model, prompts[0]) for t in targets}
        for name, text in samples.items():
            print(f"{name} answers {prompts[0][-1]['content']!r} with {text!r}"
                  + ("" if text.strip() else "  <- NO TEXT: this daemon's rows are not valid"), file=sys.stderr)
        streaming = []
        if realistic:                    # the daemons idle meanwhile
            print("measuring the memory's read bandwidth ...", file=sys.stderr)
            streaming.append(memory_figures(args.threads))
        for _ in range(reps):
            for c in levels:
                n = burst_size(c, args.quick, args.requests)
                for t in targets:        # alternate so drift hits every configuration
                    raw[t.name][c].append(asyncio.run(burst(t, model, prompts, c, n, max_tokens,
                                                                args.ignore_eos, args.spread_max_tokens)))
                    prog.step(f"{t.name} c={c}")
            for t in targets:
                r = asyncio.run(burst(t, model, [ttft_prompt], 1, 3, 4))
                ttft_raw[t.name].append(r["ttft_median"])
                ttft_prompt_tokens = int(r["prompt_tokens"])
                prog.step(f"{t.name} ttft200")
            if peer is not None:         # between the bursts too, so drift hits it alike
                peer.measure()
                prog.step("transformers")
        if realistic:
            streaming.append(memory_figures(args.threads))
        # keep the daemons' logs when any request failed, to see why
        failed = any(r.get("errors") for per in raw.values() for runs in per.values() for r in runs)
    finally:
        shutil.rmtree(compile_dir, ignore_errors=True)
        for t in targets:
            stop_daemon(t, keep_logs=failed)

    table = {name: {c: harness.medians(runs) for c, runs in per.items()} for name, per in raw.items()}
    paired_ratios(table, raw, targets[0].name if targets else "off")
    ttft200 = {name: statistics.median(v) for name, v in ttft_raw.items()}
    prefill_s = None
    if not args.url:
        prefill_s = prefill_forward_seconds(weights, ttft_prompt_tokens or 200)

    report = {**harness.report_header(baseline=targets[0].name if targets else "off", threads=args.threads),
              "prompt_set": prompt_set["version"], "max_tokens": max_tokens, "ignore_eos": args.ignore_eos,
              "spread_max_tokens": args.spread_max_tokens, "reps": reps,
              "results": table, "runtime": runtimes, "ttft_200_prompt_s": ttft200, "transformers_tok_s": peer.medians() if peer else {},
              "prefill_forward_200_s": prefill_s, "ttft_prompt_tokens": ttft_prompt_tokens,
              "start_s": {t.name: round(t.start_s, 1) for t in targets if t.daemon is not None},
              "compiled_s": {t.name: round(t.compiled_s, 1) for t in targets if t.compiled_s is not None},
              "decode_compiled_s": {t.name: round(t.decode_compiled_s, 1) for t in targets
                                    if t.decode_compiled_s is not None},
              "warmup": warmup, "sample_answers": samples, "daemon_compile": daemon_compile}
    if realistic:
        rows_of = {p[0]: (p[1], (p[3] or weights)) for p in plan}
        report["realistic"] = limit_report(weights, streaming, table, levels, args.realistic, rows_of)
    print_table(report)
    harness.save_report(report, args.json)
    if args.plot:
        plot(report, args.plot)
    return 0


def async_plan(plan: tuple, scheduling: str) -> tuple:
    """The mtp plan's daemons with asynchronous scheduling off, on (names unchanged), or
    both: each mode sync and then "<mode>-async", so the paired ratios set them side by
    side in one run."""
    with_async = lambda p, name: (name, p[1], True, *p[3:])          # noqa: E731
    if scheduling == "on":
        return tuple(with_async(p, p[0]) for p in plan)
    if scheduling == "both":
        return tuple(p for q in plan for p in (q, with_async(q, f"{q[0]}-async")))
    return plan


def paired_ratios(table: dict, raw: dict, baseline: str) -> None:
    """Each row's tokens/s over the baseline's, rep by rep (``vs_baseline_rounds``).

    Why: a rep's bursts of every configuration run back to back at one concurrency, so
    they meet the same level of a host whose read bandwidth flips between ~30 and ~55 GB/s
    within minutes; the ratio of two medians can pair a fast rep of one with a slow rep
    of the other (0.87x and 1.05x for the same daemons in two runs)."""
    base = raw.get(baseline) or {}
    for name, per in raw.items():
        for c, runs in per.items():
            rates = [r.get("output_tok_s") or 0.0 for r in runs]
            ref = [r.get("output_tok_s") or 0.0 for r in base.get(c, [])]
            table[name][c]["vs_baseline_rounds"] = (harness.round_ratios(rates, ref) or None
                                                    if name != baseline else None)


def sample_answer(target: Target, model: str, messages: list[dict], max_tokens: int = 16) -> str:
    """One greedy, non-streamed chat answer's text (a daemon that computes garbage shows
    here: the realistic models never answer with special tokens)."""
    import httpx
    r = httpx.post(target.base_url + "/v1/chat/completions", timeout=600, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    msg = r.json()["choices"][0]["message"]
    return (msg.get("reasoning_content") or "") + (msg.get("content") or "")


def memory_figures(threads: int) -> dict:
    """One measurement of the yardstick (the memory's read bandwidth) and of the kernel
    diagnostic (torch's GEMV rates) at the daemons' thread count."""
    return {"bandwidth": harness.memory_bandwidth_gbps(threads),
            "gemv_diagnostic": harness.gemv_rates_gbps(threads)}


def row_share(r: dict, concurrency: int, k: int, weights: Path, gbps: float,
              step_bytes=harness.step_weight_bytes) -> dict:
    """A daemon row's weight bytes a step and its share of the memory's read bandwidth.

    The steps ran at k=0..2 (adaptive speculation; ``steps_per_k``, else all at ``k``):
    bytes a step is ``step_bytes(weights, concurrency, k)`` weighted by those counts; a
    sequence gets 1 token from a step that drafted nothing, the mean accepted length from
    one that drafted; steps/s = tokens/s / (concurrency x tokens a sequence a step).
    "share": over the burst's tok/s (TTFT in it); "decode_share": over concurrency / TPOT p50."""
    per_k = {int(j): float(n) for j, n in (r.get("steps_per_k") or {}).items() if n}
    if not per_k:
        per_k = {k: 1.0}
    total = sum(per_k.values())
    nbytes = sum(n * step_bytes(weights, concurrency, j) for j, n in per_k.items()) / total
    drafted = 1 - per_k.get(0, 0.0) / total
    tokens_a_step = (1 - drafted) + drafted * (r.get("mean_accepted_len") or 1.0)
    out = {"step_bytes": nbytes, "tokens_per_seq_step": tokens_a_step}
    if r.get("output_tok_s"):
        out["share"] = harness.bandwidth_share(nbytes, r["output_tok_s"] / concurrency / tokens_a_step, gbps)
    if r.get("tpot_median"):
        out["decode_share"] = harness.bandwidth_share(nbytes, 1 / r["tpot_median"] / tokens_a_step, gbps)
    return out


def limit_report(weights: Path, streaming: list[dict], table: dict, levels: list[int],
                 size: str | None, rows_of: dict[str, tuple[int, Path]] | None = None) -> dict:
    """The realistic-size figures: the memory's read bandwidth (both measurements and
    their mean), the kernel diagnostic, the weight bytes a step reads per concurrency,
    and every row's share of the bandwidth (``row_share``; ``rows_of``: a row's name ->
    (its MTP k, its weights))."""
    import json
    gbps = statistics.fmean(m["bandwidth"]["gbps"] for m in streaming)
    out = {"model": harness.shown_path(weights), "size": size, "streaming": streaming, "bandwidth_gbps": gbps,
           "parameters": None, "levels": {}, "rows": {}}
    marker = weights / "bench_model.json"
    if marker.is_file():
        out["parameters"] = json.loads(marker.read_text()).get("parameters")
    for c in levels:
        out["levels"][c] = {"active_bytes": harness.active_weight_bytes(weights, tokens=c),
                            "k1_step_bytes": harness.step_weight_bytes(weights, c, 1),
                            "k2_step_bytes": harness.step_weight_bytes(weights, c, 2)}
    for name, per in table.items():
        k, w = (rows_of or {}).get(name, (0, weights))
        out["rows"][name] = {c: row_share(per[c], c, k, w, gbps) for c in levels if c in per}
    return out


def print_limit(rep: dict) -> None:
    r = rep.get("realistic")
    if not r:
        return
    s = r["streaming"]
    bw = [m["bandwidth"] for m in s]
    diag = [m["gemv_diagnostic"] for m in s]
    print(f"memory read bandwidth (a plain read of {bw[0]['mib']} MiB, {bw[0]['threads']} thread(s), "
          f"median of {len(bw[0]['runs'])}): " + " / ".join(f"{m['gbps']:.2f}" for m in bw)
          + f" GB/s before / after the bursts (mean {r['bandwidth_gbps']:.2f})")
    print(f"kernel diagnostic, not the limit (torch's products over {diag[0]['weight_mib']} MiB): bf16 GEMV "
          + " / ".join(f"{m['bf16']:.2f}" for m in diag) + " GB/s; int8 _int_mm M=1 "
          + " / ".join(_fmt(m["int8"], ".2f") for m in diag) + " GB/s; fp32 GEMV "
          + " / ".join(f"{m['fp32']:.2f}" for m in diag) + " GB/s")
    for c, lv in r["levels"].items():
        print(f"concurrency {c}: a step reads {lv['active_bytes'] / 1e6:.0f} MB of weights MTP off (k=1 step "
              f"{lv['k1_step_bytes'] / 1e6:.0f} MB, k=2 {lv['k2_step_bytes'] / 1e6:.0f} MB)")
    for name, per in r.get("rows", {}).items():
        for c, sh in per.items():
            print(f"  {name} c={c}: {sh['step_bytes'] / 1e6:.0f} MB a step, "
                  f"{sh['tokens_per_seq_step']:.2f} tokens a sequence a step: "
                  f"{_fmt(sh.get('share') and 100 * sh['share'], '.0f')}% of the bandwidth (tok/s), "
                  f"{_fmt(sh.get('decode_share') and 100 * sh['decode_share'], '.0f')}% (concurrency / TPOT p50)")
    peer = rep.get("transformers_tok_s") or {}
    off = rep["results"].get("off", {})
    for bs, rate in peer.items():
        if bs in off:
            print(f"MTP off / transformers generate() at {bs}: {off[bs]['output_tok_s'] / rate:.2f}x")


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _steps_share(per_k: dict | None) -> str:
    """Share of engine steps that drafted k tokens (adaptive speculation), e.g. 10%/85%/5%."""
    counts = [float((per_k or {}).get(k, (per_k or {}).get(str(k), 0))) for k in range(3)]
    total = sum(counts)
    return "-" if not total else "/".join(f"{c / total:.0%}" for c in counts)


def print_table(rep: dict) -> None:
    res = rep["results"]
    base = res.get(rep.get("baseline", "off"))
    print(f"\nmachine: {rep['machine']}   date: {rep['date']}   prompts: {rep['prompt_set']}   "
          f"max_tokens: {rep['max_tokens']}{' spread' if rep.get('spread_max_tokens') else ''}"
          f"{' (ignore_eos)' if rep.get('ignore_eos') else ' (stop at EOS)'}   reps: {rep['reps']} (medians)   threads: {rep.get('threads')}")
    print(f"{'config':<6} {'conc':>4} {'tok/s':>8} {'x ' + rep.get('baseline', 'off'):>6} {'paired':>6} {'req/s':>6} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'accept':>7} {'acc.len':>7}  steps at k=0/1/2")
    for name, per in res.items():
        for c, r in per.items():
            ratio = r["output_tok_s"] / base[c]["output_tok_s"] if base and base[c]["output_tok_s"] else None
            rounds = r.get("vs_baseline_rounds")
            print(f"{name:<6} {c:>4} {_fmt(r['output_tok_s']):>8} {_fmt(ratio, '.2f'):>6} "
                  f"{_fmt(rounds and rounds['median'], '.2f'):>6} "
                  f"{_fmt(r['req_s'], '.2f'):>6} {_fmt(r['ttft_median'] * 1e3, '.0f'):>7}ms "
                  f"{_fmt(r['ttft_p99'] * 1e3, '.0f'):>7}ms "
                  f"{_fmt(r['tpot_median'] and r['tpot_median'] * 1e3, '.1f'):>7}ms "
                  f"{_fmt(r['tpot_p99'] and r['tpot_p99'] * 1e3, '.1f'):>7}ms "
                  f"{_fmt(r['acceptance_rate'], '.2f'):>7} {_fmt(r['mean_accepted_len'], '.2f'):>7}  "
                  f"{_steps_share(r.get('steps_per_k'))}")
    for name, rt in (rep.get("runtime") or {}).items():
        if rt:
            print(f"{name}: KV pool {rt.get('kv_blocks')} blocks x {rt.get('block_size')} tokens, "
                  f"KV cache {rt.get('kv_cache_dtype')}, async scheduling "
                  f"{'on' if rt.get('async_scheduling_enabled') else 'off'}, decode path "
                  f"{rt.get('decode_path')}")
    if rep.get("warmup"):
        print("warm-up (4 requests of 8 tokens, not in the medians): " + ", ".join(
            f"{n} {w['output_tok_s']:.1f} tok/s, TTFT p50 {w['ttft_median'] * 1e3:.0f} ms"
            for n, w in rep["warmup"].items()))
    if rep.get("start_s"):
        print("daemon start (launch to ready): " + ", ".join(f"{n} {s:.1f} s" for n, s in rep["start_s"].items()))
    if rep.get("compiled_s"):
        print("compiled step in use (launch to switch, serving meanwhile): "
              + ", ".join(f"{n} {s:.1f} s" for n, s in (rep.get("decode_compiled_s") or rep["compiled_s"]).items())
              + "; every graph (the prompt window too): "
              + ", ".join(f"{n} {s:.1f} s" for n, s in rep["compiled_s"].items()))
    for bs, rate in rep["transformers_tok_s"].items():
        ours = [r for n, per in res.items() if n == "k1" for c, r in per.items() if c == bs]
        ratio = f"  ours(k1, conc {bs}) / transformers: {ours[0]['output_tok_s'] / rate:.2f}x" if ours else ""
        stop = "max_tokens" if rep.get("ignore_eos") else "EOS"
        print(f"transformers generate() batch {bs} (the daemon's requests, stop at {stop}): "
              f"{rate:.1f} tok/s{ratio}")
    print_limit(rep)
    for name, text in (rep.get("sample_answers") or {}).items():
        print(f"{name} greedy answer: {text!r}" + ("" if text.strip() else "  <- NO TEXT: rows not valid"))
    if rep["prefill_forward_200_s"]:
        p = rep["prefill_forward_200_s"]
        for name, t in rep["ttft_200_prompt_s"].items():
            print(f"TTFT {rep.get('ttft_prompt_tokens') or 200}-token prompt ({name}): {t * 1e3:.0f} ms = "
                  f"{t / p:.2f}x one prefill forward ({p * 1e3:.0f} ms)")


def plot(rep: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, per in rep["results"].items():
        cs = sorted(per, key=int)          # int keys in a run, strings in a saved report
        xs = [int(c) for c in cs]
        a1.plot(xs, [per[c]["output_tok_s"] for c in cs], marker="o", label=name)
        a2.plot(xs, [(per[c]["tpot_median"] or 0) * 1e3 for c in cs], marker="o", label=name)
    for a, title in ((a1, "output tokens/s"), (a2, "TPOT median (ms)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrency")
        a.set_title(title)
        a.grid(True, alpha=0.3)
        a.legend()
    fig.suptitle(f"{rep['machine']} - {rep['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
