"""The int8 latent cache (kv_cache_dtype "int8"): smaller rows, the same model behaviour.

Sizes are checked against the arithmetic of the format; behaviour on the demo model:
teacher-forced top-1 agreement with the float cache over 50 held-out prompts x 32 decode
steps, and through the engine MTP stays lossless and prefix-cache hits stay exact.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.kv.cache import KVCacheSpec, num_blocks_for
from server.engine.protocol import EngineRequest, SamplingParams
from server.model.layers.latent_cache import Int8LatentCache, LatentCache
from server.model.loading import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "deepseek-v3-tiny-mtp"
needs_demo = pytest.mark.skipif(not any(DEMO.glob("*.safetensors")), reason="demo model weights not present")


def test_rows_round_trip_within_one_quantization_step():
    cache = Int8LatentCache(4, 4, latent_dim=8, rope_dim=3, dtype=torch.float32, device="cpu")
    rows = torch.randn(5, 11)
    slots = torch.tensor([0, 3, 6, 9, 15])
    cache.write(slots, rows)
    got = cache.read_slots(slots.tolist())
    step = rows[:, :8].abs().amax(-1, keepdim=True) / 127
    assert torch.all((got[:, :8] - rows[:, :8]).abs() <= step / 2 + 1e-7)
    assert torch.equal(got[:, 8:], rows[:, 8:])               # the RoPE part is stored as is
    tables = torch.tensor([[0, 1], [2, 3]])
    assert torch.allclose(cache.gather(tables, 8)[0, 3], got[1])


@pytest.mark.parametrize("latent,rope,dtype,floor", [(64, 16, torch.float32, 2.3),      # demo model
                                                     (512, 64, torch.bfloat16, 1.75)])   # DeepSeek-V3
def test_same_memory_buys_more_blocks(latent, rope, dtype, floor):
    f = KVCacheSpec(62, 16, latent + rope, dtype, rope_dim=rope)
    q = KVCacheSpec(62, 16, latent + rope, dtype, rope_dim=rope, int8_layers=frozenset(range(62)))
    nf = num_blocks_for(f, mem_size_gb=1.0, device="cpu", max_useful_blocks=10**9)
    nq = num_blocks_for(q, mem_size_gb=1.0, device="cpu", max_useful_blocks=10**9)
    assert nq / nf >= floor, (nf, nq)
    assert q.bytes_per_token(0) == latent + rope * torch.empty((), dtype=dtype).element_size() + 4


@pytest.fixture(scope="module")
def demo():
    from server.text.tokenizer import Tokenizer
    model, _ = load_checkpoint(DEMO)
    tok = Tokenizer.from_dir(DEMO)
    prompts = json.loads((ROOT / "benchmarks" / "prompts.json").read_text())["prompts"]
    ids = [tok.encode(tok.apply_chat_template(p, add_generation_prompt=True)) for p in prompts]
    return model, tok, (ids * 2)[:50]


@needs_demo
@pytest.mark.demo
def test_teacher_forced_agreement_with_the_float_cache(demo, driver_cls):
    model, _tok, prompts = demo
    n = len(prompts)
    agree = total = 0
    with torch.inference_mode():
        preds = {}
        for kind in ("float", "int8"):
            drv = driver_cls(model, num_blocks=n * 8, block_size=16)
            if kind == "int8":
                drv.caches = [Int8LatentCache(n * 8, 16, model.config.kv_lora_rank,
                                              model.config.qk_rope_head_dim, torch.float32, "cpu")
                              for _ in drv.caches]
            else:
                drv.caches = [LatentCache(c.zero_()) for c in drv.caches]
            seqs = list(range(n))
            meta = drv.meta(seqs, [0] * n, [len(p) for p in prompts])
            h = model.forward(torch.tensor([t for p in prompts for t in p]), meta, drv.caches)
            last = meta.query_start_loc[1:].long() - 1
            tok = model.compute_logits(h[last]).argmax(-1)
            if kind == "float":
                forced = [tok]
            out = [tok]
            for step in range(32):
                feed = forced[step] if kind == "int8" else out[-1]
                meta = drv.meta(seqs, [len(p) + step for p in prompts], [1] * n)
                tok = model.compute_logits(model.forward(feed, meta, drv.caches)).argmax(-1)
                out.append(tok)
                if kind == "float":
                    forced.append(tok)
            preds[kind] = torch.stack(out)
    agree = int((preds["float"] == preds["int8"]).sum())
    total = preds["float"].numel()
    print(f"int8 KV: teacher-forced top-1 agreement {agree / total:.3f} over {total} positions")
    assert agree / total >= 0.95


@needs_demo
@pytest.mark.demo
@pytest.mark.slow
def test_engine_int8_cache_mtp_lossless_and_prefix_hits_exact(demo):
    model, tok, prompts = demo
    shared = prompts[0] + prompts[1] + prompts[2]          # several full blocks of 16
    ps = [shared + p[-12:] for p in prompts[3:11]]

    def run(k: int, prefix: bool):
        cfg = EngineConfig(num_blocks=512, num_speculative_tokens=k, max_queue_delay_us=0,
                           kv_cache_dtype="int8", enable_prefix_cache=prefix, max_seq_len=1024)
        eng = LLMEngine(model, cfg, tok, eos_token_ids=set())
        assert eng.runtime.kv_cache_dtype == "int8"
        outs = {}
        for i, p in enumerate(ps):          # one at a time, so later prompts hit the prefix
            out = eng.generate([EngineRequest(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0))])
            outs[f"r{i}"] = [t for o in out[f"r{i}"] for t in o.token_ids]
        return outs, eng.stats()

    base, _ = run(0, False)
    mtp, _ = run(1, False)
    hits, st = run(1, True)
    assert mtp == base and hits == base
    assert st.prefix_cache_hits > 0


@needs_demo
@pytest.mark.demo
@pytest.mark.parametrize("k", [0, 2])
def test_an_int8_cache_takes_the_static_step_and_answers_as_the_varlen_path(demo, k):
    """Issue 60: an int8 KV cache no longer sends uniform decode/verify steps down the varlen
    path.  The static step writes and reads the int8 latent, scales and RoPE part as the
    cache does (latent_cache.int8_write / int8_gather): staggered greedy batches give the
    varlen path's tokens, with MTP too."""
    from tests.engine.helpers import run_staggered
    model, tok, prompts = demo

    def run(static: bool):
        cfg = EngineConfig(num_blocks=512, num_speculative_tokens=k, max_queue_delay_us=0,
                           kv_cache_dtype="int8", max_seq_len=1024, static_decode=static,
                           adaptive_speculation=False)
        eng = LLMEngine(model, cfg, tok, eos_token_ids=set())
        assert eng.runtime.decode_path == ("static" if static else "eager")
        reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0))
                for i, p in enumerate(prompts[:6])]
        return run_staggered(eng, reqs, every=2)

    assert run(True) == run(False)


