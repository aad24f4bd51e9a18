"""Quantized checkpoints: the demo model through training/quantize.py in msModelSlim's W8A8
mixed and W4A8 layouts and in compressed-tensors int8, loaded by our loader.

Checked against the float model on held-out prompts (teacher-forced top-1 agreement over
50 prompts x 32 generated tokens), with int8 weights resident, MTP lossless on the
quantized model, acceptance close to the float model's, and every malformed checkpoint
refused by tensor name (also by the daemon, before it binds a port).
"""
from __future__ import annotations

import functools
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import server.model.quant.int8 as int8
from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams
from server.model.loading import CheckpointError, load_checkpoint
from server.model.quant.int4 import pack_int4_rows, unpack_int4_rows
from server.model.layers.linear import Linear
from server.model.quant.linear import QuantLinear

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "deepseek-v3-tiny-mtp"
pytestmark = [pytest.mark.demo, pytest.mark.skipif(not any(DEMO.glob("*.safetensors")),
                                                   reason="demo model weights not present")]
WEIGHTS = "quant_model_weights.safetensors"


# ``quantized`` (tests/conftest.py): the demo model in each int8 format, once per session.


@functools.lru_cache(maxsize=None)
def heldout(num_prompts: int = 50, new_tokens: int = 32) -> tuple[list[list[int]], list[list[int]]]:
    """Held-out prompts (the demo model's evaluation split) and the float model's greedy
    continuations of them."""
    from training import corpus, render
    from training.spec import TrainSettings
    from server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(DEMO)
    sets = corpus.eval_prompts(TrainSettings().eval_seed + 1, n_chat=20, n_tool=15, n_think=15)
    prompts = [tok.encode(render.render_eval_prompt(c)) for cs in sets.values() for c in cs]
    prompts = prompts[:num_prompts]
    model, _ = load_checkpoint(DEMO)
    cfg = EngineConfig(block_size=16, num_blocks=1024, max_queue_delay_us=0, max_batch_size=16,
                       max_seq_len=1024)
    eng = LLMEngine(model, cfg, tok, eos_token_ids=set())
    reqs = [EngineRequest(f"h{i}", p, SamplingParams(max_tokens=new_tokens, temperature=0))
            for i, p in enumerate(prompts)]
    outs = eng.generate(reqs)
    return prompts, [[t for o in outs[r.request_id] for t in o.token_ids] for r in reqs]


def agreement(model) -> float:
    """Teacher-forced: share of generated positions where ``model``'s argmax equals the
    float model's token."""
    prompts, conts = heldout()
    hit = total = 0
    with torch.inference_mode():
        for p, c in zip(prompts, conts):
            ids = torch.tensor([p + c])
            pred = model.compute_logits(model.forward_full(ids)[0]).argmax(-1)
            got = pred[len(p) - 1:len(p) - 1 + len(c)]
            hit += int((got == torch.tensor(c)).sum())
            total += len(c)
    return hit / total


