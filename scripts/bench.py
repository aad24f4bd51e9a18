#!/usr/bin/env python
"""Serving benchmark: MTP off vs MTP k=1 vs k=2, and our daemon vs transformers generate();
or (--compare async) MTP k=1 with asynchronous scheduling on vs off.

Why ratios from one run: the machines are shared and noisy, so absolute figures drift
between runs.  Every configuration runs in the same process lifetime, bursts alternate
between configurations (off, k1, k2, off, k1, k2, ...) so that drift hits all of them,
and the table reports medians over repetitions plus ratios against MTP off.

Usage:
  scripts/bench.py [--quick] [--json out.json] [--plot out.png]
  scripts/bench.py --compare async [--concurrency 1,16,64]   # MINDIE_ASYNC_SCHEDULING_ENABLE 1 vs 0
  scripts/bench.py --compare quant --quantized DIR             # MTP k=1: float vs an int8 checkpoint
                                                               # (DIR from scripts/quantize.py)
  scripts/bench.py --compare kv                                # MTP k=1: float vs int8 KV cache
  scripts/bench.py --compare compile                           # MTP k=1: uncompiled vs compiled
  scripts/bench.py --compare process                           # MTP off and k=1: the engine on a
                                                               # thread vs in its own process
  scripts/bench.py --compare tp                                # MTP k=1: one process vs tp=2 ranks
  scripts/bench.py --compare pd                                # MTP k=1: co-located vs 1P + 1D + coordinator
                                                               # (first start and later start)
  scripts/bench.py --compare kvpool                            # prefix cache without / with the
                                                               # host KV tier (bench_kvpool.py)
  scripts/bench.py --compare structured [--concurrency 16]     # MTP k=1: with vs without a
                                                               # json_schema (bench_structured.py)
  scripts/bench.py --url http://127.0.0.1:1025 --metrics-url http://127.0.0.1:1027  # a running daemon
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_FILE = ROOT / "scripts" / "bench_prompts.json"
DEFAULT_CONFIG = ROOT / "conf" / "config.json"


# --------------------------------------------------------------------------- daemons

@dataclass
class Target:
    name: str                       # "off", "k1", "k2", "sync", "async" or "url"
    base_url: str
    metrics_url: str
    proc: subprocess.Popen | None = None
    workdir: Path | None = None
    start_s: float = 0.0            # launch to "Daemon start success!"
    compiled_s: float | None = None  # launch to compiled graphs in use (background compile)
    decode_compiled_s: float | None = None  # launch to the decode graphs in use (first round)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_config(base: Path, workdir: Path, spec_tokens: int,
                  weights_override: Path | None = None, kv_int8: bool = False,
                  world_size: int = 1) -> tuple[Path, int, int]:
    cfg = json.loads(base.read_text())
    port, mport = _free_port(), _free_port()
    srv = cfg["ServerConfig"]
    srv.update(ipAddress="127.0.0.1", managementIpAddress="127.0.0.1", port=port,
               managementPort=mport, metricsPort=mport, httpsEnabled=False,
               maxLinkNum=max(int(srv.get("maxLinkNum", 300)), 256))
    mc = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    weights = Path(mc["modelWeightPath"])
    if not weights.is_absolute():
        mc["modelWeightPath"] = str((base.parent / weights).resolve())
    if weights_override is not None:
        mc["modelWeightPath"] = str(weights_override.resolve())
    if kv_int8:
        models = mc.setdefault("models", {})
        key = next(iter(models), "deepseekv2")
        models.setdefault(key, {}).setdefault("kv_cache_options", {})["kv_cache_dtype"] = "int8"
    mc["plugin_params"] = (json.dumps({"plugin_type": "mtp", "num_speculative_tokens": spec_tokens})
                           if spec_tokens > 0 else "")
    if world_size > 1:                     # tensor parallel over world_size rank processes
        mc["worldSize"] = world_size
        cfg["BackendConfig"]["npuDeviceIds"] = [list(range(world_size))]
    sched = cfg["BackendConfig"]["ScheduleConfig"]
    sched["maxBatchSize"] = max(int(sched.get("maxBatchSize", 64)), 64)
    sched["maxPrefillBatchSize"] = min(int(sched.get("maxPrefillBatchSize", 16)), sched["maxBatchSize"])
    path = workdir / "config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path, port, mport


def start_daemon(name: str, base_config: Path, spec_tokens: int, threads: int,
                 async_scheduling: bool = False, weights: Path | None = None,
                 kv_int8: bool = False, timeout: float = 300.0,
                 extra_env: dict[str, str] | None = None, world_size: int = 1,
                 edit_config=None, root: Path = ROOT) -> Target:
    """``edit_config``: a function that changes the config dict before the daemon reads it;
    ``root``: the checkout whose ``server`` package runs (scripts/bench_checkouts.py)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    cfg_path, port, mport = _write_config(base_config, workdir, spec_tokens, weights, kv_int8,
                                          world_size)
    if edit_config is not None:
        cfg = json.loads(cfg_path.read_text())
        edit_config(cfg)
        cfg_path.write_text(json.dumps(cfg, indent=2))
    log = open(workdir / "daemon.log", "w")
    env = dict(os.environ, MIES_SERVICE_MONITOR_MODE="1", OMP_NUM_THREADS=str(threads),
               MINDIE_ASYNC_SCHEDULING_ENABLE="1" if async_scheduling else "0", **(extra_env or {}))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "server", "--config-file", str(cfg_path)],
                            cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "Daemon start success!" in (workdir / "daemon.log").read_text(errors="replace"):
            t = Target(name, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics", proc, workdir,
                       time.monotonic() - t0)
            wait_compiled(t, t0)
            return t
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"daemon {name} did not start; log:\n{(workdir / 'daemon.log').read_text()[-3000:]}")