@needs_demo
@pytest.mark.demo
def test_a_compiled_layer_on_an_int8_cache_writes_and_reads_it_as_the_plain_one(demo):
    """The graph of a decode window over an int8 cache's three tensors (what the compiled
    step runs): the same output and the same cache contents as the plain function."""
    from server.engine.worker import compile_step
    from server.model.static_decode import StaticDecoder
    model = demo[0]
    decoder = model.static_decoder
    old = decoder.kv_form
    decoder.kv_form = "int8"
    try:
        args = compile_step._example(model, 0, 2, True, 16, torch.device("cpu"), True)
    finally:
        decoder.kv_form = old
    cache = next(a for a in args if isinstance(a, tuple))
    g = torch.Generator().manual_seed(3)
    for t in cache:
        t.copy_(torch.randint(-100, 100, t.shape, generator=g).to(t.dtype) if t.dtype == torch.int8
                else torch.rand(t.shape, generator=g).to(t.dtype) * 0.01)
    x = next(a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2)
    x.copy_(torch.randn(x.shape, generator=g))
    fn = StaticDecoder.function(decoder.kind(0))
    plain_cache = tuple(t.clone() for t in cache)
    plain_args = tuple(plain_cache if a is cache else a for a in args)
    with torch.inference_mode():
        want = fn(*plain_args)
        got = torch.compile(fn, fullgraph=True, dynamic=False)(*args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(cache, plain_cache):
        assert torch.equal(a, b)