def memory(model) -> int:
    params = {p.data_ptr(): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def test_int4_packing_round_trips():
    w = torch.randint(-8, 8, (6, 5), dtype=torch.int8)
    packed = pack_int4_rows(w)
    assert packed.shape == (3, 5) and torch.equal(unpack_int4_rows(packed), w)
    # low nibble = row 2j, high nibble = row 2j+1 (msModelSlim)
    assert int(packed[0, 0]) & 0xF == int(w[0, 0]) & 0xF
    assert (int(packed[0, 0]) >> 4) & 0xF == int(w[1, 0]) & 0xF


@pytest.mark.slow                       # held-out agreement: 50 prompts x 32 tokens
def test_w8a8_mixed_agrees_with_float_and_stays_int8(quantized):
    q, info = load_checkpoint(quantized["w8a8"])
    assert info.quantization.startswith("msmodelslim") and "32 W8A8" in info.quantization
    layers = [m for m in q.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 160 and all(m.weight.dtype == torch.int8 for m in layers)
    assert {m.scheme for m in layers} == {"w8a8_static", "w8a8_dynamic"}
    # what the recipe keeps float stayed float
    assert type(q.lm_head) is Linear and q.lm_head.weight.dtype == torch.float32
    assert q.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float32
    assert q.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ref, _ = load_checkpoint(DEMO)
    ratio = memory(q) / memory(ref)
    a = agreement(q)
    print(f"W8A8 mixed: agreement {a:.3f}, memory {ratio:.3f}x float32")
    assert a >= 0.95
    assert ratio <= 0.42          # embeddings + lm_head (float by the recipe) are 14% of this model


@pytest.mark.slow                       # held-out agreement: 50 prompts x 32 tokens
@pytest.mark.parametrize("name,floor", [("w4a8", 0.93), ("ct", 0.95), ("ct_heads", 0.95)])
def test_w4a8_and_compressed_tensors_agree(quantized, name, floor):
    q, info = load_checkpoint(quantized[name])
    a = agreement(q)
    print(f"{name}: {info.quantization}: agreement {a:.3f}")
    assert a >= floor


def test_int8_vocabulary_heads_load_as_int8_and_keep_mtp_lossless(quantized):
    """compressed-tensors with the heads not in ``ignore`` (``--quant-heads``, as llama.cpp's
    q8_0 quantizes its output tensor): lm_head and the MTP layer's shared_head.head load as
    int8 layers of the dynamic scheme, the MTP head still the main one held once, and greedy
    tokens with MTP k=1 equal MTP off's."""
    q, info = load_checkpoint(quantized["ct_heads"])
    mtp_head = q.model.layers[q.config.num_hidden_layers].shared_head.head
    for head in (q.lm_head, mtp_head):
        assert isinstance(head, QuantLinear) and head.weight.dtype == torch.int8
        assert head.scheme == "w8a8_dynamic"
    assert mtp_head.weight is q.lm_head.weight
    f, _ = load_checkpoint(quantized["ct"])
    assert type(f.lm_head) is Linear and f.lm_head.weight.is_floating_point()
    assert memory(q) < memory(f) - f.lm_head.weight.numel() * 2      # a byte a weight, not four
    prompts, _ = heldout()

    def run(k):
        cfg = EngineConfig(block_size=16, num_blocks=256, num_speculative_tokens=k, max_queue_delay_us=0,
                           max_batch_size=8, max_seq_len=512, adaptive_speculation=False)
        eng = LLMEngine(q, cfg, eos_token_ids=set())
        outs = eng.generate([EngineRequest(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0))
                             for i, p in enumerate(prompts[:6])])
        return {r: [t for o in v for t in o.token_ids] for r, v in outs.items()}

    assert run(1) == run(0)


def test_int8_projections_over_one_input_are_one_product_with_the_same_numbers(quantized):
    """quant/linear.stacked_int8: on a model whose linears are all W8A8_DYNAMIC, q_a with
    kv_a and each dense MLP's or shared expert's gate with up become one int8 weight (each
    layer's weight and scales views of its rows; routed experts keep their MoE's stacks),
    and the logits are the unstacked model's bit for bit; stacking again copies nothing."""
    stacked, _ = load_checkpoint(quantized["ct"])
    plain, _ = load_checkpoint(quantized["ct"])
    stacked.stack_projections()
    attn = stacked.model.layers[0].self_attn
    assert attn.q_kv_a is None and attn.q_kv_a_int8.dtype == torch.int8
    assert attn.q_a_proj.weight.data_ptr() == attn.q_kv_a_int8.data_ptr()
    assert attn.kv_a_proj_with_mqa.weight_scale.data_ptr() == \
        attn.q_kv_a_scale[attn.q_a_proj.out_features:].data_ptr()
    mlps = [m for m in stacked.modules() if type(m).__name__ == "MLP"]
    routed = [m for m in mlps if m.routed_expert]
    assert routed and all(m.gate_up_int8 is None for m in routed)
    shared = [m for m in mlps if not m.routed_expert]
    assert shared and all(m.gate_up_int8 is not None for m in shared)
    before = [(m.gate_up_int8.data_ptr(), m.gate_up_scale.data_ptr()) for m in shared]
    stacked.stack_projections()
    assert [(m.gate_up_int8.data_ptr(), m.gate_up_scale.data_ptr()) for m in shared] == before
    prompts, conts = heldout()
    ids = torch.tensor([prompts[0] + conts[0]])
    with torch.inference_mode():
        a, b = (m.compute_logits(m.forward_full(ids)[0]) for m in (stacked, plain))
    assert torch.equal(a, b)


def test_int_mm_backend_computes_the_same_integers(quantized, monkeypatch):
    calls = []
    real = int8.int_mm
    monkeypatch.setattr(int8, "int_mm", lambda a, b: calls.append(1) or real(a, b))
    prompts, conts = heldout()
    ids = torch.tensor([prompts[0] + conts[0]])
    with torch.inference_mode():
        outs = [m.compute_logits(m.forward_full(ids)[0])
                for m in (load_checkpoint(quantized["w8a8"], int8_backend=b)[0] for b in ("float", "int_mm"))]
    assert calls, "the int_mm backend never ran torch._int_mm"
    assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["w8a8", "w4a8", "ct"])
