"""What every benchmark shares: daemons (started and stopped through
server.testing.daemon), bursts of requests at a concurrency, medians, the warm-up (run
before the measured bursts, its figures kept apart from theirs), the machine line, the
common command-line flags and the JSON report.

Why ratios from one run: the machines are shared and noisy, so absolute figures drift
between runs.  The comparisons run every configuration in the same process lifetime,
alternate bursts between configurations so that drift hits all of them, and report
medians over repetitions.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import httpx

from server.testing.daemon import DEFAULT_CONFIG, ROOT, Daemon, daemon_config, write_config

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.json"
REPORTS = ROOT / "docs" / "bench"


# --------------------------------------------------------------------------- daemons

@dataclass
class Target:
    name: str                       # "off", "k1", "k2", "sync", "async" or "url"
    base_url: str
    metrics_url: str
    daemon: Daemon | None = None
    workdir: Path | None = None     # its config (and its log, when kept)
    start_s: float = 0.0            # launch to "Daemon start success!"
    compiled_s: float | None = None  # launch to compiled graphs in use (background compile)
    decode_compiled_s: float | None = None  # launch to the decode graphs in use (first round)

    @property
    def mgmt_url(self) -> str:
        return self.metrics_url.rsplit("/metrics", 1)[0]


def weights_of(config: Path) -> Path:
    """The weight folder a MindIE config serves (a relative path is the config's folder's)."""
    mc = json.loads(config.read_text())["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    weights = Path(mc["modelWeightPath"])
    return weights if weights.is_absolute() else (config.parent / weights).resolve()


def start_daemon(name: str, base_config: Path, spec_tokens: int, threads: int,
                 async_scheduling: bool = False, weights: Path | None = None,
                 kv_int8: bool = False, timeout: float = 300.0,
                 extra_env: dict[str, str] | None = None, world_size: int = 1,
                 edit_config: Callable[[dict], None] | None = None, root: Path = ROOT) -> Target:
    """A daemon on ``base_config`` (free loopback ports) with MTP k=``spec_tokens`` (0: off),
    at least 64 sequences a batch, ready and with its step graphs in use.

    ``edit_config``: a function that changes the config dict before the daemon reads it;
    ``root``: the checkout whose ``server`` package runs (benchmarks.checkouts)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    cfg = daemon_config(base_config)
    srv = cfg["ServerConfig"]
    srv["maxLinkNum"] = max(int(srv.get("maxLinkNum", 300)), 256)
    mc = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    if weights is not None:
        mc["modelWeightPath"] = str(weights.resolve())
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
    if edit_config is not None:
        edit_config(cfg)
    env = {"MIES_SERVICE_MONITOR_MODE": "1", "OMP_NUM_THREADS": str(threads),
           "MINDIE_ASYNC_SCHEDULING_ENABLE": "1" if async_scheduling else "0", **(extra_env or {})}
    daemon = Daemon(write_config(workdir, cfg), env, log_level=None, cwd=root, new_session=True)
    try:
        daemon.start(timeout)
    except RuntimeError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        raise RuntimeError(f"daemon {name} did not start: {exc}") from None
    t = Target(name, daemon.base, daemon.metrics + "/metrics", daemon, workdir, daemon.start_s)
    wait_compiled(t)
    return t


def stop_daemon(t: Target, keep_logs: bool = False) -> None:
    """SIGTERM to the daemon's process group (30 s to drain, then SIGKILL); its log is kept
    in its workdir with ``keep_logs``, else the workdir goes."""
    if t.daemon is None:
        return
    try:
        t.daemon.terminate(timeout_s=30)
    except Exception:
        t.daemon.kill()
    if t.workdir and keep_logs:
        (t.workdir / "daemon.log").write_text(t.daemon.output())
        print(f"daemon {t.name} log kept: {t.workdir / 'daemon.log'}", file=sys.stderr)
    elif t.workdir:
        shutil.rmtree(t.workdir, ignore_errors=True)


def wait_compiled(target: Target, timeout: float = 900.0) -> None:
    """Block until the daemon's step graphs are in use (they compile or load in the
    background after the ports open), so no measurement straddles the switch.  A tiny
    request per poll gives the worker the step at which it adopts them."""
    t0 = target.daemon.launched
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