def stop_daemon(t: Target, keep_logs: bool = False) -> None:
    if t.proc is None:
        return
    try:
        os.killpg(t.proc.pid, signal.SIGTERM)
        t.proc.wait(timeout=30)
    except Exception:
        t.proc.kill()
    if t.workdir and keep_logs:
        print(f"daemon {t.name} log kept: {t.workdir / 'daemon.log'}", file=sys.stderr)
    elif t.workdir:
        shutil.rmtree(t.workdir, ignore_errors=True)


# --------------------------------------------------------------------------- load

@dataclass
class RequestResult:
    ttft: float
    latency: float
    completion_tokens: int
    prompt_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


async def one_request(client: httpx.AsyncClient, url: str, model: str, messages: list[dict],
                      max_tokens: int, ignore_eos: bool = False) -> RequestResult:
    # Greedy and lossless: every configuration emits the same tokens, so stopping at EOS
    # still gives each configuration identical work, on text the model was trained for.
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    t0 = time.perf_counter()
    ttft = None
    tokens = prompt_tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            choices = chunk.get("choices") or []
            if ttft is None and choices:
                delta = choices[0].get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    ttft = time.perf_counter() - t0
    latency = time.perf_counter() - t0
    return RequestResult(ttft if ttft is not None else latency, latency, tokens, prompt_tokens)


async def burst(target: Target, model: str, prompts: list[list[dict]], concurrency: int,
                num_requests: int, max_tokens: int, ignore_eos: bool = False) -> dict:
    """`num_requests` requests with at most `concurrency` in flight; returns aggregate figures."""
    before = await scrape(target.metrics_url)
    sem = asyncio.Semaphore(concurrency)
    results: list[RequestResult] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def run(i: int) -> None:
            async with sem:
                try:
                    results.append(await one_request(client, target.base_url, model,
                                                     prompts[i % len(prompts)], max_tokens, ignore_eos))
                except (httpx.HTTPError, RuntimeError) as exc:   # counted, reported, not fatal
                    errors.append(repr(exc))
        t0 = time.perf_counter()
        await asyncio.gather(*(run(i) for i in range(num_requests)))
        wall = time.perf_counter() - t0
    after = await scrape(target.metrics_url)
    drafts = after.get("spec_decode_num_drafts_total", 0) - before.get("spec_decode_num_drafts_total", 0)
    draft_toks = (after.get("spec_decode_num_draft_tokens_total", 0)
                  - before.get("spec_decode_num_draft_tokens_total", 0))
    accepted = (after.get("spec_decode_num_accepted_tokens_total", 0)
                - before.get("spec_decode_num_accepted_tokens_total", 0))
    if errors:
        print(f"\n{target.name} c={concurrency}: {len(errors)} failed requests, first: {errors[0]}",
              file=sys.stderr)
    if not results:
        raise RuntimeError(f"every request of the burst failed: {errors[0]}")
    tokens = sum(r.completion_tokens for r in results)
    tpots = [r.tpot for r in results if r.tpot is not None]
    return {
        "output_tok_s": tokens / wall,
        "req_s": len(results) / wall,
        "ttft_median": statistics.median(r.ttft for r in results),
        "ttft_p99": _pct([r.ttft for r in results], 99),
        "tpot_median": statistics.median(tpots) if tpots else None,
        "tpot_p99": _pct(tpots, 99) if tpots else None,
        "acceptance_rate": accepted / draft_toks if draft_toks else None,
        "mean_accepted_len": 1 + accepted / drafts if drafts else None,
        "prompt_tokens": statistics.median(r.prompt_tokens for r in results),
        "errors": len(errors),
        "steps_per_k": {k: after.get(f"spec_decode_steps_total[{k}]", 0) - before.get(f"spec_decode_steps_total[{k}]", 0)
                        for k in range(3)},
    }


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    idx = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[idx]


