"""Quantize a float DeepSeek-V3 checkpoint (this repo's Hugging Face layout) into the int8
formats the server loads, so tests and benchmarks can rebuild them in seconds.

  python -m training.quantize SRC DST                        # msModelSlim W8A8 mixed (MindIE's format)
  python -m training.quantize SRC DST --w4a8-experts         # ... with W4A8_DYNAMIC routed experts
  python -m training.quantize SRC DST --quant-mtp float      # ... with the MTP layer kept float
  python -m training.quantize SRC DST --fa-quant             # ... with FA3 (FAKQuant) KV scales
  python -m training.quantize SRC DST --format compressed-tensors   # vLLM's int8 (channel / token)
  python -m training.quantize SRC DST --calibration FILE     # calibrate on FILE's text

msModelSlim layout (the "W8A8 mixed" DeepSeek recipe: MLA W8A8, MoE W8A8 dynamic):
  * ``self_attn`` linears except ``kv_b_proj``: W8A8 static, activations per tensor,
    asymmetric, calibrated on ``--calib-samples`` texts: windows of up to 512 tokens of
    ``--calibration FILE`` (UTF-8 text), or by default chats of the demo model's training
    split (training/corpus.py, seeded by ``--seed``);
  * every MLP linear (dense layers, shared and routed experts): W8A8_DYNAMIC
    (``--w4a8-experts``: routed experts of the main layers W4A8_DYNAMIC, two int4 per byte
    along the output dimension, with ``scale_bias``);
  * FLOAT: embeddings, norms, the router, every ``kv_b_proj``, ``lm_head`` and the MTP
    layer's ``shared_head.head``;
  * the MTP layer (``--quant-mtp mix``, the default): its MLP as above, its attention
    W8A8_DYNAMIC (the calibration pass runs only the main layers); ``float`` keeps it float.
``--fa-quant`` adds msModelSlim's FA3 per-head scales (``self_attn.fa_{q,k,v}.scale`` /
``.offset``, [heads, 1], from the calibrated latent range) on every main layer but the
first (the DeepSeek recipes leave early layers out), and ``fa_quant_type: FAKQuant``.
Files: ``quant_model_weights.safetensors``, ``quant_model_description.json`` (every tensor
named with its type), config.json with ``quantize`` / ``mla_quantize`` / ``mtp_quantize``.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from server.model.loading import load_checkpoint, tensor_index as _tensor_index
from server.model.quant.int4 import pack_int4_rows

COPY = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def per_channel(w: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization: (int8 values, scale [out])."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / qmax
    q = torch.round(w.float() / scale[:, None]).clamp(-qmax, qmax).to(torch.int8)
    return q, scale


CALIB_TOKENS = 512


def calibration_ids(tok, samples: int, seed: int, text_file: Path | None = None) -> list[list[int]]:
    """``samples`` token sequences of at most CALIB_TOKENS: consecutive windows of
    ``text_file``'s text (fewer when it is short), or rendered training chats of the demo
    model's corpus (seeded)."""
    if text_file is not None:
        ids = tok.encode(text_file.read_text(encoding="utf-8"))
        windows = [ids[i:i + CALIB_TOKENS] for i in range(0, len(ids), CALIB_TOKENS)][:samples]
        if not windows or not windows[0]:
            raise SystemExit(f"{text_file}: no text to calibrate on")
        return windows
    from .corpus import make_chat
    from .render import render_chat
    rng = random.Random(seed)
    return [tok.encode(render_chat(make_chat(rng, "train")))[:CALIB_TOKENS] for _ in range(samples)]


