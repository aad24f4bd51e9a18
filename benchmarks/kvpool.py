"""KV pool benchmark (``python -m benchmarks.kvpool``, or ``benchmarks.serve --compare
kvpool``): the prefix cache with and without the host KV tier (kvPoolConfig backend "host"), on the demo model, MTP k=1.

Both daemons get a device pool capped at ``maxBatchSize * ceil((maxSeqLen + 1) /
block) + 1`` blocks (maxBatchSize 4, maxSeqLen 1152: 293 blocks of 16 tokens, 4,688
tokens) and the same work, run one daemon after the other:

  * hit rate: P distinct prompts of ~1,000 tokens (whose full blocks need about 4x the
    device pool) requested in R rounds; the rate is prompt tokens found (device + host
    tier) / prompt tokens looked up, over rounds 2..R (round 1 is cold by construction),
    from the engine's counters on /v1/status;
  * TTFT of a ~1,000-token prompt whose blocks were evicted from the device pool: each
    repetition sends a fresh prompt once, then enough other long prompts to push its
    blocks out of the device pool, then the prompt again, timed (streamed, first token).
    Without the tier it is recomputed; with it, its blocks are loaded from host memory.
  * the greedy outputs of every request, compared between the two daemons;
  * the disk tier: a third daemon (host tier + disk tier) gets each TTFT prompt once and
    the long prompts that push it out of the device pool (so it is written to disk), is
    stopped, and a fourth one on the same folder, with empty device and host tiers, gets
    the prompts again, timed: its blocks come back from verified files;
  * preemption (engine level, no daemon): 8 seeded requests on a device pool too small
    for them all, maxPreemptCount 100, swap to the host tier vs recompute, against an
    unpressured run: preemptions, how many swapped / recomputed, prompt tokens computed
    (a recomputed request computes its tokens again) and whether outputs are identical.
"""
from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.harness import Target, start_daemon, status_of, stop_daemon

WORDS = ("the engine verifies each draft token against the main model and keeps the accepted "
         "prefix before it drafts again while blocks of the cache move between device and host "
         "memory when the pool runs short").split()


def _start(name: str, base: Path, tier: bool, threads: int, pool_file: Path | None = None) -> Target:
    """MTP k=1 and the prefix cache on a small device pool (maxBatchSize 4, maxSeqLen 1152),
    uncompiled; the host tier on with ``tier`` (``pool_file``: its settings, the disk tier)."""
    def edit(cfg: dict) -> None:
        be = cfg["BackendConfig"]
        be["kvPoolConfig"] = {"backend": "host" if tier else "", "asyncWrite": False,
                              "configPath": str(pool_file) if pool_file is not None else ""}
        dep = be["ModelDeployConfig"]
        dep.update(maxSeqLen=1152, maxInputTokenLen=1100)
        mc = dep["ModelConfig"][0]
        mc["plugin_params"] = json.dumps({"plugin_type": "mtp,prefix_cache", "num_speculative_tokens": 1})
        mc["cpuMemSize"] = 1 if tier else 0
        be["ScheduleConfig"].update(maxBatchSize=4, maxPrefillBatchSize=4, cacheBlockSize=16,
                                    maxIterTimes=64)
    return start_daemon(f"kvpool-{name}", base, 1, threads, extra_env={"MTP_SERVE_COMPILE": "0"},
                        edit_config=edit)


