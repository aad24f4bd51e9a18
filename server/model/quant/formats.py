"""Recognise and load quantized DeepSeek checkpoints: msModelSlim (MindIE's format) and
compressed-tensors int8.

msModelSlim writes ``quant_model_description.json`` (v1) or ``quant_model_description_*.json``
(v0 / ``--mindie_format``): a flat object mapping every tensor name to its type (FLOAT,
W8A8, W8A8_DYNAMIC, W4A8_DYNAMIC, ...) plus global keys (model_quant_type, fa_quant_type,
kv_cache_type, ...).  A linear layer's type is that of its ``.weight``.  compressed-tensors
puts a ``quantization_config`` with ``quant_method: compressed-tensors`` in config.json.

Every quantized layer is checked (dtype, shape, companions present and well-formed) and
every problem is reported by tensor name, with what was expected; a layer type or a
feature this server does not compute is refused rather than loaded as garbage.  Weights
keep the [out, in] layout of the checkpoint, so a tensor-parallel rank can slice them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from server.model.meta import meta_device
from server.model.quant.int4 import unpack_int4_rows
from server.model.quant.linear import QuantLinear

DESCRIPTION = "quant_model_description.json"
SUPPORTED = {"W8A8": "w8a8_static", "W8A8_DYNAMIC": "w8a8_dynamic", "W4A8_DYNAMIC": "w8a8_dynamic"}
KNOWN = {"FLOAT", "W8A8", "W8A8_DYNAMIC", "W8A8_MIX", "W8A16", "W4A8_DYNAMIC", "W4A4_DYNAMIC",
         "WFP8AFP8_DYNAMIC", "W8A8_MXFP8", "W4A8_MXFP", "W4A4_MXFP4", "W16A16S", "W8A8S", "C8",
         "FAQuant", "FLATQUANT", "FLATQUANT_DYNAMIC"}
# Read as raw matrices by the absorbed MLA attention, so kept (or made) float at load.
DEQUANTIZE_AT_LOAD = ("self_attn.kv_b_proj",)


class QuantConfigError(ValueError):
    """The checkpoint's quantization cannot be served; the message says what and why."""


@dataclass
class QuantSpec:
    format: str                                   # "msmodelslim" | "compressed-tensors"
    source: str                                   # the file that described it
    layer_types: dict[str, str] = field(default_factory=dict)   # linear prefix -> W8A8 / ...
    model_quant_type: str | None = None
    fa_layers: frozenset[int] = frozenset()       # layers with FA3 (FAKQuant) KV scales

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for t in self.layer_types.values():
            counts[t] = counts.get(t, 0) + 1
        kinds = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        fa = f"; FA3 int8 KV on {len(self.fa_layers)} layer(s)" if self.fa_layers else ""
        return f"{self.format} ({self.source}): {kinds or 'no quantized layers'}{fa}"


def detect(path: Path, raw_config: dict, linear_prefixes: list[str]) -> QuantSpec | None:
    """The checkpoint's quantization, or None for a float (or fp8 block) checkpoint.

    ``raw_config``: config.json's keys the model config does not model (``DeepseekConfig.extra``:
    quantization_config, quantize, ...)."""
    descs = sorted(path.glob("quant_model_description*.json"))
    qc = raw_config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if descs:
        if len(descs) > 1:
            raise QuantConfigError(f"{path}: several quantization descriptions "
                                   f"({', '.join(d.name for d in descs)}); keep exactly one")
        return _from_description(descs[0], linear_prefixes)
    if method == "compressed-tensors":
        return _from_compressed_tensors(path / "config.json", qc, linear_prefixes)
    for key in ("quantize", "mla_quantize", "mtp_quantize"):
        if raw_config.get(key):
            raise QuantConfigError(
                f"{path / 'config.json'}: {key}={raw_config[key]!r} but there is no {DESCRIPTION} "
                "(or quant_model_description_*.json): the per-tensor quantization types are unknown")
    return None


def _from_description(file: Path, linear_prefixes: list[str]) -> QuantSpec:
    try:
        desc = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise QuantConfigError(f"{file}: cannot be read as JSON ({e})") from e
    if not isinstance(desc, dict):
        raise QuantConfigError(f"{file}: expected a JSON object of tensor name -> type")
    if any(".k_proj.kv_cache_scale" in k for k in desc):
        raise QuantConfigError(f"{file}: k_proj/v_proj kv_cache_scale (C8 for dense attention) does not "
                               "apply to MLA; allowed for DeepSeek: FA3 (fa_quant_type FAKQuant)")
    fa_on = bool(desc.get("fa_quant_type")) or desc.get("kv_cache_type") in ("C8", "KV8") \
        or desc.get("kv_quant_type") in ("C8", "KV8")
    fa_layers = frozenset(int(k.split(".")[2]) for k in desc
                          if k.startswith("model.layers.") and k.endswith(".self_attn.fa_k.scale"))
    if fa_on and not fa_layers:
        raise QuantConfigError(f"{file}: FA3 / C8 KV quantization is on but no layer has "
                               "self_attn.fa_k.scale")
    spec = QuantSpec("msmodelslim", file.name, model_quant_type=desc.get("model_quant_type"),
                     fa_layers=fa_layers)
    problems = []
    for prefix in linear_prefixes:
        t = desc.get(prefix + ".weight")
        if t is None or t == "FLOAT":
            continue                    # an MTP layer the description omits is float (checked at load)
        if t not in SUPPORTED:
            what = "unknown" if t not in KNOWN else "not supported"
            problems.append(f"tensor {prefix}.weight: quantization type {t!r} is {what}; "
                            f"allowed: FLOAT, {', '.join(SUPPORTED)}")
            continue
        spec.layer_types[prefix] = t
    for name, t in desc.items():
        if isinstance(t, str) and name.endswith(".weight") and t not in KNOWN:
            problems.append(f"tensor {name}: quantization type {t!r} is unknown")
    if problems:
        raise QuantConfigError(f"{file}:\n  " + "\n  ".join(problems))
    return spec