def calibrate(src: Path, prefixes: list[str], samples: int, seed: int,
              latent_layers: list[int] = (), text_file: Path | None = None,
              ) -> tuple[dict[str, tuple[float, float]], dict[int, float]]:
    """(min, max) of each listed linear's input, and max |latent| of each listed layer's
    MLA cache rows, over the calibration texts (``calibration_ids``)."""
    from server.text.tokenizer import Tokenizer
    model, _ = load_checkpoint(src, dtype=torch.float32)
    tok = Tokenizer.from_dir(src)
    ranges: dict[str, list[float]] = {p: [0.0, 0.0] for p in prefixes}

    def hook(prefix: str):
        def record(_mod, args):
            x = args[0]
            r = ranges[prefix]
            r[0], r[1] = min(r[0], float(x.min())), max(r[1], float(x.max()))
        return record

    handles = [model.get_submodule(p).register_forward_pre_hook(hook(p)) for p in prefixes]
    latent_max: dict[int, float] = {i: 0.0 for i in latent_layers}

    def latent_hook(layer: int):
        def record(_mod, _args, out):
            latent_max[layer] = max(latent_max[layer], float(out.abs().max()))
        return record

    handles += [model.model.layers[i].self_attn.kv_a_layernorm.register_forward_hook(latent_hook(i))
                for i in latent_layers]
    with torch.inference_mode():
        for ids in calibration_ids(tok, samples, seed, text_file):
            model.forward_full(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return {p: (lo, hi) for p, (lo, hi) in ranges.items()}, latent_max


def static_w8a8(w: torch.Tensor, lo: float, hi: float) -> dict[str, torch.Tensor]:
    """msModelSlim W8A8: x_q = round(x / input_scale + input_offset), per-tensor asymmetric;
    acc + quant_bias = x_q . W_q^T - offset * sum_k W_q; y = acc * deq_scale."""
    q, w_scale = per_channel(w, 127)
    in_scale = max(hi - lo, 1e-8) / 255.0
    in_offset = float(round(-lo / in_scale) - 128)
    deq = (in_scale * w_scale).float()
    qbias = torch.round(-in_offset * q.float().sum(dim=1)).to(torch.int32)
    return {"weight": q, "input_scale": torch.tensor([in_scale], dtype=torch.float32),
            "input_offset": torch.tensor([in_offset], dtype=torch.float32),
            "deq_scale": deq, "quant_bias": qbias}



def compressed_tensors_config(quant_heads: bool = False) -> dict:
    """config.json's ``quantization_config`` for vLLM's int8 (channel weights, dynamic
    token activations) with the layers this recipe keeps float (the vocabulary heads
    among them unless ``quant_heads``)."""
    heads = [] if quant_heads else ["lm_head", "re:.*shared_head.head$"]
    return {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None,
        "ignore": [*heads, "re:.*kv_b_proj$"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                        "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True}}}}

def dynamic_w8a8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale = per_channel(w, 127)
    return {"weight": q, "weight_scale": scale[:, None], "weight_offset": torch.zeros_like(scale)[:, None]}


def dynamic_w4a8(w: torch.Tensor, row_parallel: bool) -> dict[str, torch.Tensor]:
    q, scale = per_channel(w, 7)
    deq = q.float() * scale[:, None]
    if row_parallel:       # down / o: k split in 16 chunks, as msModelSlim writes it
        chunks = deq.chunk(16, dim=1)
        scale_bias = 8 * torch.stack([c.sum(dim=1) for c in chunks], dim=1)
    else:
        scale_bias = 8 * deq.sum(dim=1, keepdim=True)
    return {"weight": pack_int4_rows(q), "weight_scale": scale[:, None],
            "weight_offset": torch.zeros_like(scale)[:, None], "scale_bias": scale_bias}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.quantize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--format", choices=("msmodelslim", "compressed-tensors"), default="msmodelslim")
    ap.add_argument("--w4a8-experts", action="store_true")
    ap.add_argument("--quant-mtp", choices=("mix", "float"), default="mix")
    ap.add_argument("--fa-quant", action="store_true", help="add FA3 (FAKQuant) KV scales")
    ap.add_argument("--quant-heads", action="store_true",
                    help="the vocabulary heads (lm_head, the MTP layers' shared_head.head) "
                         "W8A8_DYNAMIC too, as llama.cpp's q8_0 quantizes its output tensor; "
                         "the usual msModelSlim and compressed-tensors recipes keep them float")
    ap.add_argument("--calibration", type=Path, metavar="FILE",
                    help="UTF-8 text to calibrate the static activation ranges on (default: "
                         "chats of the demo model's training split, made by training/corpus.py)")
    ap.add_argument("--calib-samples", type=int, default=64,
                    help="calibration texts (windows of up to 512 tokens)")
    ap.add_argument("--seed", type=int, default=1234, help="of the default calibration chats")
    args = ap.parse_args(argv)

    src, dst = args.src, args.dst
    raw = json.loads((src / "config.json").read_text())
    n_main = raw["num_hidden_layers"]
    from safetensors import safe_open
    tensors: dict[str, torch.Tensor] = {}
    for name, file in _tensor_index(src).items():
        with safe_open(str(src / file), framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    model, _ = load_checkpoint(src, dtype=torch.float32)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and f"{n}.weight" in tensors]
    del model

    def layer_of(prefix: str) -> int | None:
        parts = prefix.split(".")
        return int(parts[2]) if prefix.startswith("model.layers.") else None

    def kind(prefix: str) -> str:
        layer = layer_of(prefix)
        mtp = layer is not None and layer >= n_main
        if prefix == "lm_head" or prefix.endswith("shared_head.head"):
            return "W8A8_DYNAMIC" if args.quant_heads else "FLOAT"
        if layer is None or prefix.endswith("kv_b_proj"):
            return "FLOAT"
        if args.format == "compressed-tensors":
            return "W8A8_DYNAMIC"
        if mtp and args.quant_mtp == "float":
            return "FLOAT"
        if ".self_attn." in prefix:
            return "W8A8_DYNAMIC" if mtp else "W8A8"
        if ".mlp.experts." in prefix and args.w4a8_experts and not mtp:
            return "W4A8_DYNAMIC"
        if ".mlp." in prefix or prefix.endswith("eh_proj"):
            return "W8A8_DYNAMIC"
        return "FLOAT"

    kinds = {p: kind(p) for p in linears}
    fa_layers = list(range(1, n_main)) if args.fa_quant and args.format == "msmodelslim" else []
    ranges, latent_max = calibrate(src, [p for p, k in kinds.items() if k == "W8A8"],
                                   args.calib_samples, args.seed, fa_layers, args.calibration)
    out: dict[str, torch.Tensor] = {}
    desc: dict[str, str] = {}
    for name, t in tensors.items():
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        k = kinds.get(prefix, "FLOAT") if prefix else "FLOAT"
        if k == "FLOAT":
            out[name], desc[name] = t, "FLOAT"
            continue
        if k == "W8A8":
            parts = static_w8a8(t, *ranges[prefix])
        elif k == "W4A8_DYNAMIC":
            parts = dynamic_w4a8(t, row_parallel=prefix.endswith(("down_proj", "o_proj")))
        else:
            parts = dynamic_w8a8(t)
        if args.format == "compressed-tensors":
            parts = {"weight": parts["weight"], "weight_scale": parts["weight_scale"]}
        for suffix, v in parts.items():
            out[f"{prefix}.{suffix}"] = v.contiguous()
            desc[f"{prefix}.{suffix}"] = k

    heads = raw["num_attention_heads"]
    for layer in fa_layers:
        for part in ("fa_q", "fa_k", "fa_v"):
            name = f"model.layers.{layer}.self_attn.{part}"
            out[f"{name}.scale"] = torch.full((heads, 1), max(latent_max[layer], 1e-8) / 127.0)
            out[f"{name}.offset"] = torch.zeros(heads, 1, dtype=torch.int8)
            desc[f"{name}.scale"] = desc[f"{name}.offset"] = "FAQuant"
    dst.mkdir(parents=True, exist_ok=True)
    for f in COPY:
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)
    cfg = dict(raw)
    if args.format == "compressed-tensors":
        save_file(out, str(dst / "model.safetensors"))
        cfg["quantization_config"] = compressed_tensors_config(args.quant_heads)
    else:
        save_file(out, str(dst / "quant_model_weights.safetensors"))
        full = {"version": "1.0.0", "model_quant_type": "W8A8_DYNAMIC", "group_size": 0,
                **({"fa_quant_type": "FAKQuant"} if fa_layers else {}), **desc}
        (dst / "quant_model_description.json").write_text(json.dumps(full, indent=1))
        cfg.update(quantize="w8a8_dynamic", mla_quantize="w8a8")
        if args.quant_mtp == "mix":
            cfg["mtp_quantize"] = "w8a8_dynamic"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    counts: dict[str, int] = {}
    for k in kinds.values():
        counts[k] = counts.get(k, 0) + 1
    print(f"wrote {dst} ({args.format}): " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