async def scrape(url: str) -> dict[str, float]:
    """Sum every sample of each metric family (labels folded) from a Prometheus page."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            text = (await c.get(url)).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_created", "_bucket")):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
            if "k" in s.labels:                      # adaptive speculation: steps per k
                key = f"{s.name}[{s.labels['k']}]"
                out[key] = out.get(key, 0.0) + s.value
    return out


def wait_compiled(target: Target, t0: float, timeout: float = 900.0) -> None:
    """Block until the daemon's step graphs are in use (they compile or load in the
    background after the ports open), so no measurement straddles the switch.  A tiny
    request per poll gives the worker the step at which it adopts them."""
    model = asyncio.run(model_id(target))
    deadline = time.monotonic() + timeout
    while (rt := runtime_of(target)).get("compile_state") == "compiling":
        if rt.get("decode_path") == "compiled" and target.decode_compiled_s is None:
            target.decode_compiled_s = time.monotonic() - t0
        if time.monotonic() > deadline:
            raise RuntimeError(f"daemon {target.name}: graphs not ready after {timeout:.0f} s")
        httpx.post(target.base_url + "/v1/completions", timeout=60,
                   json={"model": model, "prompt": "Hi", "max_tokens": 1})
        time.sleep(0.5)
    if runtime_of(target).get("compile_state") == "compiled":
        target.compiled_s = time.monotonic() - t0
        if target.decode_compiled_s is None:
            target.decode_compiled_s = target.compiled_s


def runtime_of(target: Target) -> dict:
    """The daemon's RuntimeInfo (/v1/status on the management plane), {} if unavailable."""
    url = target.metrics_url.rsplit("/metrics", 1)[0] + "/v1/status"
    try:
        return httpx.get(url, timeout=30).json().get("runtime", {})
    except (httpx.HTTPError, ValueError):
        return {}


async def model_id(target: Target) -> str:
    async with httpx.AsyncClient(timeout=30) as c:
        return (await c.get(target.base_url + "/v1/models")).json()["data"][0]["id"]


# --------------------------------------------------------------------------- references

