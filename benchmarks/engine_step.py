"""Engine-level decode timing: MTP off vs k=1 vs k=2 on one model, plus a lossless check.

One seeded random-weight DeepSeek-V3-shaped model (``--size big``: ~1.6B parameters,
server/testing/high_acceptance.py; ``--size small``: the tiny test shape, runs on a CPU in
seconds) is edited for high MTP acceptance and shared by three engines (KV caches are per
engine).  For batch 1 and batch 16 each engine serves greedy requests (64 random prompt
ids, ``--max-tokens`` outputs, EOS ignored); every ``engine.step()`` after the prefill is
timed on its own (``torch.cuda.synchronize()`` around it on CUDA).  Reported: median decode
step time, decode tokens/s (all sequences), tokens per sequence per step, and the ratios
k=1 step / off step, tokens/s k=1 / off and k=2 / off.

Lossless check: greedy MTP k=1 and k=2 must emit exactly the tokens MTP off emits, for
every request at both batch sizes.  Prints OK or MISMATCH (with the first differing
position); exits 1 on a mismatch.  In bf16 a verify step (k+1 tokens per sequence) and a
plain step run different kernel shapes, so a near-tie in the logits can flip a token: a
mismatch there says "look", the float32 tests (tests/gpu) are the strict check.

``--split`` (CPU): also time the decoder-layer calls inside each step (the compiled layer
graphs with ``--compile on``: the main layers and the MTP layer) and report them apart
from the rest of the step (heads, norms, verification, bookkeeping).  The layer calls
bound what MTP can give on the machine: with every other part of the step free, k=1
would give at most (tokens per step) x (off's layer time) / (k=1's layer time).

Usage (from the repository root):
  python -m benchmarks.engine_step --size big --dtype bf16 --compile off --json out.json   # on a GPU
  python -m benchmarks.engine_step --size small --device cpu                               # anywhere
  python -m benchmarks.engine_step --model models/deepseek-v3-tiny-mtp --device cpu --compile on --batch 1
  python -m benchmarks.engine_step --model models/deepseek-v3-tiny-mtp --device cpu --compile on --batch 1,16 --reps 5 --split
  python -m benchmarks.engine_step --model .cache/bench-models/deepseek-v3-0.5b-mtp --batch 1 --modes off,k1   # realistic size

``--model``: the checkpoint's own dtype unless ``--dtype``; its MTP layer as it is (the
benchmarks.models folders carry the high-acceptance edit).  With ``--model`` the memory's
read bandwidth (harness.memory_bandwidth_gbps: a plain streaming read of 1 GiB at this
process's threads, median of 7) is measured after the timed runs, and every row is set
against it: the weight bytes a step reads (harness.step_weight_bytes) x steps/s, as a
share of the bandwidth (harness.bandwidth_share).  torch's GEMV rates
(harness.gemv_rates_gbps) are printed beside it as a kernel diagnostic: how fast torch's
own products stream a weight here, not the limit.  Every row also reports max step /
median step over the timed steps (after the warm-up): how far the slowest step strays (a
late compile, an allocation, the shared machine).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import harness
from server.engine.child import keep_freed_pages
from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams
from server.testing.high_acceptance import big_config, build_model, make_high_acceptance, num_parameters

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = (("off", 0), ("k1", 1), ("k2", 2))
PROMPT_LEN = 64

# The tiny test shape (server/testing/tiny_checkpoint.py::tiny_config), as overrides.
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
             num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=1024)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU: {harness.cpu_model()} ({torch.get_num_threads()} threads)"


def make_engine(model, k: int, args, device: torch.device, max_batch: int,
                prompt_len: int = PROMPT_LEN) -> LLMEngine:
    """An engine for up to ``max_batch`` sequences of ``prompt_len`` + ``args.max_tokens``
    tokens, MTP k (0: off), ``args.compile``; no EOS, fixed k (no adaptive speculation)."""
    block_size = 16
    per_seq = -(-(prompt_len + args.max_tokens + 8) // block_size)
    cfg = EngineConfig(block_size=block_size, num_blocks=per_seq * max_batch + 16,
                       max_batch_size=max_batch, max_prefill_tokens=max(8192, prompt_len * max_batch),
                       max_prefill_batch_size=max_batch, max_queue_delay_us=0,
                       max_seq_len=prompt_len + args.max_tokens + 8, num_speculative_tokens=k,
                       adaptive_speculation=False, compile=args.compile, device=str(device))
    return LLMEngine(model, cfg, eos_token_ids=set())


def make_prompts(n: int, vocab: int, seed: int, prompt_len: int = PROMPT_LEN) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, prompt_len), generator=g).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LayerTimer:
    """Seconds spent in ``StaticDecoder.run_layer`` and ``run_chain`` (every decoder-layer
    call of a static step: the compiled graphs where compiled, one by one or chained), read
    per step by ``run``."""

    def __init__(self) -> None:
        from server.model.static_decode import StaticDecoder
        self.seconds = 0.0
        for name in ("run_layer", "run_chain"):
            setattr(StaticDecoder, name, self._timed(getattr(StaticDecoder, name)))

    def _timed(self, inner):
        def timed(decoder, *a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(decoder, *a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, device: torch.device,
        tag: str, layers: LayerTimer | None = None) -> dict:
    """Serve ``prompts`` together; time each decode step (every step after all prefills)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    toks: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    for rid, p in zip(toks, prompts):
        engine.add_request(EngineRequest(rid, p, sp))
    times: list[float] = []
    layer_times: list[float] = []
    decode_tokens = 0
    per_seq_step: list[int] = []          # tokens each running sequence got from a decode step
    while engine.has_unfinished():
        prefilling = any(not t for t in toks.values())
        _sync(device)
        if layers is not None:
            layers.seconds = 0.0
        t0 = time.perf_counter()
        outs = engine.step()
        engine.finish_step()
        _sync(device)
        dt = time.perf_counter() - t0
        for o in outs:
            if o.error:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            toks[o.request_id].extend(o.token_ids)
        if not prefilling and outs:
            times.append(dt)
            if layers is not None:
                layer_times.append(layers.seconds)
            n = sum(len(o.token_ids) for o in outs)
            decode_tokens += n
            per_seq_step += [len(o.token_ids) for o in outs if o.token_ids]
    total = sum(times)
    return {"tokens": toks, "steps": len(times), "step_ms": 1e3 * statistics.median(times) if times else 0.0,
            "max_over_median": max(times) / statistics.median(times) if times else None,
            "tok_s": decode_tokens / total if total else 0.0,
            "tok_per_step": statistics.fmean(per_seq_step) if per_seq_step else 0.0,
            "layers_ms": 1e3 * statistics.median(layer_times) if layer_times else None}


