"""Seeded random-weight DeepSeek-V3 checkpoints in Hugging Face layout, made in well under a second.

The weights are scaled so the model is not degenerate: unit-ish activations, logits with
a spread of a few units (greedy picks are not near-ties), and router logits varied enough
that different tokens choose different experts. The default dimensions leave FP8 edge
blocks partial (intermediate_size 160 = 128 + 32) when ``fp8=True``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from server.model.config import TORCH_DTYPES, DeepseekConfig
from server.model.deepseek_v3 import DeepseekV3ForCausalLM
from server.model.quant.fp8 import quantize_fp8
from server.model.meta import meta_device

# Linear weights the official FP8 release stores in float8 (embedding, heads, router, norms,
# eh_proj stay high precision).
_FP8_PARTS = (".self_attn.", ".mlp.")


def tiny_config(*, yarn: bool = False, q_lora_rank: int | None = 32, n_group: int = 2, topk_group: int = 1,
                with_mtp: bool = True, dtype: str = "float32", **overrides: Any) -> dict[str, Any]:
    """The config.json dict make_tiny_checkpoint writes (overrides replace any key)."""
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 160,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": n_group,
        "topk_group": topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1 if with_mtp else 0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if yarn:
        # Short original context so test positions cross the interpolated band; mscale differs
        # from mscale_all_dim so both the cos/sin amplitude and the softmax correction matter.
        cfg["rope_scaling"] = {
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
        }
    cfg.update(overrides)
    return cfg


def _init(name: str, shape: torch.Size, cfg: DeepseekConfig, g: torch.Generator) -> torch.Tensor:
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=g) * 0.05
    if len(shape) == 1:  # norm weights near 1
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    if name.endswith("mlp.gate.weight"):  # router: spread so tokens disagree on experts
        return torch.randn(shape, generator=g) * (2.0 / math.sqrt(shape[1]))
    if name.endswith(("lm_head.weight", "shared_head.head.weight")):
        return torch.randn(shape, generator=g) * (2.5 / math.sqrt(shape[1]))
    return torch.randn(shape, generator=g) * (1.0 / math.sqrt(shape[1]))


def make_tiny_checkpoint(dir: str | Path, *, seed: int = 0, yarn: bool = False, q_lora_rank: int | None = 32,
                         n_group: int = 2, topk_group: int = 1, with_mtp: bool = True, fp8: bool = False,
                         dtype: str = "float32", **overrides: Any) -> Path:
    """Write config.json, model.safetensors, generation_config.json and tokenizer files; return dir."""
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(yarn=yarn, q_lora_rank=q_lora_rank, n_group=n_group, topk_group=topk_group,
                      with_mtp=with_mtp, dtype="bfloat16" if fp8 else dtype, **overrides)
    cfg = DeepseekConfig.from_hf(raw)
    with meta_device():
        shapes = {k: p.shape for k, p in DeepseekV3ForCausalLM(cfg).named_parameters()}
    g = torch.Generator().manual_seed(seed)
    target = TORCH_DTYPES[dtype]
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        w = _init(name, shapes[name], cfg, g)
        if fp8 and w.dim() == 2 and any(p in name for p in _FP8_PARTS) and not name.endswith("mlp.gate.weight"):
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = quantize_fp8(w)
        elif name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
            tensors[name] = w.float()
        else:
            tensors[name] = w.to(torch.bfloat16 if fp8 else target)
    for j in range(cfg.num_nextn_predict_layers):
        # Official layout: the MTP layer carries copies of the shared embedding and head.
        prefix = f"model.layers.{cfg.num_hidden_layers + j}."
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    if fp8:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"_from_model_config": True, "bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"],
           "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    _write_tokenizer(out, raw["vocab_size"])
    return out


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """Tokenizer files come from the text package's factory; skipped until that exists."""
    try:
        from server.testing.tiny_tokenizer import write_tiny_tokenizer
    except ImportError:
        return
    write_tiny_tokenizer(out, vocab_size)