def burst_size(concurrency: int, quick: bool) -> int:
    """Requests per burst at a concurrency level (the transformers rows do the same work).

    At least 12 (8 with --quick): a burst of 4 requests at concurrency 1 lasted well under
    a second, and on the shared machine the per-burst TPOT of one configuration ranged
    2.2-3.2 ms, which the medians of three repetitions did not smooth out."""
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
                 batch_sizes: list[int], ignore_eos: bool, quick: bool) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.torch = torch
        tok = AutoTokenizer.from_pretrained(weights)
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        self.pad_id = tok.pad_token_id
        self.model = AutoModelForCausalLM.from_pretrained(weights, torch_dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.max_tokens, self.ignore_eos = max_tokens, ignore_eos
        self.batches: dict[int, list] = {}
        for bs in batch_sizes:
            texts = [tok.apply_chat_template(prompts[i % len(prompts)], tokenize=False, add_generation_prompt=True)
                     for i in range(burst_size(bs, quick))]
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


def prefill_forward_seconds(weights: Path, num_tokens: int, reps: int = 5) -> float:
    """Median wall time of one no-cache forward over `num_tokens` tokens with our model."""
    import torch
    from server.model.loader import load_checkpoint
    model, _ = load_checkpoint(weights, dtype=torch.float32)
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-file", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--url", help="benchmark a running daemon instead of starting three")
    ap.add_argument("--metrics-url", help="its /metrics URL (with --url)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and levels (< 10 min)")
    ap.add_argument("--compare", choices=("mtp", "async", "quant", "kv", "compile", "kvpool", "tp", "pd",
                                          "structured", "process"),
                    default="mtp",
                    help="mtp: MTP off / k=1 / k=2 and transformers; async: MTP k=1 with "
                         "asynchronous scheduling off vs on; quant: MTP k=1 on the float "
                         "checkpoint vs --quantized; kv: MTP k=1 with a float vs an int8 KV cache")
    ap.add_argument("--quantized", type=Path, help="an int8 checkpoint (with --compare quant)")
    ap.add_argument("--concurrency", default=None, help="default 1,4,16,64 (mtp) or 1,16,64 (async)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="run every request to max_tokens (past the model's answer) instead of stopping at EOS")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-peer", action="store_true", help="skip the transformers reference rows")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for every daemon and for the reference rows (default 1: "
                         "on a small shared machine more threads oversubscribe the cores and "
                         "OpenMP spin-waits, measured 70x slower on 2 busy cores)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    if args.compare == "kvpool":
        from bench_kvpool import main as kvpool_main
        return kvpool_main(args)
    if args.compare == "pd":
        from bench_pd import main as pd_main
        return pd_main(args)
    if args.compare == "structured":
        from bench_structured import main as structured_main
        return structured_main(args)

    levels = [int(x) for x in (args.concurrency or
                               ("1,4,16,64" if args.compare == "mtp" else "1,16,64")).split(",")]
    if args.compare == "quant" and not args.quantized:
        ap.error("--compare quant needs --quantized DIR (made by scripts/quantize.py)")
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
            # MTP k=1 on one process vs two tensor-parallel ranks (static step, uncompiled
            # on both: the ranks do not compile their step)
            "tp": (("tp1", 1, False, None, False, {"MTP_SERVE_COMPILE": "0"}, 1),
                   ("tp2", 1, False, None, False, {"MTP_SERVE_COMPILE": "0"}, 2)),
            # MTP off and k=1 with the engine on a thread of the serving process vs in its
            # own process (the daemon's default)
            "process": (("t-off", 0, False, None, False, {"MTP_SERVE_ENGINE_PROCESS": "0"}),
                        ("t-k1", 1, False, None, False, {"MTP_SERVE_ENGINE_PROCESS": "0"}),
                        ("p-off", 0, False, None, False, {"MTP_SERVE_ENGINE_PROCESS": "1"}),
                        ("p-k1", 1, False, None, False, {"MTP_SERVE_ENGINE_PROCESS": "1"})),
            "mtp": (("off", 0, False, None, False), ("k1", 1, False, None, False),
                    ("k2", 2, False, None, False))}[args.compare]
    import torch
    torch.set_num_threads(args.threads)                # the reference rows run in this process
    reps = args.reps or (1 if args.quick else 3)
    max_tokens = 32 if args.quick and args.max_tokens == 64 else args.max_tokens
    prompt_set = json.loads(PROMPTS_FILE.read_text())
    prompts = prompt_set["prompts"]

    base_cfg = json.loads(args.config_file.read_text())
    mc = base_cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    weights = Path(mc["modelWeightPath"])
    if not weights.is_absolute():
        weights = (args.config_file.parent / weights).resolve()

    targets: list[Target] = []
    failed = True
    try:
        if args.url:
            targets.append(Target("url", args.url.rstrip("/"), args.metrics_url or args.url + "/metrics"))
        else:
            for name, k, async_on, target_weights, kv_int8, *extra in plan:
                print(f"starting daemon {name} ...", file=sys.stderr)
                targets.append(start_daemon(name, args.config_file, k, args.threads, async_on,
                                            target_weights, kv_int8,
                                            extra_env=extra[0] if extra else None,
                                            world_size=extra[1] if len(extra) > 1 else 1))
        model = asyncio.run(model_id(targets[0]))
        runtimes = {t.name: runtime_of(t) for t in targets}
        ttft_prompt = long_prompt(weights, 200)
        peer = None
        if not args.url and not args.no_peer and args.compare == "mtp":
            print("loading the transformers reference ...", file=sys.stderr)
            peer = TransformersPeer(weights, prompts, max_tokens,
                                    [1, 16] if 16 in levels or not args.quick else [1],
                                    args.ignore_eos, args.quick)
        total = reps * len(levels) * len(targets) + reps * len(targets) + (reps if peer else 0)
        prog = Progress(total)
        raw: dict[str, dict[int, list[dict]]] = {t.name: {c: [] for c in levels} for t in targets}
        ttft_raw: dict[str, list[float]] = {t.name: [] for t in targets}
        ttft_prompt_tokens = 0
        for t in targets:   # warm-up: first requests pay one-off costs
            asyncio.run(burst(t, model, prompts, 4, 4, 8))
        for _ in range(reps):
            for c in levels:
                n = burst_size(c, args.quick)
                for t in targets:        # alternate so drift hits every configuration
                    raw[t.name][c].append(asyncio.run(burst(t, model, prompts, c, n, max_tokens,
                                                                args.ignore_eos)))
                    prog.step(f"{t.name} c={c}")
            for t in targets:
                r = asyncio.run(burst(t, model, [ttft_prompt], 1, 3, 4))
                ttft_raw[t.name].append(r["ttft_median"])
                ttft_prompt_tokens = int(r["prompt_tokens"])
                prog.step(f"{t.name} ttft200")
            if peer is not None:         # between the bursts too, so drift hits it alike
                peer.measure()
                prog.step("transformers")
        # keep the daemons' logs when any request failed, to see why
        failed = any(r.get("errors") for per in raw.values() for runs in per.values() for r in runs)
    finally:
        shutil.rmtree(compile_dir, ignore_errors=True)
        for t in targets:
            stop_daemon(t, keep_logs=failed)

    table = {name: {c: _median_dict(runs) for c, runs in per.items()} for name, per in raw.items()}
    ttft200 = {name: statistics.median(v) for name, v in ttft_raw.items()}
    prefill_s = None
    if not args.url:
        prefill_s = prefill_forward_seconds(weights, ttft_prompt_tokens or 200)

    report = {"baseline": targets[0].name if targets else "off", "machine": _machine(), "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "prompt_set": prompt_set["version"], "max_tokens": max_tokens, "ignore_eos": args.ignore_eos, "reps": reps,
              "results": table, "runtime": runtimes, "ttft_200_prompt_s": ttft200, "transformers_tok_s": peer.medians() if peer else {},
              "prefill_forward_200_s": prefill_s, "ttft_prompt_tokens": ttft_prompt_tokens,
              "start_s": {t.name: round(t.start_s, 1) for t in targets if t.proc is not None},
              "compiled_s": {t.name: round(t.compiled_s, 1) for t in targets if t.compiled_s is not None},
              "decode_compiled_s": {t.name: round(t.decode_compiled_s, 1) for t in targets
                                    if t.decode_compiled_s is not None},
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    return 0


def _median_dict(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if r[key] is not None]
        if key == "errors":
            out[key] = sum(vals)
        elif vals and isinstance(vals[0], dict):          # counts (steps per k): summed over reps
            out[key] = {k: sum(v.get(k, 0) for v in vals) for k in vals[0]}
        else:
            out[key] = statistics.median(vals) if vals else None
    return out


def _machine() -> str:
    import platform
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


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
          f"max_tokens: {rep['max_tokens']}{' (ignore_eos)' if rep.get('ignore_eos') else ' (stop at EOS)'}   reps: {rep['reps']} (medians)   threads: {rep.get('threads')}")
    print(f"{'config':<6} {'conc':>4} {'tok/s':>8} {'x ' + rep.get('baseline', 'off'):>6} {'req/s':>6} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'accept':>7} {'acc.len':>7}  steps at k=0/1/2")
    for name, per in res.items():
        for c, r in per.items():
            ratio = r["output_tok_s"] / base[c]["output_tok_s"] if base and base[c]["output_tok_s"] else None
            print(f"{name:<6} {c:>4} {_fmt(r['output_tok_s']):>8} {_fmt(ratio, '.2f'):>6} "
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