def prompt_seconds(engine: LLMEngine, prompt: list[int], device: torch.device, tag: str = "p") -> float:
    """Seconds of the engine step that prefills ``prompt`` alone (its first token
    included); the request is then served to its end, untimed."""
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(tag, prompt, sp))
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.step()
    engine.finish_step()
    _sync(device)
    dt = time.perf_counter() - t0
    for o in outs:
        if o.error:
            raise RuntimeError(f"request {o.request_id} failed: {o.error}")
    while engine.has_unfinished():
        engine.step()
        engine.finish_step()
    return dt


def _median_run(runs: list[dict]) -> dict:
    """Repetitions of one mode on the same prompts: their median timings (greedy, so the
    tokens are the same every time; the first repetition's are kept)."""
    def med(key):
        vals = [r[key] for r in runs if r[key] is not None]
        return statistics.median(vals) if vals else None
    return {**runs[0], "step_ms": med("step_ms"), "tok_s": med("tok_s"), "layers_ms": med("layers_ms"),
            "max_over_median": max((r["max_over_median"] for r in runs if r["max_over_median"]), default=None)}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=("big", "small"), default="big")
    ap.add_argument("--model", type=Path, default=None,
                    help="time this checkpoint folder instead (e.g. models/deepseek-v3-tiny-mtp); "
                         "its own MTP layer, no acceptance edit")
    ap.add_argument("--against", type=Path, default=None,
                    help="with --model: a second checkpoint (e.g. its int8 copy) timed MTP off "
                         "beside the first, alternating, as the row 'alt'")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                    help="default: the checkpoint's with --model, else bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--modes", default="off,k1,k2",
                    help="which of off,k1,k2 to time (off is required: the ratios are against it)")
    ap.add_argument("--compile", choices=("on", "off"), default="off",
                    help="EngineConfig.compile: torch.compile (Inductor) of the static decode step")
    ap.add_argument("--batch", default="1,16", help="batch sizes (comma separated)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--alpha", type=float, default=None,
                    help="make_high_acceptance's alpha (default 0.1 small, 0.02 big: with 12 layers "
                         "0.1 accepts ~40%% of k=1 drafts, 0.02 ~80%%, near DeepSeek-V3's reported rate)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default 1)")
    ap.add_argument("--reps", type=int, default=1,
                    help="time each batch this many times, the modes' order alternating; medians")
    ap.add_argument("--split", action="store_true",
                    help="CPU: time the decoder-layer calls inside each step apart from the rest")
    ap.add_argument("--json", type=Path,
                    help="write the report (JSON) here; a bare file name goes under docs/bench/")
    args = ap.parse_args(argv)
    names = args.modes.split(",")
    if "off" not in names or set(names) - {"off", "k1", "k2"}:
        ap.error("--modes: a comma-separated subset of off,k1,k2 that includes off")
    modes = tuple(m for m in MODES if m[0] in names)
    if args.split and args.device != "cpu":
        ap.error("--split times host calls, which an accelerator runs asynchronously: CPU only")

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    keep_freed_pages()           # as the daemon's engine process does (server/engine/child.py)
    if args.dtype is None and args.model is not None:
        import json
        stored = json.loads((args.model / "config.json").read_text()).get("torch_dtype")
        args.dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(stored)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    batches = [int(b) for b in args.batch.split(",")]
    if args.alpha is None:
        args.alpha = 0.02 if args.size == "big" else 0.1
    t_start = time.perf_counter()

    t0 = time.perf_counter()
    if args.model is not None:
        from server.model.loading import load_checkpoint
        model, _info = load_checkpoint(args.model, dtype=dtype, device=device)
        cfg = model.config
        args.size, args.alpha = f"checkpoint {args.model.name}", None
    else:
        cfg = big_config() if args.size == "big" else big_config(**SMALL)
        model = make_high_acceptance(build_model(cfg, device, dtype, args.seed), args.alpha)
    _sync(device)
    build_s = time.perf_counter() - t0
    params = num_parameters(model)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device_name(device),
            "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": dtype_name, "size": args.size,
            "compile": args.compile, "parameters": params, "max_tokens": args.max_tokens,
            "prompt_len": PROMPT_LEN, "alpha": args.alpha, "build_s": round(build_s, 2)}
    print(f"# engine_step {meta['date']}  device: {meta['device']}  torch {meta['torch']} "
          f"(cuda {meta['cuda']})", flush=True)
    print(f"# size {args.size}: {params / 1e9:.2f}B parameters ({params:,}), dtype {dtype_name}, "
          f"compile {args.compile}, built in {build_s:.1f}s; prompt {PROMPT_LEN}, "
          f"max_tokens {args.max_tokens}, greedy" + (f", alpha {args.alpha}" if args.alpha is not None else ""),
          flush=True)

    max_batch = max(batches)
    engines = {}
    models = {mode: model for mode, _ in modes}
    if args.against is not None:
        from server.model.loading import load_checkpoint
        models["alt"], _info = load_checkpoint(args.against, device=device)
        modes = modes + (("alt", 0),)
        print(f"# alt: {args.against.name}, MTP off", flush=True)
    for mode, k in modes:
        t0 = time.perf_counter()
        engines[mode] = make_engine(models[mode], k, args, device, max_batch)
        rt = engines[mode].runtime
        print(f"# engine {mode}: decode path {rt.decode_path}, KV blocks {rt.num_kv_blocks}, "
              f"built in {time.perf_counter() - t0:.1f}s"
              + (f" (compile {rt.compile_seconds:.1f}s)" if rt.compile_seconds else ""), flush=True)
        # Warm-up (kernels, allocator, any lazy compilation) with both batch shapes.
        for b in sorted(set(batches)):
            run(engines[mode], make_prompts(b, cfg.vocab_size, 999), min(8, args.max_tokens), device, "w")

    layers = LayerTimer() if args.split else None
    results: dict[int, dict[str, dict]] = {}
    for b in batches:
        prompts = make_prompts(b, cfg.vocab_size, args.seed + b)
        runs: dict[str, list[dict]] = {mode: [] for mode, _ in modes}
        for rep in range(args.reps):          # alternate the order so drift hits every mode
            for mode, _ in (modes if rep % 2 == 0 else modes[::-1]):
                runs[mode].append(run(engines[mode], prompts, args.max_tokens, device, "r", layers))
        results[b] = {mode: _median_run(r) for mode, r in runs.items()}

    # ---- table ----
    rows = []
    print()
    print(f"{'batch':>5} {'mode':>4} {'steps':>6} {'step ms':>9} {'tok/s':>9} {'tok/step':>9} "
          f"{'step/off':>9} {'tok/s/off':>10} {'max/med':>8}")
    for b in batches:
        off = results[b]["off"]
        for mode, k in modes:
            r = results[b][mode]
            step_ratio = r["step_ms"] / off["step_ms"] if off["step_ms"] else 0.0
            tps_ratio = r["tok_s"] / off["tok_s"] if off["tok_s"] else 0.0
            rows.append({"batch": b, "mode": mode, "k": k, "steps": r["steps"],
                         "step_ms": round(r["step_ms"], 3), "tok_s": round(r["tok_s"], 1),
                         "tok_per_step": round(r["tok_per_step"], 3),
                         "layers_ms": round(r["layers_ms"], 3) if r["layers_ms"] is not None else None,
                         "step_ratio_vs_off": round(step_ratio, 3), "tok_s_ratio_vs_off": round(tps_ratio, 3),
                         "max_over_median": round(r["max_over_median"], 2) if r["max_over_median"] else None})
            mm = f"{r['max_over_median']:.2f}" if r["max_over_median"] else "-"
            print(f"{b:>5} {mode:>4} {r['steps']:>6} {r['step_ms']:>9.2f} {r['tok_s']:>9.1f} "
                  f"{r['tok_per_step']:>9.2f} {step_ratio:>9.2f} {tps_ratio:>10.2f} {mm:>8}")
    print()
    summary = {}
    for b in batches:
        off = results[b]["off"]
        s = summary[b] = {}
        parts = []
        for mode, k in modes[1:]:
            r = results[b][mode]
            s[f"{mode}_step_over_off_step"] = r["step_ms"] / off["step_ms"]
            s[f"{mode}_tok_s_over_off"] = r["tok_s"] / off["tok_s"]
            s[f"{mode}_tok_per_step"] = r["tok_per_step"]
            parts.append(f"{'alt' if mode == 'alt' else f'k={k}'}: step / off step {s[f'{mode}_step_over_off_step']:.2f}, tokens/s / off "
                         f"{s[f'{mode}_tok_s_over_off']:.2f}, {r['tok_per_step']:.2f} tokens per step")
        line = f"# batch {b}: " + "; ".join(parts)
        if "k1" in results[b]:
            line += (f"; k=1 / off at acceptance a is at most (1 + a) / {s['k1_step_over_off_step']:.2f} "
                     f"({2 / s['k1_step_over_off_step']:.2f} at a = 1)")
        print(line)
    memory = None
    if args.model is not None:
        memory = {"bandwidth": harness.memory_bandwidth_gbps(torch.get_num_threads(), device=args.device),
                  "gemv_diagnostic": harness.gemv_rates_gbps(torch.get_num_threads(), device=args.device),
                  "batches": {}}
        bw, diag = memory["bandwidth"], memory["gemv_diagnostic"]
        gbps = bw["gbps"]
        print(f"# memory read bandwidth: {gbps:.2f} GB/s (a plain read of {bw['mib']} MiB, "
              f"{bw['threads']} thread(s), median of {len(bw['runs'])}: "
              + " ".join(f"{r:.1f}" for r in bw["runs"]) + ")")
        print(f"# kernel diagnostic (torch's products over {diag['weight_mib']} MiB, not the limit): "
              f"bf16 GEMV {diag['bf16']:.2f}, fp32 GEMV {diag['fp32']:.2f}, int8 _int_mm "
              f"{diag['int8'] or 0:.2f} GB/s")
        if dtype_name != ("bf16" if "bfloat16" in str(cfg.torch_dtype) else "fp32"):
            print(f"# (served as {dtype_name}, stored as {cfg.torch_dtype}: the bytes below are the stored dtype's)")
        for b in batches:
            memory["batches"][b] = {}
            for mode, k in modes:
                nbytes = harness.step_weight_bytes(args.against if mode == "alt" else args.model, b, k)
                r = results[b][mode]
                share = harness.bandwidth_share(nbytes, 1e3 / r["step_ms"], gbps) if r["step_ms"] else 0.0
                memory["batches"][b][mode] = {"step_bytes": nbytes, "share": share}
                for row in rows:
                    if row["batch"] == b and row["mode"] == mode:
                        row["step_bytes"], row["bandwidth_share"] = nbytes, round(share, 4)
                print(f"# batch {b} {mode}: a step reads {nbytes / 1e6:.0f} MB of weights; at "
                      f"{r['step_ms']:.1f} ms a step it streams {share * gbps:.1f} GB/s = {share:.0%} of the "
                      f"memory's read bandwidth" + ("" if k == 0 else
                      f" (bytes {nbytes / memory['batches'][b]['off']['step_bytes']:.2f}x off's)"))

    if layers is not None:
        print(f"{'batch':>5} {'mode':>4} {'step ms':>9} {'layers ms':>10} {'rest ms':>9} "
              f"{'layers/off':>11} {'rest/off':>9}")
        for b in batches:
            off = results[b]["off"]
            off_rest = off["step_ms"] - off["layers_ms"]
            for mode, _ in modes:
                r = results[b][mode]
                rest = r["step_ms"] - r["layers_ms"]
                print(f"{b:>5} {mode:>4} {r['step_ms']:>9.2f} {r['layers_ms']:>10.2f} {rest:>9.2f} "
                      f"{r['layers_ms'] / off['layers_ms']:>11.2f} {rest / off_rest:>9.2f}")
            if "k1" not in results[b]:
                continue
            k1 = results[b]["k1"]
            print(f"# batch {b}: with every part of a step but the layer calls free, k=1 / off "
                  f"would be at most {k1['tok_per_step'] * off['layers_ms'] / k1['layers_ms']:.2f} "
                  f"at this run's {k1['tok_per_step']:.2f} tokens per step")
        print()

    # ---- lossless ----
    mismatches = []
    spec_modes = tuple(m for m in modes[1:] if m[0] != "alt")   # alt: another checkpoint
    for b in batches:
        ref = results[b]["off"]["tokens"]
        for mode, _ in spec_modes:
            for rid, toks in results[b][mode]["tokens"].items():
                pos = first_difference(ref[rid], toks)
                if pos is not None:
                    mismatches.append({"batch": b, "mode": mode, "request": rid, "position": pos,
                                       "len_off": len(ref[rid]), "len_mode": len(toks)})
    same = " == ".join(["MTP off"] + [f"k={k}" for _, k in spec_modes])
    if mismatches:
        first = min(mismatches, key=lambda m: m["position"])
        print(f"lossless (greedy tokens {same}): MISMATCH in {len(mismatches)} "
              f"request(s); earliest at output position {first['position']} "
              f"(batch {first['batch']}, {first['mode']}, {first['request']})")
    else:
        print(f"lossless (greedy tokens {same}): OK")
    wall = time.perf_counter() - t_start
    print(f"# total {wall:.1f}s")

    harness.save_report({
        **meta, "machine": harness.machine(), "command": harness.command_line(),
        "wall_s": round(wall, 1), "rows": rows,
        "summary": {str(b): {k: round(v, 3) for k, v in s.items()} for b, s in summary.items()},
        "compile_s": {m: e.runtime.compile_seconds for m, e in engines.items()},
        "decode_path": {m: e.runtime.decode_path for m, e in engines.items()},
        "lossless": "OK" if not mismatches else "MISMATCH", "mismatches": mismatches,
        "memory": memory,
    }, args.json)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
