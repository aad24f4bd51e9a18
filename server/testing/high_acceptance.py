"""Random-weight DeepSeek-V3 models built in memory (no checkpoint), and the high-acceptance edit.

``make_high_acceptance`` turns any model with an MTP layer into one whose MTP layer nearly
predicts what the main model says next (tests and benchmarks of speculative decoding need
acceptance well above what random weights give).  ``big_config`` / ``build_model`` make a
~1.5B-parameter DeepSeek-V3-shaped model directly on a device, for GPU benchmarks
(benchmarks/engine_step.py) where writing and loading a checkpoint would only cost time.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from server.model.config import DeepseekConfig
from server.model.deepseek_v3 import DeepseekV3ForCausalLM
from server.model.meta import meta_device

# Kept in float32 whatever the model dtype, as the loader does (routing runs in float32).
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def make_high_acceptance(model: DeepseekV3ForCausalLM, alpha: float = 0.1) -> DeepseekV3ForCausalLM:
    """Edit ``model`` in place so that its MTP layer nearly predicts what the main model will
    say next; returns the same model.

    The main model's residual branches (attention o_proj, MLP down_proj) are scaled by
    ``alpha``, so its next token depends mostly on the current token: logits ~
    lm_head(norm(embed(t))).  The MTP layer is made to compute exactly that bigram guess for
    the token it reads: eh_proj = [I, 0] keeps only enorm(embed(t_{j+1})), its block's
    branches are zeroed, and shared_head = (model.norm, lm_head).  Acceptance is then high
    but not total, so accept, reject and bonus paths are all exercised.
    """
    n = model.config.num_hidden_layers
    H = model.config.hidden_size
    if not model.has_mtp:
        raise ValueError("make_high_acceptance needs a model with an MTP layer")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model.layers."):
                continue
            layer = int(name.split(".")[2])
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.mul_(alpha if layer < n else 0.0)
        mtp = model.model.layers[n]
        w = mtp.eh_proj.weight
        w.zero_()
        w[:, :H] = torch.eye(H, dtype=w.dtype, device=w.device)
        mtp.enorm.weight.fill_(1.0)
        mtp.shared_head.norm.weight.copy_(model.model.norm.weight)
        if mtp.shared_head.head.weight is not model.lm_head.weight:     # the loader may tie them
            mtp.shared_head.head.weight.copy_(model.lm_head.weight)
    return model


def big_config(**overrides: Any) -> DeepseekConfig:
    """A DeepSeek-V3-shaped config of about 1.5B parameters (1.6B with the MTP layer).

    ``overrides`` replace keys of the Hugging Face config dict before it is parsed (so any
    config.json field name works, e.g. ``num_hidden_layers=2``).
    """
    return DeepseekConfig.from_hf(big_config_dict(**overrides))


def big_config_dict(**overrides: Any) -> dict[str, Any]:
    """The Hugging Face config.json dict ``big_config`` parses (``overrides`` replace keys);
    benchmarks/models.py writes it next to the weights."""
    d: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1024,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_shared_experts": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    d.update(overrides)
    return d


def build_model(cfg: DeepseekConfig, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> DeepseekV3ForCausalLM:
    """``DeepseekV3ForCausalLM(cfg)`` with seeded random weights made directly on ``device``.

    Init (activations stay near unit scale through every layer): RMSNorm weights 1;
    embedding N(0, 1); linears N(0, 1/fan_in) (std ~0.02 at hidden 2048); router
    N(0, 1/hidden) in float32 with a zero score-correction bias, so tokens spread over the
    experts; lm_head std 2.5/sqrt(hidden), logits with a spread of a few units so greedy
    picks are rarely near-ties.  The MTP layer's head is the main lm_head (one tensor), as
    the loader arranges for released checkpoints.  Same seed and device: same weights.
    """
    device = torch.device(device)
    with meta_device():
        model = DeepseekV3ForCausalLM(cfg)
    n = cfg.num_hidden_layers
    heads = {f"model.layers.{n + j}.shared_head.head.weight" for j in range(model.num_mtp_layers)}
    g = torch.Generator(device=device).manual_seed(seed)
    H = cfg.hidden_size
    for name, p in list(model.named_parameters()):
        if name in heads:
            continue                                     # tied to lm_head below
        t = torch.empty(p.shape, dtype=torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype,
                        device=device)
        if name.endswith("e_score_correction_bias"):
            t.zero_()
        elif t.dim() == 1:
            t.fill_(1.0)
        elif name.endswith("embed_tokens.weight"):
            t.normal_(0.0, 1.0, generator=g)
        elif name.endswith("mlp.gate.weight"):
            t.normal_(0.0, H ** -0.5, generator=g)
        elif name == "lm_head.weight":
            t.normal_(0.0, 2.5 * H ** -0.5, generator=g)
        else:
            t.normal_(0.0, t.shape[1] ** -0.5, generator=g)
        prefix, _, attr = name.rpartition(".")
        setattr(model.get_submodule(prefix), attr, nn.Parameter(t, requires_grad=False))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name in heads:
        model.get_submodule(name.rsplit(".", 1)[0]).weight = model.lm_head.weight
    return model.eval()


def num_parameters(model: nn.Module) -> int:
    """Parameters held (tied tensors counted once)."""
    return sum(p.numel() for p in model.parameters())
