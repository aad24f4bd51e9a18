"""Realistic-size benchmark checkpoints: DeepSeek-V3-architecture models in Hugging Face
layout, bf16, with the high-acceptance edit, written to disk for the daemon to serve.

The demo model (14 MB) makes a decode step per-operation overhead; these make it bound by
reading weights, as the models this daemon exists for are.

  python -m benchmarks.models --size 0.5b                     # -> .cache/bench-models/deepseek-v3-0.5b-mtp
  python -m benchmarks.models --size 1.6b --out DIR
  python -m benchmarks.models --size 0.5b --quantize w8a8     # also the int8 copy (training.quantize)

Sizes (``SIZES``; bf16; routing weights float32):
  1.6b  server/testing/high_acceptance.big_config: hidden 2048, 12 layers (first dense,
        intermediate 5632), 16 routed experts of 1024 top-4 + 1 shared, MLA 16 heads
        (q_lora 1536, kv_lora 512), vocab 32000, 1 MTP layer: 1.66B parameters, 0.63B
        read per token.
  0.5b  the same scaled: hidden 1536, 10 layers (first dense, intermediate 3072), 16
        routed experts of 512 top-4 + 1 shared, MLA 12 heads (q_lora 768, kv_lora 384),
        vocab 32000, 1 MTP layer: 0.60B parameters, 0.24B read per token.

Weights: ``high_acceptance.build_model`` (seeded, unit-scale activations) edited by
``make_high_acceptance`` (``ALPHA``: the MTP layer nearly predicts the main model's next
token; greedy k=1 acceptance ~0.75-0.8 on the bench prompts).  The tokenizer is the tiny
test tokenizer (server/testing/tiny_tokenizer.py) padded to the vocabulary with
placeholder ids; the head rows of every id but the 633 byte and merge tokens that decode
to text on their own (``plain_token_ids``) are zeroed: BOS/EOS/PAD, the DeepSeek turn
and tool markers, the placeholders, lone bytes of multi-byte characters.  So greedy text
is plain text, never EOS (requests run to max_tokens either stop rule), and streamed
deltas carry content from the first token.  The bytes read are unchanged: the head is
still [32000, hidden].

Built in bf16 (the 1.6b model holds 3.3 GB while it is built, never float32 copies) and
written shard by shard (``--shard-mib``, model-0000i-of-0000n.safetensors + index).  The
MTP layer carries copies of the embedding and head, as DeepSeek's release does.  A
``bench_model.json`` written last marks a complete folder (``ensure`` rebuilds without it).

``--quantize``: runs ``python -m training.quantize`` on the bf16 folder:
  w8a8          its default, msModelSlim "W8A8 mixed" as MindIE serves DeepSeek-V3
                (MLA W8A8 static, calibrated; every MLP W8A8_DYNAMIC; config quantize
                w8a8_dynamic, mla_quantize w8a8);
  w8a8_dynamic  ``--format compressed-tensors``: every linear but kv_b_proj and the heads
                int8 per channel with dynamic per-token activations (the W8A8_DYNAMIC
                arithmetic everywhere; training.quantize writes no all-dynamic msModelSlim
                folder, so this is the closest);
  w8a8_dynamic_heads  w8a8_dynamic with the vocabulary heads int8 too (``--quant-heads``),
                as llama.cpp's q8_0 quantizes its output tensor;
  w4a8          ``--w4a8-experts``: w8a8 with the main layers' routed experts W4A8_DYNAMIC.
training.quantize holds every tensor, a float32 copy of the model and the output at once:
8.1 GB peak resident for the 0.5b model (50 s), so ~22 GB for the 1.6b one, more than
this project's 24 GB machines have to spare.  ``--quantizer streaming`` (what ``auto``
picks when the estimate, 14 bytes a parameter, passes 60% of MemAvailable) writes the
same layout from training.quantize's own functions (per_channel, static_w8a8,
dynamic_w8a8, dynamic_w4a8, calibration_ids) tensor by tensor, one output shard at a
time, calibrating the static ranges on the model loaded in its bf16 (training.quantize
calibrates in float32); peak about the bf16 model.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from server.testing.daemon import ROOT

DEFAULT_DIR = ROOT / ".cache" / "bench-models"
# make_high_acceptance's alpha per size: k=1 acceptance ~0.75-0.8 on the bench prompts over
# 64 greedy tokens (0.5b: 0.02 gave 0.97 and 20-token cycles, 0.03 0.89, 0.04 0.76, 0.05
# 0.74, 0.1 0.48; 1.6b: 0.02 0.88, 0.04 0.75), near DeepSeek-V3's reported 0.85-0.9.
ALPHA = {"0.5b": 0.04, "1.6b": 0.03}
SEED = 0
SIZES: dict[str, dict] = {
    "0.5b": dict(hidden_size=1536, num_hidden_layers=10, intermediate_size=3072,
                 moe_intermediate_size=512, num_attention_heads=12, num_key_value_heads=12,
                 q_lora_rank=768, kv_lora_rank=384),
    "1.6b": {},
}
# Fields of a DeepSeek-V3 config.json that big_config_dict leaves to defaults (transformers reads them).
HF_FIELDS = {"attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
             "use_cache": True}
QUANTIZE = {"w8a8": [], "w8a8_dynamic": ["--format", "compressed-tensors"],
            "w8a8_dynamic_heads": ["--format", "compressed-tensors", "--quant-heads"],
            "w4a8": ["--w4a8-experts"]}
MARKER = "bench_model.json"


def model_dir(size: str, root: Path = DEFAULT_DIR, quantize: str | None = None) -> Path:
    return Path(root) / (f"deepseek-v3-{size}-mtp" + (f"-{quantize}" if quantize else ""))


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def config_dict(size: str) -> dict:
    from server.testing.high_acceptance import big_config_dict
    return big_config_dict(**SIZES[size], **HF_FIELDS)


def plain_token_ids(folder: Path) -> list[int]:
    """Ids of tokenizer.json's byte and merge tokens (not added / special tokens) that
    decode on their own to text (not a lone byte of a multi-byte character: a streamed
    answer holds such bytes back until the character completes, which random text never
    does, so no content would go out before the end)."""
    from tokenizers import Tokenizer
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    added = {t["id"] for t in tok.get("added_tokens", [])}
    dec = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return sorted(i for i in tok["model"]["vocab"].values()
                  if i not in added and (text := dec.decode([i])) and "\ufffd" not in text)


def make_model(size: str, tokenizer_dir: Path, *, seed: int = SEED, alpha: float | None = None):
    """The ``size`` model in memory, bf16: seeded weights, the high-acceptance edit, and
    the head rows of every id but ``plain_token_ids(tokenizer_dir)`` zeroed."""
    import torch
    from server.model.config import DeepseekConfig
    from server.testing.high_acceptance import build_model, make_high_acceptance
    raw = config_dict(size)
    model = make_high_acceptance(build_model(DeepseekConfig.from_hf(dict(raw)), "cpu", torch.bfloat16, seed),
                                 ALPHA[size] if alpha is None else alpha)
    keep = torch.zeros(raw["vocab_size"], dtype=torch.bool)
    keep[plain_token_ids(tokenizer_dir)] = True
    with torch.no_grad():                   # the MTP head is this tensor too (build_model ties them)
        model.lm_head.weight[~keep] = 0
    return model


def _shards(names: list[str], nbytes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for name in names:
        if out[-1] and size + nbytes[name] > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes[name]
    return out


def _order(name: str) -> tuple:
    """Embedding first, then layer by layer, then norm and head (readers go in this order)."""
    if name.startswith("model.layers."):
        return (1, int(name.split(".")[2]), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def build(size: str, out: Path, *, seed: int = SEED, alpha: float | None = None,
          shard_mib: int = 1024, log=print) -> dict:
    """Write the ``size`` checkpoint into ``out``; return what bench_model.json holds."""
    from safetensors.torch import save_file
    from server.model.config import DeepseekConfig
    from server.testing.high_acceptance import num_parameters
    from server.testing.tiny_tokenizer import write_tiny_tokenizer

    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    raw = config_dict(size)
    cfg = DeepseekConfig.from_hf(dict(raw))
    write_tiny_tokenizer(out, raw["vocab_size"])
    model = make_model(size, out, seed=seed, alpha=alpha)
    params = num_parameters(model)
    built_s = time.perf_counter() - t0
    log(f"built {size} in memory: {params / 1e9:.3f}B parameters, {built_s:.1f}s")

    tensors = dict(model.named_parameters(remove_duplicate=False))
    n = cfg.num_hidden_layers
    for j in range(model.num_mtp_layers):
        tensors[f"model.layers.{n + j}.embed_tokens.weight"] = model.model.embed_tokens.weight
    names = sorted(tensors, key=_order)
    nbytes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    shards = _shards(names, nbytes, shard_mib << 20)
    weight_map: dict[str, str] = {}
    for i, part in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        seen: set[int] = set()
        chunk = {}
        for name in part:                   # a tensor twice in one file (tied): write a copy
            t = tensors[name].detach()
            chunk[name] = t.clone() if t.data_ptr() in seen else t.contiguous()
            seen.add(t.data_ptr())
        save_file(chunk, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in part})
        log(f"  wrote {file} ({sum(nbytes[k] for k in part) / 2**20:.0f} MiB, {len(part)} tensors)")
        del chunk
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"_from_model_config": True, "bos_token_id": raw["bos_token_id"],
           "eos_token_id": raw["eos_token_id"], "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    del model, tensors
    info = {"size": size, "seed": seed, "alpha": ALPHA[size] if alpha is None else alpha, "parameters": params,
            "file_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
            "build_s": round(time.perf_counter() - t0, 1), "config": SIZES[size]}
    (out / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    log(f"wrote {out}: {info['file_bytes'] / 1e9:.2f} GB on disk in {info['build_s']:.1f}s")
    return info


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def quantize(src: Path, dst: Path, scheme: str, calib_samples: int = 16, quantizer: str = "auto",
             log=print) -> dict:
    """``python -m training.quantize src dst`` with ``scheme``'s flags (``QUANTIZE``), or
    ``quantize_streaming`` where that would not fit in memory (``quantizer`` "auto")."""
    t0 = time.perf_counter()
    (Path(dst) / MARKER).unlink(missing_ok=True)
    params = json.loads((Path(src) / MARKER).read_text())["parameters"]
    if quantizer == "auto":
        quantizer = "training" if 14 * params < 0.6 * _mem_available() else "streaming"
    if quantizer == "streaming":
        log(f"quantizing {src} tensor by tensor (training.quantize would need ~{14 * params / 1e9:.0f} GB)")
        quantize_streaming(Path(src), Path(dst), scheme, calib_samples, log)
    else:
        dynamic = scheme.startswith("w8a8_dynamic")              # nothing to calibrate
        cmd = [sys.executable, "-m", "training.quantize", str(src), str(dst), *QUANTIZE[scheme],
               "--calib-samples", str(1 if dynamic else calib_samples)]
        log("$ " + " ".join(cmd[1:]))
        subprocess.run(cmd, check=True, cwd=ROOT)
    info = {**json.loads((Path(src) / MARKER).read_text()), "quantize": scheme, "quantizer": quantizer,
            "source": str(src), "calib_samples": calib_samples,
            "file_bytes": sum(f.stat().st_size for f in Path(dst).glob("*.safetensors")),
            "quantize_s": round(time.perf_counter() - t0, 1)}
    (Path(dst) / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    log(f"wrote {dst}: {info['file_bytes'] / 1e9:.2f} GB on disk in {info['quantize_s']:.1f}s")
    return info


def _kind(prefix: str, n_main: int, scheme: str) -> str:
    """training.quantize's choice of type per linear (``--quant-mtp mix``, its default)."""
    layer = int(prefix.split(".")[2]) if prefix.startswith("model.layers.") else None
    mtp = layer is not None and layer >= n_main
    if prefix == "lm_head" or prefix.endswith("shared_head.head"):
        return "W8A8_DYNAMIC" if scheme == "w8a8_dynamic_heads" else "FLOAT"
    if layer is None or prefix.endswith("kv_b_proj"):
        return "FLOAT"
    if scheme.startswith("w8a8_dynamic"):             # --format compressed-tensors
        return "W8A8_DYNAMIC"
    if ".self_attn." in prefix:
        return "W8A8_DYNAMIC" if mtp else "W8A8"
    if ".mlp.experts." in prefix and scheme == "w4a8" and not mtp:
        return "W4A8_DYNAMIC"
    if ".mlp." in prefix or prefix.endswith("eh_proj"):
        return "W8A8_DYNAMIC"
    return "FLOAT"