def _prompt(seed: int, words: int = 425) -> str:      # ~1,000 tokens (demo tokenizer)
    rng = random.Random(seed)
    return f"request {seed}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def _complete(client: httpx.Client, t: Target, prompt: str) -> tuple[float, str, int]:
    """(TTFT s, text, prompt tokens) of one streamed greedy completion."""
    body = {"model": "deepseek-v3-tiny-mtp", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, n = None, [], 0
    with client.stream("POST", t.base_url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["prompt_tokens"]
            for c in chunk.get("choices") or []:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(c.get("text") or "")
    return ttft or time.perf_counter() - t0, "".join(text), n


def run_one(t: Target, num_prompts: int, rounds: int, reps: int, flush: int) -> dict:
    with httpx.Client(timeout=600) as client:
        st0 = status_of(t, client)
        pool_tokens = st0["kv_cache"]["total_blocks"] * st0["kv_cache"]["block_size"]
        texts: dict[str, str] = {}
        marks = []
        n_tokens = 0
        for r in range(rounds):
            for i in range(num_prompts):
                _, texts[f"r{r}-p{i}"], n_tokens = _complete(client, t, _prompt(i))
            marks.append(status_of(t, client)["engine"])
        a, b = marks[0], marks[-1]
        queried = b["prefix_cache_queries"] - a["prefix_cache_queries"]
        device = b["prefix_cache_hits"] - a["prefix_cache_hits"]
        host = b["host_cache_hits"] - a["host_cache_hits"]
        ttfts, restored = [], []
        for rep in range(reps):
            seed = 10_000 + rep
            _complete(client, t, _prompt(seed))                     # its blocks are now cached
            for j in range(flush):                                  # ... and pushed out
                _complete(client, t, _prompt(20_000 + rep * 100 + j))
            before = status_of(t, client)["engine"]
            ttft, texts[f"ttft{rep}"], _ = _complete(client, t, _prompt(seed))
            after = status_of(t, client)["engine"]
            ttfts.append(ttft)
            restored.append((after["host_cache_hits"] - before["host_cache_hits"],
                             after["prefix_cache_hits"] - before["prefix_cache_hits"]))
        st = status_of(t, client)
    return {"device_pool_tokens": pool_tokens, "prompt_tokens": n_tokens,
            "prefix_tokens_over_pool": round(num_prompts * (n_tokens // 16 * 16) / pool_tokens, 2),
            "hit_rate": (device + host) / queried, "device_hit_rate": device / queried,
            "host_hit_rate": host / queried, "ttft_1000_s": statistics.median(ttfts),
            "ttft_all_s": [round(x, 4) for x in ttfts],
            "restored_tokens_host_device": restored, "texts": texts,
            "host_kv_tier": st["host_kv_tier"]}


def disk_restart(base: Path, threads: int, reps: int, flush: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="bench-kvpool-disk-"))
    pool_file = folder / "pool.json"
    (folder / "blocks").mkdir()
    pool_file.write_text(json.dumps({"disk_path": str(folder / "blocks"), "disk_size_gb": 1}))
    seeds = [30_000 + r for r in range(reps)]
    try:
        t = _start("disk-write", base, True, threads, pool_file)
        try:
            with httpx.Client(timeout=600) as client:
                for rep, seed in enumerate(seeds):
                    _complete(client, t, _prompt(seed))
                    for j in range(flush):
                        _complete(client, t, _prompt(40_000 + rep * 100 + j))
                written = status_of(t, client)["host_kv_tier"]["disk"]
        finally:
            stop_daemon(t)
        t = _start("disk-read", base, True, threads, pool_file)
        try:
            with httpx.Client(timeout=600) as client:
                ttfts = [_complete(client, t, _prompt(seed))[0] for seed in seeds]
                read = status_of(t, client)["host_kv_tier"]["disk"]
        finally:
            stop_daemon(t)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"ttft_1000_s": statistics.median(ttfts), "ttft_all_s": [round(x, 4) for x in ttfts],
            "blocks_written": written["used_blocks"], "hit_tokens_after_restart": read["hit_tokens"],
            "corrupt_files": read["corrupt_files"]}


def preemption(weights: Path, threads: int) -> dict:
    import torch
    from server.engine.config import EngineConfig
    from server.engine.core import LLMEngine
    from server.engine.protocol import EngineRequest, SamplingParams
    from server.model.loading import load_checkpoint
    torch.set_num_threads(threads)
    model, _ = load_checkpoint(weights)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(40, 120))] for _ in range(8)]
    sp = SamplingParams(max_tokens=96, temperature=0.7, seed=11, ignore_eos=True)

    def run(**kw) -> tuple[dict, dict, float]:
        cfg = EngineConfig(block_size=16, num_speculative_tokens=1, max_queue_delay_us=0,
                           max_batch_size=8, max_seq_len=512, **kw)
        engine = LLMEngine(model, cfg, eos_token_ids=set())
        t0 = time.perf_counter()
        outs = engine.generate([EngineRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)])
        wall = time.perf_counter() - t0
        st = engine.stats()
        engine.shutdown()
        return ({k: [t for o in v for t in o.token_ids] for k, v in outs.items()},
                {"preemptions": st.num_preemptions, "swapped": st.num_swapped_out,
                 "recomputed": st.num_preemptions_recomputed,
                 "prompt_tokens_computed": st.num_prompt_tokens}, wall)

    ref, _, _ = run(num_blocks=512)
    out = {}
    for name, kw in (("recompute", {}), ("swap", {"host_cache_blocks": 512, "swap_preemption": True})):
        toks, figs, wall = run(num_blocks=40, max_preempt_count=100, **kw)
        out[name] = {**figs, "wall_s": round(wall, 2), "identical_to_unpressured": toks == ref}
    return out