def test_gathered_int8_experts_equal_the_routed_ones(quantized, name, monkeypatch):
    """The gathered MoE reads each token's top-k int8 experts by index (one graph, no host
    read of the counts) and computes the routed per-expert QuantLinears' numbers: the
    integer sums are the same, only the order of the final float32 sum over k differs.
    Compiled, too; the experts' own tensors become views of the stacks (nothing held twice),
    and a first expert replaced after stacking is seen (the stacks are rebuilt)."""
    from server.model.static_decode import gathered_moe
    model = load_checkpoint(quantized[name])[0].eval()
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate"))
    assert moe.can_gather and isinstance(moe.experts[0].down_proj, QuantLinear)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(t, model.config.hidden_size, generator=g) for t in (1, 3, 12)]
    with torch.inference_mode():
        per_module = [moe(x) for x in xs]           # one QuantLinear per projection
        stacks = moe.expert_stacks()
        # Routed with the stacks: gate and up as one int8 product, the same bits.
        from server.model.layers import experts
        fused, real = [], experts.int8_expert
        monkeypatch.setattr(experts, "int8_expert", lambda *a: fused.append(1) or real(*a))
        assert all(torch.equal(moe(x), want) for x, want in zip(xs, per_module))
        assert fused
        assert [t.dtype for t in stacks] == [torch.int8, torch.float32] * 2
        e = moe.experts[1]
        assert e.up_proj.weight_scale.data_ptr() == stacks[1][1, e.gate_proj.out_features:].data_ptr()
        assert e.down_proj.weight.data_ptr() == stacks[2][1].data_ptr()
        compiled = torch.compile(gathered_moe, fullgraph=True, dynamic=False)
        for x in xs[:2]:
            t = x.shape[0]
            routed = moe(x)
            torch.testing.assert_close(gathered_moe(moe, x, *stacks), routed, rtol=1e-5, atol=1e-6)
            if t == 1:
                torch.testing.assert_close(compiled(moe, x, *stacks), routed, rtol=1e-4, atol=1e-5)
    with torch.inference_mode(False), torch.no_grad():
        moe.experts[0].gate_proj.weight = nn.Parameter(torch.zeros_like(e.gate_proj.weight),
                                                       requires_grad=False)
    with torch.inference_mode():
        fresh = moe.expert_stacks()
        assert fresh[0][0, :e.gate_proj.out_features].abs().sum() == 0
        assert fresh[0].data_ptr() != stacks[0].data_ptr()


def test_a_compile_child_traces_the_int8_layers_the_serving_model_has(quantized):
    """A background compile child builds an empty model from the config: without the int8
    layers it traced float ones (and failed setting int8 dtypes on them), so every int8
    checkpoint's first start compiled in the serving process instead."""
    from server.engine.worker.compile_child import empty_model, int8_layers, tensor_dtypes
    model = load_checkpoint(quantized["w8a8"])[0]
    layers = int8_layers(model)
    assert len(layers) > 10 and {m["scheme"] for m in layers.values()} == {"w8a8_static", "w8a8_dynamic"}
    empty = empty_model(model.config, tensor_dtypes(model), torch.device("cpu"), layers)
    serving, traced = tensor_dtypes(model), tensor_dtypes(empty)
    assert {n: d for n, d in serving.items() if n in traced} == {n: d for n, d in traced.items() if n in serving}
    assert sum(d == torch.int8 for d in traced.values()) == sum(d == torch.int8 for d in serving.values())
    assert int8_layers(empty) == layers


TIE = 0.02     # logits this close are a near-tie for the lossless check below