def _calibrate_bf16(src: Path, prefixes: list[str], samples: int, seed: int = 1234) -> dict:
    """training.quantize.calibrate's (min, max) of each listed linear's input, on the
    model in its stored dtype instead of float32."""
    import torch
    from server.model.loading import load_checkpoint
    from server.text.tokenizer import Tokenizer
    from training.quantize import calibration_ids
    model, _ = load_checkpoint(src)
    tok = Tokenizer.from_dir(src)
    ranges = {p: [0.0, 0.0] for p in prefixes}

    def hook(prefix: str):
        def record(_mod, args):
            r = ranges[prefix]
            r[0], r[1] = min(r[0], float(args[0].min())), max(r[1], float(args[0].max()))
        return record
    handles = [model.get_submodule(p).register_forward_pre_hook(hook(p)) for p in prefixes]
    with torch.inference_mode():
        for ids in calibration_ids(tok, samples, seed):
            model.forward_full(torch.tensor([ids]))
    for h in handles:
        h.remove()
    del model
    return {p: tuple(r) for p, r in ranges.items()}


def quantize_streaming(src: Path, dst: Path, scheme: str, calib_samples: int = 16, log=print,
                       shard_mib: int = 1024) -> None:
    """What ``python -m training.quantize`` writes for ``scheme`` (msModelSlim, or
    compressed-tensors for w8a8_dynamic), reading and quantizing one tensor at a time."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from server.model.config import DeepseekConfig
    from server.model.deepseek_v3 import DeepseekV3ForCausalLM
    from server.model.loading.files import tensor_index as _tensor_index
    from server.model.meta import meta_device
    from training.quantize import (COPY, compressed_tensors_config, dynamic_w4a8, dynamic_w8a8,
                                   static_w8a8)

    raw = json.loads((src / "config.json").read_text())
    n_main = raw["num_hidden_layers"]
    where = _tensor_index(src)
    with meta_device():
        model = DeepseekV3ForCausalLM(DeepseekConfig.from_hf(dict(raw)))
    kinds = {n: _kind(n, n_main, scheme) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and f"{n}.weight" in where}
    del model
    static = [p for p, k in kinds.items() if k == "W8A8"]
    ranges = _calibrate_bf16(src, static, calib_samples) if static else {}
    ct = scheme.startswith("w8a8_dynamic")
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob("*.safetensors"):
        old.unlink()
    stem = "model" if ct else "quant_model_weights"
    desc: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    shards: list[list[str]] = []
    chunk: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal chunk, size
        if chunk:
            file = f"{stem}-{len(shards) + 1:05d}.safetensors"
            save_file(chunk, str(dst / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in chunk})
            shards.append(list(chunk))
            log(f"  wrote {file} ({size / 2**20:.0f} MiB)")
            chunk, size = {}, 0

    handles: dict[str, object] = {}
    for name in sorted(where, key=_order):
        file = where[name]
        if file not in handles:
            handles[file] = safe_open(str(src / file), framework="pt")
        t = handles[file].get_tensor(name)
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        k = kinds.get(prefix, "FLOAT") if prefix else "FLOAT"
        if k == "FLOAT":
            parts = {name: t}
            desc[name] = "FLOAT"
        else:
            q = (static_w8a8(t, *ranges[prefix]) if k == "W8A8" else
                 dynamic_w4a8(t, row_parallel=prefix.endswith(("down_proj", "o_proj"))) if k == "W4A8_DYNAMIC"
                 else dynamic_w8a8(t))
            if ct:
                q = {"weight": q["weight"], "weight_scale": q["weight_scale"]}
            parts = {f"{prefix}.{sfx}": v.contiguous() for sfx, v in q.items()}
            desc.update({n: k for n in parts})
        for n, v in parts.items():
            chunk[n] = v
            size += v.numel() * v.element_size()
        if size >= shard_mib << 20:
            flush()
    flush()
    handles.clear()
    for f in COPY:
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)
    cfg = dict(raw)
    if ct:                                            # as training.quantize --format compressed-tensors
        (dst / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
        cfg["quantization_config"] = compressed_tensors_config(scheme == "w8a8_dynamic_heads")
    else:
        full = {"version": "1.0.0", "model_quant_type": "W8A8_DYNAMIC", "group_size": 0, **desc}
        (dst / "quant_model_description.json").write_text(json.dumps(full, indent=1))
        cfg.update(quantize="w8a8_dynamic", mla_quantize="w8a8", mtp_quantize="w8a8_dynamic")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    counts: dict[str, int] = {}
    for k in kinds.values():
        counts[k] = counts.get(k, 0) + 1
    log(f"wrote {dst} ({'compressed-tensors' if ct else 'msmodelslim'}, streaming): "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))


def ensure(size: str, root: Path = DEFAULT_DIR, quantize_scheme: str | None = None,
           log=print) -> Path:
    """The folder of ``size`` (quantized with ``quantize_scheme``), built first if it is
    missing or incomplete.  Builds run in a child process, so the caller's memory does not
    keep the model's pages."""
    folder = model_dir(size, root, quantize_scheme)
    if is_complete(folder) and (quantize_scheme or is_complete(model_dir(size, root))):
        return folder
    cmd = [sys.executable, "-m", "benchmarks.models", "--size", size, "--out", str(model_dir(size, root))]
    if quantize_scheme:
        cmd += ["--quantize", quantize_scheme]
    log(f"building {folder} ($ {' '.join(cmd[1:])}) ...")
    subprocess.run(cmd, check=True, cwd=ROOT)
    return folder


