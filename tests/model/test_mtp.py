"""The MTP layer against a deliberately naive reference built from the raw checkpoint tensors.

Reference (the DeepSeek-V3 report's MTP module): x_j = eh_proj([enorm(embed(t_{j+1})); hnorm(h_j)]),
one decoder block (MLA + MoE) over positions 0..j with plain per-token loops where that is
clearer, logits = shared_head.head(shared_head.norm(x)). h_j comes from transformers'
DeepseekV3 (final-norm hidden), so the main model is not trusted here either.
"""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from server.model.loading import load_checkpoint
from server.testing.tiny_checkpoint import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_pairs(x, positions, theta):
    """Rotate interleaved (x0, x1), (x2, x3) ... pairs as complex numbers, official-style."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq                         # [L, d/2]
    rot = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    return torch.view_as_real(xc * rot.view(shape)).flatten(-2).float()


def naive_block(w, p, cfg, x):
    """One DeepSeek-V3 decoder block over a single sequence x [L, H] at positions 0..L-1."""
    L, eps = x.shape[0], cfg["rms_norm_eps"]
    nh, dn, dr, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kvr = cfg["kv_lora_rank"]
    pos = torch.arange(L)
    hN = rms(x, w[p + "input_layernorm.weight"], eps)
    a = p + "self_attn."
    if cfg["q_lora_rank"] is None:
        q = hN @ w[a + "q_proj.weight"].T
    else:
        q = rms(hN @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], eps) @ w[a + "q_b_proj.weight"].T
    q = q.view(L, nh, dn + dr)
    kv = hN @ w[a + "kv_a_proj_with_mqa.weight"].T
    latent = rms(kv[:, :kvr], w[a + "kv_a_layernorm.weight"], eps)
    k_pe = rope_pairs(kv[:, kvr:], pos, cfg["rope_theta"])                 # [L, dr]
    q_pe = rope_pairs(q[..., dn:], pos, cfg["rope_theta"])                 # [L, nh, dr]
    kvb = (latent @ w[a + "kv_b_proj.weight"].T).view(L, nh, dn + dv)
    out = torch.zeros(L, nh, dv)
    scale = 1.0 / math.sqrt(dn + dr)
    for h in range(nh):
        for i in range(L):
            scores = torch.stack([
                (q[i, h, :dn] @ kvb[j, h, :dn] + q_pe[i, h] @ k_pe[j]) * scale for j in range(i + 1)
            ])
            out[i, h] = scores.softmax(0) @ kvb[: i + 1, h, dn:]
    x = x + out.reshape(L, nh * dv) @ w[a + "o_proj.weight"].T
    return x + naive_moe(w, p + "mlp.", cfg, rms(x, w[p + "post_attention_layernorm.weight"], eps))


def naive_moe(w, m, cfg, x):
    def expert(prefix, v):
        return (F.silu(v @ w[prefix + "gate_proj.weight"].T) * (v @ w[prefix + "up_proj.weight"].T)) \
            @ w[prefix + "down_proj.weight"].T

    E, G, k = cfg["n_routed_experts"], cfg["n_group"], cfg["num_experts_per_tok"]
    out = []
    for v in x:
        s = torch.sigmoid(w[m + "gate.weight"] @ v)
        choice = s + w[m + "gate.e_score_correction_bias"]
        groups = sorted(range(G), key=lambda g: -choice.view(G, -1)[g].topk(2).values.sum().item())
        allowed = [e for g in groups[: cfg["topk_group"]] for e in range(g * E // G, (g + 1) * E // G)]
        chosen = sorted(allowed, key=lambda e: -choice[e].item())[:k]
        total = sum(s[e] for e in chosen)
        y = expert(m + "shared_experts.", v)
        for e in chosen:
            y = y + (s[e] / total) * cfg["routed_scaling_factor"] * expert(f"{m}experts.{e}.", v)
        out.append(y)
    return torch.stack(out)


def naive_mtp(w, cfg, tokens, hidden):
    """tokens t_0..t_{L}, hidden h_0..h_{L-1} -> (pre-norm x [L, H], logits [L, V])."""
    p = f"model.layers.{cfg['num_hidden_layers']}."
    eps = cfg["rms_norm_eps"]
    emb = w["model.embed_tokens.weight"][tokens[1:]]
    x = torch.cat([rms(emb, w[p + "enorm.weight"], eps), rms(hidden, w[p + "hnorm.weight"], eps)], -1)
    x = naive_block(w, p, cfg, x @ w[p + "eh_proj.weight"].T)
    logits = rms(x, w[p + "shared_head.norm.weight"], eps) @ w[p + "shared_head.head.weight"].T
    return x, logits


def test_mtp_layer_matches_naive_reference(tmp_path, driver_cls):
    path = make_tiny_checkpoint(tmp_path, seed=4, yarn=False, q_lora_rank=32)
    cfg = json.loads((path / "config.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    model, info = load_checkpoint(path, dtype=torch.float32)
    assert info.has_mtp and info.num_mtp_layers == 1 and model.num_kv_layers == 3
    logging.getLogger("transformers").setLevel(logging.ERROR)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(3, 512, (n,), generator=g) for n in (27, 12)]
    with torch.no_grad():
        hidden = [hf.model(s[None]).last_hidden_state[0] for s in seqs]
        refs = [naive_mtp(w, cfg, s, h[:-1]) for s, h in zip(seqs, hidden)]  # positions 0..L-2

        # Paged: a prefill chunk (decompressed: 18 > 16 tokens), then small absorbed steps.
        driver = driver_cls(model, block_size=4, seed=9)
        schedule = [(18, 5), (1, 1), (2, 3), (1, 0), (3, 2), (1, 0)]
        done = [0, 0]
        got: list[list[torch.Tensor]] = [[], []]
        for step in schedule:
            ids = [s for s in range(2) if step[s]]
            meta = driver.meta(ids, [done[s] for s in ids], [step[s] for s in ids])
            # input_ids[i] = token at position + 1, prev_hidden[i] = main hidden at position.
            tok = torch.cat([seqs[s][done[s] + 1: done[s] + 1 + step[s]] for s in ids])
            prev = torch.cat([hidden[s][done[s]: done[s] + step[s]] for s in ids])
            h_mtp = model.mtp_forward(tok, prev, meta, driver.caches, layer=0)
            for s, part in zip(ids, h_mtp.split([step[s] for s in ids])):
                got[s].append(part)
                done[s] += step[s]
        for s in range(2):
            x_ref, logits_ref = refs[s]
            x = torch.cat(got[s])
            n = x.shape[0]
            assert (x - x_ref[:n]).abs().max().item() < TOL, f"seq {s}: MTP hidden differs"
            logits = model.mtp_compute_logits(x)
            assert (logits - logits_ref[:n]).abs().max().item() < TOL, f"seq {s}: MTP logits differ"
            assert logits.std() > 1.0

        # Main-layer caches were never touched by the MTP steps (still NaN).
        assert torch.isnan(driver.caches[0]).all() and torch.isnan(driver.caches[1]).all()

        # Cache-free path: same numbers.
        s = seqs[0]
        x_full = model.mtp_forward_full(s[None, 1:], hidden[0][None, :-1])[0]
        assert (x_full - refs[0][0]).abs().max().item() < TOL
