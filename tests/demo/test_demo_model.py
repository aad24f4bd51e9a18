"""The bundled demo model (models/deepseek-v3-tiny-mtp): layout, loader/transformers parity, MTP quality.

Why: the daemon serves this folder out of the box, so it must load with our loader and mean
the same thing to transformers' reference DeepseekV3 implementation, and its MTP layer must
actually predict the main model's tokens (otherwise speculative decoding gains nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from server.model.loading import load_checkpoint
from server.text.tokenizer import Tokenizer
from training import corpus, evaluate, render

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "deepseek-v3-tiny-mtp"

pytestmark = pytest.mark.demo

PROMPTS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Which city is the capital of Peru?"}],
]


@pytest.fixture(scope="module")
def one_thread():
    # Two threads on two shared cores stall at OpenMP barriers; one is faster here.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ours(one_thread):
    return load_checkpoint(MODEL_DIR, dtype=torch.float32)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(MODEL_DIR)


def test_folder_layout_and_size():
    names = {p.name for p in MODEL_DIR.iterdir()}
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "README.md"):
        assert f in names, f"{f} missing from {MODEL_DIR}"
    size = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert size <= 30 * 1024 * 1024, f"model folder is {size / 1e6:.1f} MB, limit 30 MB"
    tc = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert "<｜tool▁calls▁begin｜>" in tc["chat_template"] and "<think>" in tc["chat_template"]


def test_config_has_mla_moe_mtp(ours):
    raw = json.loads((MODEL_DIR / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v3" and raw["architectures"] == ["DeepseekV3ForCausalLM"]
    assert raw["q_lora_rank"] and raw["kv_lora_rank"]                     # MLA
    assert raw["n_routed_experts"] >= 4 and raw["n_shared_experts"] == 1  # MoE
    assert raw["first_k_dense_replace"] == 1
    assert raw["num_hidden_layers"] >= 8 and raw["num_nextn_predict_layers"] == 1
    model, info = ours
    assert info.has_mtp and info.num_mtp_layers == 1 and info.model_type == "deepseek_v3"
    n = raw["num_hidden_layers"]
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_a_proj.weight",
                 "mlp.gate.weight", "mlp.experts.3.down_proj.weight", "mlp.shared_experts.up_proj.weight"):
        assert f"model.layers.{n}.{part}" in keys, part
    assert "model.layers.0.mlp.gate_proj.weight" in keys           # first layer dense
    assert "model.layers.1.mlp.gate.weight" in keys                # then MoE


def test_logits_match_transformers(ours, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    model, _ = ours
    for messages in PROMPTS:
        ids = torch.tensor([tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))])
        with torch.no_grad():
            ref = hf(input_ids=ids).logits[0].float()
            got = model.compute_logits(model.forward_full(ids)[0])
        diff = (ref - got).abs().max().item()
        assert diff <= 1e-4, f"max |logit diff| {diff:.2e} on {messages[-1]['content']!r}"


def test_tokenizer_matches_transformers(tok):
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    text = hf_tok.apply_chat_template(PROMPTS[1], add_generation_prompt=True, tokenize=False)
    assert text == tok.apply_chat_template(PROMPTS[1], add_generation_prompt=True)
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)


@pytest.mark.slow                       # held-out generation
def test_mtp_acceptance_and_tool_call_on_heldout_prompts(ours, tok):
    """A few held-out prompts: the MTP layer must agree with the main model most of the time."""
    model, _ = ours
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    sets = corpus.eval_prompts(seed=4242, n_chat=2, n_tool=2, n_think=2)
    accepted = drafted = 0
    tool_ok = 0
    for kind, chats in sets.items():
        for chat in chats:
            assert corpus.is_heldout(chat.messages[0]["content"])
            prompt = tok.encode(render.render_eval_prompt(chat))
            gen = evaluate.greedy(model, prompt, eos, max_new=64)
            a, d = evaluate.mtp_matches(model, prompt, gen)
            accepted, drafted = accepted + a, drafted + d
            if kind == "tool":
                text = tok.decode(gen)
                tool_ok += int(f"<｜tool▁sep｜>{chat.expect_tool}\n```json\n" in text)
    assert drafted >= 30
    assert accepted / drafted >= 0.7, f"MTP acceptance {accepted}/{drafted}"
    assert tool_ok >= 1