def float32_copy(src: Path, dst: Path, log=print) -> Path:
    """``src`` with every bf16 tensor stored as float32 (config ``torch_dtype`` float32): the
    same model for a CPU without native bf16, where a float32 product of several rows costs
    a few rows' time and a bf16 one as many rows' (spec/prediction.py's window_drafts)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    t0 = time.perf_counter()
    dst.mkdir(parents=True, exist_ok=True)
    (dst / MARKER).unlink(missing_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.float() if v.dtype == torch.bfloat16 else v
                       for k, v in load_file(str(f)).items()}, str(dst / f.name), metadata={"format": "pt"})
        elif f.name == "config.json":
            (dst / f.name).write_text(json.dumps({**json.loads(f.read_text()), "torch_dtype": "float32"},
                                                 indent=2) + "\n")
        elif f.is_file() and f.name != MARKER:
            shutil.copy2(f, dst / f.name)
    info = {**json.loads((src / MARKER).read_text()), "dtype": "float32",
            "file_bytes": sum(f.stat().st_size for f in dst.glob("*.safetensors"))}
    (dst / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    log(f"wrote {dst}: {info['file_bytes'] / 1e9:.2f} GB in {time.perf_counter() - t0:.1f}s")
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=tuple(SIZES), required=True)
    ap.add_argument("--out", type=Path, default=None,
                    help=f"the bf16 folder (default {DEFAULT_DIR.relative_to(ROOT)}/deepseek-v3-SIZE-mtp)")
    ap.add_argument("--quantize", choices=tuple(QUANTIZE), default=None,
                    help="also write OUT-SCHEME, quantized by training.quantize (the bf16 folder is "
                         "built first when missing)")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--quantizer", choices=("auto", "training", "streaming"), default="auto",
                    help="training: python -m training.quantize; streaming: tensor by tensor (see above); "
                         "auto: training.quantize where it fits in memory")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--alpha", type=float, default=None, help="make_high_acceptance's alpha (default: ALPHA[size])")
    ap.add_argument("--shard-mib", type=int, default=1024)
    ap.add_argument("--float32", action="store_true", help="also write OUT-float32: the bf16 tensors as float32")
    ap.add_argument("--force", action="store_true", help="rebuild a complete folder")
    args = ap.parse_args(argv)
    out = args.out or model_dir(args.size)
    if args.force or not is_complete(out):
        build(args.size, out, seed=args.seed, alpha=args.alpha, shard_mib=args.shard_mib)
    else:
        print(f"{out}: complete ({MARKER}); --force rebuilds it")
    if args.float32 and (args.force or not is_complete(out.parent / f"{out.name}-float32")):
        float32_copy(out, out.parent / f"{out.name}-float32")
    if args.quantize:
        dst = out.parent / f"{out.name}-{args.quantize}"
        if args.force or not is_complete(dst):
            quantize(out, dst, args.quantize, args.calib_samples, args.quantizer)
        else:
            print(f"{dst}: complete ({MARKER}); --force rebuilds it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