def ignored(prefix: str, ignore: list[str]) -> bool:
    """Whether compressed-tensors' ``ignore`` list (module names, suffixes or ``re:``
    patterns) keeps the layer ``prefix`` float."""
    for pat in ignore:
        if pat.startswith("re:"):
            if re.fullmatch(pat[3:], prefix):
                return True
        elif prefix == pat or prefix.endswith("." + pat):
            return True
    return False


def _from_compressed_tensors(cfg_file: Path, qc: dict, linear_prefixes: list[str]) -> QuantSpec:
    want_w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    want_a = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    problems = []
    if qc.get("format") not in ("int-quantized", None):
        problems.append(f"format {qc.get('format')!r}; allowed: 'int-quantized'")
    if qc.get("kv_cache_scheme"):
        problems.append("kv_cache_scheme is set; int8 / fp8 KV-cache quantization is not supported yet")
    groups = qc.get("config_groups") or {}
    if not groups:
        problems.append("config_groups is empty")
    for gname, g in groups.items():
        if g.get("targets") != ["Linear"]:
            problems.append(f"config_groups.{gname}.targets {g.get('targets')!r}; allowed: ['Linear']")
        for part, want in (("weights", want_w), ("input_activations", want_a)):
            got = g.get(part) or {}
            bad = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
            if bad:
                problems.append(f"config_groups.{gname}.{part}: {bad}; this server computes {want}")
    if problems:
        raise QuantConfigError(f"{cfg_file}: quantization_config (compressed-tensors) is not "
                               "servable:\n  " + "\n  ".join(problems))
    ignore = list(qc.get("ignore") or [])
    spec = QuantSpec("compressed-tensors", cfg_file.name)
    spec.layer_types = {p: "W8A8_DYNAMIC" for p in linear_prefixes if not ignored(p, ignore)}
    return spec


def install(model: nn.Module, spec: QuantSpec, backend: str,
            row_parallel: frozenset[str] = frozenset()) -> None:
    """Swap each quantized nn.Linear for a QuantLinear (on the meta device, before loading).

    ``row_parallel``: layers a tensor-parallel rank holds an input slice of (quant_shard.py);
    their QuantLinear sums over the group itself.  A MoE whose shared experts' down
    projection is one of them adds that (then whole) output after its combine."""
    for prefix, t in spec.layer_types.items():
        if prefix.endswith(DEQUANTIZE_AT_LOAD):
            continue
        old = model.get_submodule(prefix)
        parent, _, attr = prefix.rpartition(".")
        with meta_device():
            new = QuantLinear(old.in_features, old.out_features, SUPPORTED[t], backend=backend,
                              bias=old.bias is not None, row_parallel=prefix in row_parallel)
        setattr(model.get_submodule(parent), attr, new)
        if prefix in row_parallel and prefix.endswith("shared_experts.down_proj"):
            model.get_submodule(parent.rpartition(".")[0]).shared_after_combine = True


def check_fa_scales(spec: QuantSpec, num_heads: int, get: Callable[[str], torch.Tensor],
                    has: Callable[[str], bool], errors: list[str]) -> None:
    """FA3 (FAKQuant) per-head scales and offsets of every FA layer: present, float scales
    and zero offsets of shape [heads, 1].  The int8 latent cache these layers get uses
    dynamic per-token scales (finer than one static scale per head), so the values are
    checked, not applied."""
    for layer in sorted(spec.fa_layers):
        for part in ("fa_q", "fa_k", "fa_v"):
            for what in ("scale", "offset"):
                name = f"model.layers.{layer}.self_attn.{part}.{what}"
                if not has(name):
                    errors.append(f"tensor {name} is missing (FA3 needs it)")
                    continue
                x = get(name)
                if tuple(x.shape) not in ((num_heads, 1), (num_heads,)):
                    errors.append(f"tensor {name}: shape {tuple(x.shape)}, expected ({num_heads}, 1)")
                elif what == "scale" and (not x.is_floating_point() or bool((x <= 0).any())):
                    errors.append(f"tensor {name}: expected positive float scales")
                elif what == "offset" and bool(x.float().abs().max() > 0):
                    errors.append(f"tensor {name}: non-zero offsets are not supported; allowed: zeros")