@pytest.mark.slow
def test_mtp_is_lossless_on_the_quantized_model_and_accepts_like_float(quantized):
    from server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(DEMO)
    prompts, _ = heldout()

    def run(path, k):
        model, _ = load_checkpoint(path)
        cfg = EngineConfig(block_size=16, num_blocks=1024, num_speculative_tokens=k, max_queue_delay_us=0,
                           max_batch_size=16, max_seq_len=1024, adaptive_speculation=False)
        eng = LLMEngine(model, cfg, tok, eos_token_ids=set())
        outs = eng.generate([EngineRequest(f"r{i}", p, SamplingParams(max_tokens=48, temperature=0))
                             for i, p in enumerate(prompts)])
        return {r: [t for o in v for t in o.token_ids] for r, v in outs.items()}, eng.stats()

    off, _ = run(quantized["w8a8"], 0)
    on, st_q = run(quantized["w8a8"], 1)
    # Float kernels are not batch-invariant (a linear over 2 rows differs from 1 row in the last
    # bit), and the static int8 quantization of activations can turn that bit into one rounding
    # step: a verify window may then pick the other token of a near-tie. Lossless here means:
    # every divergence starts at a tie of the cache-free forward (the two tokens are its top two,
    # within TIE), and there are few of them.
    model, _ = load_checkpoint(quantized["w8a8"])
    ties = []
    for rid in off:
        a, b = off[rid], on[rid]
        if a == b:
            continue
        j = next(x for x in range(min(len(a), len(b))) if a[x] != b[x])
        with torch.inference_mode():
            logits = model.compute_logits(model.forward_full(torch.tensor([prompts[int(rid[1:])] + a[:j]]))[0, -1])
        top = logits.topk(2)
        ties.append((rid, j, top.indices.tolist(), float(top.values[0] - top.values[1])))
        assert sorted(top.indices.tolist()) == sorted([a[j], b[j]]) and ties[-1][3] < TIE, ties[-1]
    assert len(ties) <= 2, ties
    _, st_f = run(DEMO, 1)
    print(f"acceptance: float {st_f.acceptance_rate:.3f}, W8A8 mixed {st_q.acceptance_rate:.3f}")
    assert abs(st_q.acceptance_rate - st_f.acceptance_rate) <= 0.03