def run(args) -> int:
    """The comparison, on parsed flags (``main``'s, or benchmarks.serve's)."""
    num_prompts, rounds, reps, flush = (12, 2, 2, 6) if args.quick else (20, 3, 5, 6)
    results = {}
    for name, tier in (("no-tier", False), ("host-tier", True)):
        print(f"starting daemon {name} ...", file=sys.stderr)
        t = _start(name, args.config_file, tier, args.threads)
        try:
            results[name] = run_one(t, num_prompts, rounds, reps, flush)
        finally:
            stop_daemon(t)
    off, on = results["no-tier"], results["host-tier"]
    pre = preemption(harness.weights_of(args.config_file), args.threads)
    print("starting daemons disk-write, disk-read ...", file=sys.stderr)
    disk = disk_restart(args.config_file, args.threads, reps, flush)
    report = {
        **harness.report_header(threads=args.threads),
        "prompts": num_prompts, "rounds": rounds, "reps": reps,
        "outputs_identical": off["texts"] == on["texts"],
        "ttft_speedup": off["ttft_1000_s"] / on["ttft_1000_s"],
        "results": {k: {kk: vv for kk, vv in v.items() if kk != "texts"} for k, v in results.items()},
        "preemption": pre, "disk_restart": disk,
        "ttft_speedup_disk": off["ttft_1000_s"] / disk["ttft_1000_s"]}
    print(f"\nKV pool ({report['machine']}; {num_prompts} prompts x {rounds} rounds, "
          f"{off['prompt_tokens']} tokens each = {off['prefix_tokens_over_pool']}x the device pool "
          f"of {off['device_pool_tokens']} tokens)")
    print(f"{'':10} {'hit rate':>9} {'device':>7} {'host':>7} {'TTFT 1k (s)':>12}")
    for name, r in results.items():
        print(f"{name:10} {r['hit_rate']:9.3f} {r['device_hit_rate']:7.3f} {r['host_hit_rate']:7.3f} "
              f"{r['ttft_1000_s']:12.4f}")
    print(f"TTFT speed-up {report['ttft_speedup']:.1f}x; outputs identical: {report['outputs_identical']}")
    print(f"disk tier after a restart: TTFT {disk['ttft_1000_s']:.4f} s "
          f"({report['ttft_speedup_disk']:.1f}x lower than recompute), "
          f"{disk['hit_tokens_after_restart']} prompt tokens from disk, {disk['corrupt_files']} corrupt")
    print("preemption (engine, MTP k=1, 8 requests, 40-block pool):")
    for name, r in pre.items():
        print(f"  {name:9} {r}")
    harness.save_report(report, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, "not used: the work is sequential")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
