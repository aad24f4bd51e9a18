"""Routing variants against a per-token naive router, sparse expert execution, and config parsing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.model.config import DeepseekConfig, UnsupportedConfigError
from server.model.layers.moe import MoE
from server.testing.tiny_checkpoint import tiny_config


def _cfg(**kw) -> DeepseekConfig:
    return DeepseekConfig.from_hf(tiny_config(**kw))


def naive_route(gate_w, bias, cfg: DeepseekConfig, v):
    """One token: list of (expert, weight), written straight from the DeepSeek remote code."""
    logits = gate_w @ v
    s = logits.softmax(0) if cfg.scoring_func == "softmax" else logits.sigmoid()
    choice = s + bias if cfg.topk_method == "noaux_tc" else s
    E, G = cfg.n_routed_experts, cfg.n_group
    allowed = list(range(E))
    if cfg.topk_method != "greedy":
        per = E // G
        def group_score(g):
            vals = choice[g * per:(g + 1) * per]
            return vals.topk(2).values.sum() if cfg.topk_method == "noaux_tc" else vals.max()
        groups = sorted(range(G), key=lambda g: -float(group_score(g)))[: cfg.topk_group]
        allowed = [e for g in groups for e in range(g * per, (g + 1) * per)]
    chosen = sorted(allowed, key=lambda e: -float(choice[e]))[: cfg.num_experts_per_tok]
    w = [float(s[e]) for e in chosen]
    if cfg.norm_topk_prob and len(chosen) > 1:
        total = sum(w)
        w = [x / total for x in w]
        if cfg.model_type == "deepseek_v3":
            w = [x * cfg.routed_scaling_factor for x in w]
    else:
        w = [x * cfg.routed_scaling_factor for x in w]
    return list(zip(chosen, w))


VARIANTS = {
    "v3_noaux_tc": dict(),
    "v3_noaux_tc_4_groups": dict(n_group=4, topk_group=2, n_routed_experts=16, num_experts_per_tok=3),
    "v2_greedy_softmax": dict(model_type="deepseek_v2", topk_method="greedy", scoring_func="softmax",
                              norm_topk_prob=False, routed_scaling_factor=16.0, n_group=1, topk_group=1),
    "v2_group_limited_norm": dict(model_type="deepseek_v2", topk_method="group_limited_greedy",
                                  scoring_func="softmax", norm_topk_prob=True, n_group=4, topk_group=2,
                                  n_routed_experts=16),
    "v3_softmax_no_norm": dict(scoring_func="softmax", norm_topk_prob=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_matches_naive_per_token_routing(variant):
    cfg = _cfg(**VARIANTS[variant])
    torch.manual_seed(0)
    moe = MoE(cfg)
    for name, p in moe.named_parameters():
        torch.nn.init.normal_(p, std=0.3 if "gate.weight" in name else (0.05 if "bias" in name else 0.15))
    x = torch.randn(40, cfg.hidden_size)
    bias = moe.gate.e_score_correction_bias
    calls = {}
    hooks = [expert.register_forward_hook(lambda m, inp, out, e=e: calls.__setitem__(e, calls.get(e, 0)
                                                                                     + inp[0].shape[0]))
             for e, expert in enumerate(moe.experts)]
    with torch.no_grad():
        got = moe(x)
        for h in hooks:
            h.remove()
        want, used = [], {}
        for v in x:
            y = moe.shared_experts(v)
            for e, w in naive_route(moe.gate.weight, bias if bias is not None else 0.0, cfg, v):
                y = y + w * moe.experts[e](v)
                used[e] = used.get(e, 0) + 1
            want.append(y)
    want = torch.stack(want)
    assert (got - want).abs().max() < 1e-6 * want.abs().max()
    assert calls == used                       # each expert ran exactly on the tokens routed to it
    assert len(used) > 2                       # routing is not collapsed onto a couple of experts


def test_dense_and_moe_layer_placement():
    cfg = _cfg(num_hidden_layers=5, first_k_dense_replace=1, moe_layer_freq=2)
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]
    assert not _cfg(n_routed_experts=None).is_moe_layer(3)


def test_config_parsing_and_refusals():
    cfg = _cfg(yarn=True)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 4.0 and cfg.rope_scaling.mscale_all_dim == 0.8
    # softmax scale carries the YaRN mscale^2 correction.
    m = 0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert cfg.softmax_scale == pytest.approx(24 ** -0.5 * m * m)
    assert _cfg().q_lora_rank == 32 and _cfg(q_lora_rank=None).q_lora_rank is None
    assert _cfg().kv_cache_dim == 40
    newer = tiny_config()
    newer.pop("rope_theta")
    newer["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5e4, "factor": 2.0,
                                "original_max_position_embeddings": 128}
    c = DeepseekConfig.from_hf(newer)
    assert c.rope_theta == 5e4 and c.rope_scaling.factor == 2.0
    v2 = tiny_config(model_type="deepseek_v2")
    for k in ("topk_method", "scoring_func", "norm_topk_prob"):
        v2.pop(k)
    c2 = DeepseekConfig.from_hf(v2)
    assert (c2.topk_method, c2.scoring_func, c2.norm_topk_prob) == ("greedy", "softmax", False)
    with pytest.raises(UnsupportedConfigError, match="'topk_method' is 'best'; allowed: greedy"):
        _cfg(topk_method="best")
    with pytest.raises(UnsupportedConfigError, match="model_type 'mixtral'"):
        _cfg(model_type="mixtral")
    with pytest.raises(UnsupportedConfigError, match="'hidden_size' is required"):
        _cfg(hidden_size=None)
    with pytest.raises(UnsupportedConfigError, match="rope_scaling type 'dynamic'"):
        _cfg(rope_scaling={"type": "dynamic", "factor": 2.0})


def test_bfloat16_paged_decode_tracks_float32(tmp_path, driver_cls):
    from server.model.loading import load_checkpoint
    from server.testing.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, seed=8, yarn=True, dtype="bfloat16")
    m16, info = load_checkpoint(path)
    m32, _ = load_checkpoint(path, dtype=torch.float32)
    assert info.dtype == torch.bfloat16
    ids = torch.randint(3, 512, (11,), generator=torch.Generator().manual_seed(1))
    out = {}
    with torch.no_grad():
        for name, m in (("bf16", m16), ("fp32", m32)):
            d = driver_cls(m, block_size=4)
            d.caches = [c.to(m.lm_head.weight.dtype) for c in d.caches]
            h = m.forward(ids[:10], d.meta([0], [0], [10]), d.caches)
            h2 = m.forward(ids[10:], d.meta([0], [10], [1]), d.caches)
            out[name] = m.compute_logits(torch.cat([h, h2]))
    assert out["bf16"].dtype == torch.float32
    assert F.cosine_similarity(out["bf16"], out["fp32"], dim=-1).min() > 0.99