def test_fa3_checkpoint_gets_an_int8_latent_cache(quantized, driver_cls):
    from server.engine.kv.cache import KVCacheSpec, allocate_kv_caches, num_blocks_for
    q, info = load_checkpoint(quantized["fa3"])
    assert "FA3 int8 KV on 7 layer(s)" in info.quantization
    assert q.kv_cache_int8_layers == frozenset(range(1, 8))      # not layer 0, not the MTP layer
    cfg = EngineConfig(num_blocks=64, num_speculative_tokens=1)
    assert LLMEngine(q, cfg, eos_token_ids=set()).runtime.kv_cache_dtype == "int8 on 7 of 9 layers"
    spec = KVCacheSpec(q.num_kv_layers, 16, q.kv_cache_dim, torch.float32,
                       rope_dim=q.config.qk_rope_head_dim, int8_layers=q.kv_cache_int8_layers)
    plain = KVCacheSpec(q.num_kv_layers, 16, q.kv_cache_dim, torch.float32)
    more = num_blocks_for(spec, mem_size_gb=0.5, device="cpu", max_useful_blocks=10**9) / \
        num_blocks_for(plain, mem_size_gb=0.5, device="cpu", max_useful_blocks=10**9)
    assert more >= 1.8             # 9 x 320 bytes per token -> 7 x 132 + 2 x 320: 1.84x
    # teacher-forced through the paged path: the FA3 model's int8 caches vs the float model
    ref, _ = load_checkpoint(DEMO)
    prompts, conts = heldout()
    preds = []
    with torch.inference_mode():
        for model, sp in ((ref, plain), (q, spec)):
            blocks = sum(-(-(len(p) + 32) // 16) for p in prompts)
            drv = driver_cls(model, num_blocks=blocks, block_size=16)
            drv.caches = allocate_kv_caches(sp, blocks, "cpu")
            seqs = list(range(len(prompts)))
            meta = drv.meta(seqs, [0] * len(seqs), [len(p) for p in prompts])
            h = model.forward(torch.tensor([t for p in prompts for t in p]), meta, drv.caches)
            out = [model.compute_logits(h[meta.query_start_loc[1:].long() - 1]).argmax(-1)]
            for step in range(31):
                meta = drv.meta(seqs, [len(p) + step for p in prompts], [1] * len(seqs))
                feed = torch.tensor([c[step] for c in conts])
                out.append(model.compute_logits(model.forward(feed, meta, drv.caches)).argmax(-1))
            preds.append(torch.stack(out))
    agree = float((preds[0] == preds[1]).float().mean())
    print(f"W8A8 + FA3 int8 KV: teacher-forced agreement {agree:.3f}, {more:.2f}x the blocks")
    assert agree >= 0.95


# ---- refusals ------------------------------------------------------------------------
def _copy_without(src: Path, dst: Path, drop: str) -> Path:
    shutil.copytree(src, dst)
    with safe_open(str(src / WEIGHTS), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != drop}
    save_file(tensors, str(dst / WEIGHTS))
    return dst


def _edit_description(path: Path, **changes) -> None:
    d = json.loads((path / "quant_model_description.json").read_text())
    d.update(changes)
    (path / "quant_model_description.json").write_text(json.dumps(d))


def test_malformed_checkpoints_are_refused_by_tensor_name(quantized, tmp_path):
    src = quantized["w8a8"]
    scale = "model.layers.2.mlp.experts.1.down_proj.weight_scale"
    bad = _copy_without(src, tmp_path / "noscale", scale)
    with pytest.raises(CheckpointError, match=f"tensor {scale} is missing"):
        load_checkpoint(bad)
    weird = _copy_without(src, tmp_path / "unknown", "")
    _edit_description(weird, **{"model.layers.3.mlp.shared_experts.up_proj.weight": "W3A7"})
    with pytest.raises(CheckpointError, match=r"model.layers.3.mlp.shared_experts.up_proj.weight.*'W3A7'"):
        load_checkpoint(weird)
    fa3 = _copy_without(src, tmp_path / "fa3", "")
    _edit_description(fa3, fa_quant_type="FAKQuant")
    with pytest.raises(CheckpointError, match="no layer has self_attn.fa_k.scale"):
        load_checkpoint(fa3)
    fa_scale = "model.layers.3.self_attn.fa_k.scale"
    fa_missing = _copy_without(quantized["fa3"], tmp_path / "fa3-missing", fa_scale)
    with pytest.raises(CheckpointError, match=f"tensor {fa_scale} is missing"):
        load_checkpoint(fa_missing)
    silent = _copy_without(src, tmp_path / "nodesc", "")
    (silent / "quant_model_description.json").unlink()
    cfg = json.loads((silent / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no quant_model_description"):
        load_checkpoint(silent)
    for key in ("quantize", "mla_quantize", "mtp_quantize"):
        cfg.pop(key, None)
    (silent / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="torch.int8, but nothing describes it as quantized"):
        load_checkpoint(silent)
    ct = shutil.copytree(quantized["ct"], tmp_path / "ct-tensor")
    cfg = json.loads((ct / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (ct / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="strategy"):
        load_checkpoint(ct)


@pytest.mark.slow
def test_daemon_refuses_a_missing_scale_before_binding(quantized, tmp_path):
    from server.testing.daemon import make_config
    scale = "model.layers.4.self_attn.o_proj.deq_scale"
    bad = _copy_without(quantized["w8a8"], tmp_path / "bad", scale)
    cfg = make_config(tmp_path, bad)
    port = json.loads(cfg.read_text())["ServerConfig"]["port"]
    with socket.socket() as taken:
        # The business port is held: a daemon that bound ports before loading would fail
        # on the port; this one must fail on the tensor first.
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = subprocess.run([sys.executable, "-m", "server", "--config-file", str(cfg)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0 and scale in out and "is missing" in out, out[-2000:]
    assert str(port) not in out and "Daemon start success" not in out


@pytest.mark.slow
def test_int8_checkpoint_takes_the_static_step_with_the_same_tokens(quantized, monkeypatch):
    """An int8 checkpoint's decode runs the static step (int8 layers as modules inside it,
    int8 experts routed) with the varlen path's tokens; the MTP layer, quantized otherwise
    than the main layers, is a kind of its own, so it never shares their compiled graph
    (compiling is checked with the float model in tests/engine/test_compiled_step.py)."""
    import server.engine.worker.worker as worker_module
    from server.engine.protocol import SamplingParams
    from tests.engine.helpers import make_engine, prompts, requests, run_tokens
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    ps = prompts(4, seed=1, vocab=1000)
    model = load_checkpoint(quantized["w8a8"])[0].eval()
    outs = {}
    for k in (0, 1):
        eng = make_engine(model, k, adaptive_speculation=False)
        assert eng.runtime.decode_path == "static"
        outs["static", k] = run_tokens(eng, requests(ps, greedy))
    dec = model.static_decoder
    n = model.config.num_hidden_layers
    assert dec.kind(n) not in {dec.kind(i) for i in range(n)}, [dec.kind(i) for i in range(n + 1)]
    monkeypatch.setattr(worker_module, "supports_static_decode", lambda *a: False)
    for k in (0, 1):
        eng = make_engine(model, k, adaptive_speculation=False)
        assert eng.runtime.decode_path == "eager"
        outs["varlen", k] = run_tokens(eng, requests(ps, greedy))
    assert all(out == outs["varlen", 0] for out in outs.values())