def status_of(target: Target, client: httpx.Client | None = None) -> dict:
    """The daemon's /v1/status (management plane)."""
    get = client.get if client is not None else httpx.get
    return get(target.mgmt_url + "/v1/status", timeout=30).json()


def runtime_of(target: Target) -> dict:
    """The daemon's RuntimeInfo (/v1/status on the management plane), {} if unavailable."""
    try:
        return status_of(target).get("runtime", {})
    except (httpx.HTTPError, ValueError):
        return {}


async def model_id(target: Target) -> str:
    async with httpx.AsyncClient(timeout=30) as c:
        return (await c.get(target.base_url + "/v1/models")).json()["data"][0]["id"]


# --------------------------------------------------------------------------- load

@dataclass
class RequestResult:
    ttft: float
    latency: float
    completion_tokens: int
    prompt_tokens: int = 0
    valid: bool | None = None       # the answer passed the comparison's own check

    @property
    def tpot(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


async def stream_chat(client: httpx.AsyncClient, url: str, model: str, messages: list[dict],
                      max_tokens: int, ignore_eos: bool = False) -> RequestResult:
    """One streamed greedy chat completion, timed (TTFT: the first content delta)."""
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


Request = Callable[[httpx.AsyncClient, int], Awaitable[RequestResult]]


async def post_chat(client: httpx.AsyncClient, base_url: str, body: dict) -> tuple[dict, float]:
    """One whole (not streamed) chat completion: (its JSON, seconds); RuntimeError unless 200."""
    t0 = time.perf_counter()
    r = await client.post(base_url + "/v1/chat/completions", json=body)
    latency = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(r.text[:200])
    return r.json(), latency


async def burst_of(target: Target, concurrency: int, num_requests: int, request: Request) -> dict:
    """``num_requests`` calls of ``request(client, i)`` with at most ``concurrency`` in
    flight; aggregate figures, and the MTP counters' change from the daemon's /metrics.
    A request that fails (HTTP error, or RuntimeError) is counted in "errors", not fatal."""
    before = await scrape(target.metrics_url)
    sem = asyncio.Semaphore(concurrency)
    results: list[RequestResult] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def run(i: int) -> None:
            async with sem:
                try:
                    results.append(await request(client, i))
                except (httpx.HTTPError, RuntimeError) as exc:   # counted, reported, not fatal
                    errors.append(repr(exc))
        t0 = time.perf_counter()
        await asyncio.gather(*(run(i) for i in range(num_requests)))
        wall = time.perf_counter() - t0
    after = await scrape(target.metrics_url)

    def grew(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)
    drafts, draft_toks = grew("spec_decode_num_drafts_total"), grew("spec_decode_num_draft_tokens_total")
    accepted = grew("spec_decode_num_accepted_tokens_total")
    if errors:
        print(f"\n{target.name} c={concurrency}: {len(errors)} failed requests, first: {errors[0]}",
              file=sys.stderr)
    if not results:
        raise RuntimeError(f"every request of the burst failed: {errors[0]}")
    tokens = sum(r.completion_tokens for r in results)
    tpots = [r.tpot for r in results if r.tpot is not None]
    checked = [r.valid for r in results if r.valid is not None]
    return {
        "output_tok_s": tokens / wall,
        "req_s": len(results) / wall,
        "ttft_median": statistics.median(r.ttft for r in results),
        "ttft_p99": pct([r.ttft for r in results], 99),
        "tpot_median": statistics.median(tpots) if tpots else None,
        "tpot_p99": pct(tpots, 99) if tpots else None,
        "acceptance_rate": accepted / draft_toks if draft_toks else None,
        "mean_accepted_len": 1 + accepted / drafts if drafts else None,
        "prompt_tokens": statistics.median(r.prompt_tokens for r in results),
        "tokens_per_request": tokens / len(results),
        "valid": sum(checked) / len(checked) if checked else None,
        "errors": len(errors),
        "steps_per_k": {k: grew(f"spec_decode_steps_total[{k}]") for k in range(3)},
    }


def spread_length(lo: int, hi: int, i: int) -> int:
    """Request i's length spread over lo .. hi: lo + (37 i mod (hi - lo + 1)), a fixed
    sequence (the same for every mode, daemon and round) whose mean over a cycle is the
    range's middle."""
    return lo + (i * 37) % (hi - lo + 1)


def spread_max_tokens(max_tokens: int, i: int) -> int:
    """Request i's max_tokens when a burst's lengths are spread: ``spread_length`` over
    max_tokens / 2 .. 3 x max_tokens / 2 (the closed loop's ``--lengths 32-96`` for 64).

    Why: with --ignore-eos every request of a burst ran exactly max_tokens, so at
    concurrency 8 all eight ended on one step and their successors were prefilled in one
    step; requests whose ends drift apart (answers end at EOS, or MTP accepts more drafts
    for some) are prefilled one at a time, each a step that reads every expert.  Lockstep
    made MTP off 1.4x faster at concurrency 8 on the 0.5b model than the same burst with
    spread lengths, and MTP, whose first window breaks the lockstep, look worse than it
    serves (benchmarks.closed_loop showed it at engine level)."""
    half = max_tokens // 2
    return spread_length(max(1, half), half + max_tokens, i)


async def burst(target: Target, model: str, prompts: list[list[dict]], concurrency: int,
                num_requests: int, max_tokens: int, ignore_eos: bool = False,
                spread: bool = False) -> dict:
    """``burst_of`` streamed greedy chats, the prompts in turn; ``spread``: each request's
    max_tokens by ``spread_max_tokens``."""
    async def request(client: httpx.AsyncClient, i: int) -> RequestResult:
        return await stream_chat(client, target.base_url, model, prompts[i % len(prompts)],
                                 spread_max_tokens(max_tokens, i) if spread else max_tokens,
                                 ignore_eos)
    return await burst_of(target, concurrency, num_requests, request)


def warm_up(target: Target, request: Request) -> dict:
    """The first requests pay one-off costs (allocations, lazy imports, grammar compiles):
    4 of them at concurrency 4, before any measured burst.  Their figures go in the
    report's "warmup", never into the medians."""
    return asyncio.run(burst_of(target, 4, 4, request))


def chat_warm_up(target: Target, model: str, prompts: list[list[dict]]) -> dict:
    """``warm_up`` with 8-token streamed chats of ``prompts``."""
    return asyncio.run(burst(target, model, prompts, 4, 4, 8))


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


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    idx = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[idx]


def medians(runs: list[dict]) -> dict:
    """Repetitions of one row: the median of each figure; "errors" and per-k step counts
    summed over the repetitions."""
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


# --------------------------------------------------------------------------- memory bandwidth, bytes a step reads

def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs reports (the last level), 0 if unknown."""
    best = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            pass
    return best


def memory_bandwidth_gbps(threads: int | None = None, mib: int = 1024, reps: int = 7,
                          device: str = "cpu") -> dict:
    """The memory's read bandwidth, the yardstick of every share the benchmarks report:
    GB/s of a plain streaming read, ``torch.sum`` over a ``mib`` MiB int64 tensor (far
    larger than any cache; its pages written before), with ``threads`` torch threads
    (default: this process's), the median of ``reps`` runs after a warm-up one.  A
    reduction does no work a core cannot hide behind the loads, so it reads as fast as
    the memory gives (28.5-29.3 GB/s at 2 threads on the 2-core EPYC, 2026-12-06), unlike
    a product kernel (``gemv_rates_gbps``: a kernel's speed, not the memory's).

    ``device`` "cuda": the same read of the GPU's memory (synchronized around each run).

    Keys: "gbps" (the median), "runs" (every timed run's GB/s), "mib", "threads"."""
    import torch
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        t = torch.ones((mib << 20) // 8, dtype=torch.int64, device=dev)
        t.sum()                                       # warm-up
        runs = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            t.sum()
            sync()
            runs.append(t.nbytes / (time.perf_counter() - t0) / 1e9)
        del t
    finally:
        torch.set_num_threads(old)
    return {"gbps": statistics.median(runs), "runs": [round(r, 2) for r in runs], "mib": mib,
            "threads": threads or old}


def round_ratios(numerators: list[float], denominators: list[float]) -> dict:
    """Each round's numerator / denominator (rounds whose two jobs ran side by side, so both
    met the same level of a host whose speed moves within minutes), as {"median", "min",
    "max"}; {} without a round to pair."""
    ratios = [a / b for a, b in zip(numerators, denominators) if b > 0]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)} if ratios else {}


def bandwidth_share(step_bytes: float, steps_per_s: float, gbps: float) -> float:
    """The share of the memory's read bandwidth a row streams: the weight bytes a step
    reads x steps a second / the bandwidth (``gbps``, GB/s).  Per token: a row of T
    tokens/s at n tokens a step runs T / n steps a second."""
    return step_bytes * steps_per_s / (gbps * 1e9)


def gemv_rates_gbps(threads: int | None = None, weight_mib: int | None = None,
                    reps: int = 7, device: str = "cpu") -> dict:
    """A kernel diagnostic, not the limit: GB/s of torch's own products at one row over a
    weight larger than the last-level cache, i.e. how fast torch's kernels stream a weight
    on this machine (compare with ``memory_bandwidth_gbps``: the bf16 GEMV ran 12.7-16.7
    GB/s where the memory gave 28.5-29.3, 2026-12-06).  One [1, K] x [K, N] product
    (default weight max(512 MiB, 2 x LLC), at most 2 GiB), ``F.linear`` on a [N, K] weight
    as the model's linears call it, with ``threads`` torch threads (the daemons'
    ``--threads``); the median of ``reps`` runs after a warm one.  (Named
    ``streaming_limit_gbps`` before, when the benchmarks took it for the limit.)

    Keys: "bf16" (torch's bf16 GEMV), "int8" (``torch._int_mm``
    at M=1 on the same bytes as int8 [N, 2K], as the int8 linears call it; M=17 on CUDA,
    whose kernel needs M > 16; None where this torch has no kernel for it), "fp32" (an fp32 GEMV over as many bytes: how
    close the bf16 kernel comes to an fp32 one), "weight_mib", "threads",
    "llc_mib".  ``device`` "cuda": the same on the GPU (synchronized around each run; the
    weight 2 GiB, well above any L2)."""
    import torch
    import torch.nn.functional as F
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    llc = last_level_cache_bytes()
    mib = weight_mib or (2048 if dev.type == "cuda" else min(2048, max(512, 2 * llc >> 20)))
    k = 8192
    n = (mib << 20) // (2 * k)

    def rate(fn, nbytes: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times) / 1e9

    try:
        w = torch.empty(n, k, dtype=torch.bfloat16, device=dev).uniform_(-1, 1)
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        out = {"bf16": rate(lambda: F.linear(x, w), w.nbytes)}
        w8 = w.view(torch.int8)                    # the same bytes as int8 [n, 2k]
        x8 = torch.randint(-127, 128, (1 if dev.type == "cpu" else 17, 2 * k), dtype=torch.int8, device=dev)
        try:
            out["int8"] = rate(lambda: torch._int_mm(x8, w8.t()), w8.nbytes)
        except RuntimeError:
            out["int8"] = None
        del w, w8
        w32 = torch.empty(n // 2, k, dtype=torch.float32, device=dev).uniform_(-1, 1)
        x32 = torch.randn(1, k, device=dev)
        out["fp32"] = rate(lambda: F.linear(x32, w32), w32.nbytes)
        del w32
    finally:
        torch.set_num_threads(old)
    return {**out, "weight_mib": mib, "threads": threads or old, "llc_mib": llc >> 20}


streaming_limit_gbps = gemv_rates_gbps        # the old name (a kernel diagnostic, not the limit)


def _element_bytes(dtype: str) -> float:
    return {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}.get(dtype, 2)


def weight_table(config) -> tuple[dict, list[tuple[str, int, float]]]:
    """(the config dict, [(parameter name, elements, bytes per element)]) of a checkpoint
    as stored: ``config`` is a checkpoint folder, a config.json dict or a DeepseekConfig.
    Quantized folders (msModelSlim description, compressed-tensors, FP8 blocks) count
    their int8 / int4 / fp8 weights at 1 / 0.5 / 1 byte (scales left out)."""
    from server.model.config import DeepseekConfig
    from server.model.deepseek_v3 import DeepseekV3ForCausalLM
    from server.model.meta import meta_device
    from server.model.quant.formats import ignored
    desc: dict = {}
    if isinstance(config, (str, Path)):
        folder = Path(config)
        raw = json.loads((folder / "config.json").read_text())
        for f in folder.glob("quant_model_description*.json"):
            desc = json.loads(f.read_text())
    elif isinstance(config, dict):
        raw = config
    else:
        raw, cfg = None, config
    cfg = DeepseekConfig.from_hf(dict(raw)) if raw is not None else cfg
    if raw is None:
        import dataclasses
        raw = {**cfg.extra, **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"}}
    qc = raw.get("quantization_config") or {}
    base = _element_bytes(str(raw.get("torch_dtype") or cfg.torch_dtype))
    with meta_device():
        model = DeepseekV3ForCausalLM(cfg)
    rows = []
    for name, p in model.named_parameters(remove_duplicate=False):
        prefix = name.rpartition(".")[0]
        size = base
        if name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
            size = 4                                       # routing stays float32
        elif desc:
            size = {"W8A8": 1, "W8A8_DYNAMIC": 1, "W4A8_DYNAMIC": 0.5}.get(desc.get(name, "FLOAT"), base)
        elif qc.get("quant_method") == "compressed-tensors" and p.dim() == 2 \
                and not prefix.endswith(("embed_tokens", "mlp.gate")) \
                and not ignored(prefix, qc.get("ignore", [])):
            size = 1                                       # its ``ignore`` list is what stays float
        elif qc.get("quant_method") == "fp8" and p.dim() == 2 and (".self_attn." in name or ".mlp." in name):
            size = 1
        rows.append((name, p.numel(), size))
    return raw, rows


def expected_experts(n_experts: int, per_token: int, tokens: int) -> float:
    """The expected number of distinct routed experts ``tokens`` tokens choose, each
    ``per_token`` of ``n_experts`` under uniform routing: E * (1 - (1 - k/E)^t)."""
    if not n_experts:
        return 0.0
    return n_experts * (1 - (1 - per_token / n_experts) ** tokens)


@functools.lru_cache(maxsize=None)
def _served_forms(dtype: str) -> tuple[bool, bool, bool]:
    import torch
    from server.engine.sample.screened_head import screens
    from server.model.quant.int8_copy import takes_int8_copy
    from server.model.kernels import settings, select
    half = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if half is None:
        return False, False, False
    chosen = settings.kernel_settings()
    screened = screens(torch.empty(8, 8, dtype=half), select.model_products(half, "cpu"))
    return (screened, takes_int8_copy(chosen.draft_head, {half}),
            takes_int8_copy(chosen.draft_layer, {half}))


def served_forms(config) -> dict:
    """The weights a served greedy step on this machine reads in another form than the
    checkpoint stores them, as the server's settings and this CPU decide (the ``auto``
    rules): the main head screened through its int8 copy for up to ``screen_rows`` rows
    (engine/sample/screened_head.py; the candidates' few rows left out), the MTP drafts'
    int8 head (engine/spec/draft_head.py) and int8 layer (engine/spec/draft_layer.py).
    Counting the stored bytes instead overstated what a step streams."""
    from server.engine.sample.screened_head import MAX_ROWS
    raw, _ = weight_table(config)
    screened, head, layer = _served_forms(str(raw.get("torch_dtype") or "float32"))
    return {"screened_head": screened, "screen_rows": MAX_ROWS, "draft_head_int8": head,
            "draft_layer_int8": layer}


def _served_size(name: str, size: float, n: int, forms: dict | None, rows: int) -> float:
    """Bytes an element of parameter ``name`` takes as served (``served_forms``)."""
    if not forms or size < 2:
        return size
    if name == "lm_head.weight":
        return 1 if forms["screened_head"] and rows <= forms["screen_rows"] else size
    if not name.startswith("model.layers.") or int(name.split(".")[2]) < n:
        return size
    if name.endswith("shared_head.head.weight"):
        return 1 if forms["draft_head_int8"] else size
    if name.endswith("_proj.weight") and not name.endswith("kv_b_proj.weight"):
        return 1 if forms["draft_layer_int8"] else size
    return size


def _split_bytes(raw: dict, rows: list, tokens: int, forms: dict | None = None
                 ) -> tuple[float, float]:
    """(main model bytes, one MTP pass's bytes) read for ``tokens`` tokens (``forms``:
    ``served_forms``, or None for the stored dtypes)."""
    n = int(raw["num_hidden_layers"])
    hidden = int(raw["hidden_size"])
    e, k = int(raw.get("n_routed_experts") or 0), int(raw.get("num_experts_per_tok") or 0)
    experts = expected_experts(e, k, tokens)
    main = mtp = 0.0
    for name, numel, size in rows:
        b = numel * _served_size(name, size, n, forms, tokens)
        if name.endswith("embed_tokens.weight"):
            b = tokens * hidden * size                     # rows looked up, not the table
        elif ".mlp.experts." in name:
            b *= experts / e                               # the share of experts a step touches
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= n:
            mtp += b
        else:
            main += b
    mtp += tokens * hidden * _element_bytes(str(raw.get("torch_dtype")))  # its embedding rows
    return main, mtp


def active_weight_bytes(config, tokens: int = 1, draft_passes: int = 0,
                        draft_tokens: int | None = None, served: bool = True) -> int:
    """Weight bytes one step reads for ``tokens`` tokens of the main model (a batch of
    ``tokens`` sequences, or verify windows), plus ``draft_passes`` MTP passes over
    ``draft_tokens`` tokens each (default ``tokens``): the embedding rows, every layer's
    attention, norms, router, dense MLP or shared experts and its routed experts, the
    final norm and lm_head; for an MTP pass the MTP layer (eh_proj, its block, its head,
    read again although it is lm_head).  Routed experts: top-k for one token; for t tokens
    the expected distinct experts under uniform routing, E * (1 - (1 - k/E)^t).  In the
    checkpoint's dtype (``weight_table``), but for what a served greedy step reads in
    another form where ``served`` (``served_forms``); ``config`` as ``weight_table`` takes it."""
    raw, rows = weight_table(config)
    forms = served_forms(config) if served else None
    main, _ = _split_bytes(raw, rows, tokens, forms)
    mtp = _split_bytes(raw, rows, draft_tokens or tokens, forms)[1] if draft_passes else 0.0
    return int(main + draft_passes * mtp)


def step_weight_bytes(config, batch: int = 1, k: int = 0, served: bool = True) -> int:
    """Weight bytes of one decode step of ``batch`` sequences with MTP k: the main model
    over batch x (1 + k) verify tokens, then k MTP passes over ``batch`` tokens (a lower
    bound: a pass after accepted drafts may run more positions)."""
    return active_weight_bytes(config, tokens=batch * (1 + k), draft_passes=k, draft_tokens=batch,
                               served=served)


# --------------------------------------------------------------------------- reports

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The machine line of every report: CPU model and core count."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def program() -> str:
    """How this program was started: ``python -m benchmarks.<name>``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return f"python -m {spec.name}" if spec is not None else Path(sys.argv[0]).name


def command_line() -> str:
    return " ".join([program()] + sys.argv[1:])


def shown_path(path: Path | str) -> str:
    """A path as a saved report names it: relative to the checkout when inside it (a report
    must not carry one machine's folders), else as given."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(path)


def report_header(**fields) -> dict:
    """The fields every JSON report starts with: machine, date (UTC), command."""
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": command_line(), **fields}


def save_report(report: dict, path: Path | None) -> Path | None:
    """Write ``report`` as JSON to ``path`` (--json); a bare file name goes under
    docs/bench/.  Nothing without a path."""
    if path is None:
        return None
    dest = REPORTS / path if not path.is_absolute() and path.parent == Path(".") else path
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {dest}", file=sys.stderr)
    return dest


def load_prompts() -> dict:
    """The bench prompt set (prompts.json: held-out prompts of the demo model's domain)."""
    return json.loads(PROMPTS_FILE.read_text())


def chat_prompt_ids(checkpoint: Path) -> list[list[int]]:
    """The bench prompts' last user turns as token ids, rendered by the checkpoint's chat
    template as the daemon renders a request."""
    from server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(checkpoint)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p[-1]["content"]}],
                                               tokenize=False, add_generation_prompt=True))
            for p in load_prompts()["prompts"]]


def levels(arg: str | None, default: str) -> list[int]:
    """Concurrency levels from ``--concurrency 1,16,64``."""
    return [int(x) for x in (arg or default).split(",")]


def parser(description: str, concurrency_help: str) -> argparse.ArgumentParser:
    """The flags the daemon comparisons share (benchmarks.serve adds its own)."""
    ap = argparse.ArgumentParser(prog=program(), description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-file", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and levels (< 10 min)")
    ap.add_argument("--concurrency", default=None, help=concurrency_help)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for every daemon and for the reference rows (default 1: "
                         "on a small shared machine more threads oversubscribe the cores and "
                         "OpenMP spin-waits, measured 70x slower on 2 busy cores)")
    ap.add_argument("--json", type=Path,
                    help="write the report (JSON) here; a bare file name goes under docs/bench/")
    return ap