def quantized_tensor_names(spec: QuantSpec, where: dict[str, str]) -> set[str]:
    """Checkpoint tensors that belong to quantized layers (loaded by ``load_layers``)."""
    prefixes = tuple(p + "." for p in spec.layer_types)
    return {n for n in where if n.startswith(prefixes)}


def load_layers(model: nn.Module, spec: QuantSpec, get: Callable[[str], torch.Tensor],
                has: Callable[[str], bool], device: torch.device | str,
                errors: list[str]) -> dict[str, torch.Tensor]:
    """Read, check and convert every quantized layer; returns parameter name -> tensor."""
    out: dict[str, torch.Tensor] = {}
    for prefix, t in spec.layer_types.items():
        mod = model.get_submodule(prefix)
        n, k = mod.out_features, mod.in_features
        problems: list[str] = []

        def need(suffix: str, shapes: list[tuple[int, ...]], dtypes: tuple[torch.dtype, ...],
                 optional: bool = False) -> torch.Tensor | None:
            name = f"{prefix}.{suffix}"
            if not has(name):
                if not optional:
                    problems.append(f"tensor {name} is missing ({t} needs it)")
                return None
            x = get(name)
            if x.dtype not in dtypes:
                problems.append(f"tensor {name}: dtype {x.dtype}, expected "
                                f"{' or '.join(str(d) for d in dtypes)}")
                return None
            if tuple(x.shape) not in shapes:
                problems.append(f"tensor {name}: shape {tuple(x.shape)}, expected "
                                f"{' or '.join(str(s) for s in shapes)}")
                return None
            return x

        floats = (torch.float32, torch.float16, torch.bfloat16)
        rows = [(n, 1), (n,)]
        packed = t == "W4A8_DYNAMIC"
        if packed and has(f"{prefix}.weight_scale_second"):
            problems.append(f"tensor {prefix}.weight_scale_second: per-group W4A8 is not "
                            "supported; allowed: per-channel W4A8_DYNAMIC (msModelSlim v1)")
        w = need("weight", [(n // 2, k)] if packed else [(n, k)], (torch.int8,))
        if t in ("W8A8_DYNAMIC", "W4A8_DYNAMIC"):
            scale = need("weight_scale", rows, floats)
            offset = need("weight_offset", rows, floats, optional=True)
            if offset is not None and bool(offset.float().abs().max() > 0):
                problems.append(f"tensor {prefix}.weight_offset: non-zero offsets (asymmetric "
                                "weights) are not supported; allowed: all zeros")
            if packed:
                need("scale_bias", [(n, 1), (n,), (n, 16)], floats)
            if w is not None and scale is not None and not problems:
                values = unpack_int4_rows(w) if packed else w
                if packed and bool((values.abs() > 8).any()):
                    problems.append(f"tensor {prefix}.weight: not int4 values")
                out[f"{prefix}.weight"] = values
                out[f"{prefix}.weight_scale"] = scale.float().reshape(n)
        else:                                                   # W8A8 static
            in_scale = need("input_scale", [(1,), ()], floats)
            in_offset = need("input_offset", [(1,), ()], floats + (torch.int8, torch.int32))
            deq = need("deq_scale", [(n,), (n, 1)], (torch.float32, torch.int64))
            qbias = need("quant_bias", [(n,), (n, 1)], (torch.int32,))
            if None not in (w, in_scale, in_offset, deq, qbias) and not problems:
                if deq.dtype == torch.int64:        # float32 bits widened to int64 (fp16 models)
                    deq = deq.to(torch.int32).view(torch.float32)
                out[f"{prefix}.weight"] = w
                out[f"{prefix}.input_scale"] = in_scale.float().reshape(1)
                out[f"{prefix}.input_offset"] = in_offset.float().reshape(1)
                out[f"{prefix}.deq_scale"] = deq.float().reshape(n)
                out[f"{prefix}.quant_bias"] = qbias.reshape(n)
        bias = need("bias", [(n,)], floats, optional=True)
        if bias is not None and isinstance(mod, QuantLinear) and mod.bias is not None:
            out[f"{prefix}.bias"] = bias.float()
        if prefix.endswith(DEQUANTIZE_AT_LOAD) and f"{prefix}.weight" in out:
            if t != "W8A8_DYNAMIC":
                problems.append(f"tensor {prefix}.weight: {t} for kv_b_proj is not supported; "
                                "allowed: FLOAT or W8A8_DYNAMIC (dequantized at load)")
            else:
                wf = out.pop(f"{prefix}.weight").float() * out.pop(f"{prefix}.weight_scale")[:, None]
                out[f"{prefix}.weight"] = wf
        errors.extend(problems)
    return {name: x.to(device) for name, x in out.items()}
