"""Write the trained model in Hugging Face layout (the names the official DeepSeek-V3 release uses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from server.model.deepseek_v3 import DeepseekV3ForCausalLM


def state_dict_hf(model: DeepseekV3ForCausalLM, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor under its HF name; the MTP layer carries a copy of the shared embedding
    (``model.layers.{N}.embed_tokens``), as the official release does, and its own
    ``shared_head.head`` (equal to ``lm_head`` where training tied them; kept apart after
    copy_layers.extend). Router weights and the correction bias stay float32."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict(keep_vars=False).items():
        t = p.detach()
        keep32 = name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        out[name] = t.to(torch.float32 if keep32 else dtype).contiguous().clone()
    for j in range(model.num_mtp_layers):
        prefix = f"model.layers.{cfg.num_hidden_layers + j}."
        out[prefix + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def write_model(model: DeepseekV3ForCausalLM, out: Path, hf_cfg: dict[str, Any], gen_cfg: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[hf_cfg["torch_dtype"]]
    save_file(state_dict_hf(model, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
