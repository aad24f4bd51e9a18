"""Load a Hugging Face DeepSeek-V3/V2 checkpoint directory into DeepseekV3ForCausalLM.

Reads ``config.json`` and ``model.safetensors`` (or the shards listed by
``model.safetensors.index.json``) through memory-mapped ``safe_open``. The model is built
on the meta device and each parameter is replaced by the loaded tensor, so nothing is
randomly initialised first. FP8 block-quantised weights (``weight_scale_inv``) are
dequantised on the way in. Every missing or mis-shaped tensor is collected and reported
at once in one CheckpointError.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from server.model.config import DeepseekConfig, UnsupportedConfigError
from server.model.deepseek_v3 import DeepseekV3ForCausalLM
from server.model.fp8 import BLOCK, dequantize_fp8

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Routing stays in float32 whatever the model dtype (as the reference implementations keep it).
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


class CheckpointError(Exception):
    """The checkpoint cannot be served; the message names each offending file or tensor."""


@dataclass(frozen=True)
class ModelInfo:
    config: DeepseekConfig
    has_mtp: bool
    num_mtp_layers: int
    model_type: str
    path: Path
    dtype: torch.dtype
    quantization: str | None   # "fp8" when block-FP8 weights were dequantised at load


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> tuple[DeepseekV3ForCausalLM, ModelInfo]:
    """Load model weights; dtype None means the checkpoint's ``torch_dtype``."""
    start = time.perf_counter()
    path = Path(path)
    cfg = read_config(path)
    if dtype is None:
        dtype = _DTYPES[cfg.torch_dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"dtype {dtype} is not supported; allowed: float32, bfloat16, float16")
    block = _fp8_block(cfg, path)
    where = _tensor_index(path)                                  # tensor name -> file name

    n = cfg.num_hidden_layers
    num_mtp = 0
    while num_mtp < cfg.num_nextn_predict_layers and any(
        k.startswith(f"model.layers.{n + num_mtp}.") for k in where
    ):
        num_mtp += 1
    if cfg.num_nextn_predict_layers and num_mtp < cfg.num_nextn_predict_layers:
        logger.warning("%s: config has %d MTP layer(s) but the weights hold %d; %s", path,
                       cfg.num_nextn_predict_layers, num_mtp,
                       "MTP is unavailable" if num_mtp == 0 else "using those present")

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg, num_mtp_layers=num_mtp)
    expected = dict(model.named_parameters())                  # tied duplicates appear once
    optional = {f"model.layers.{n + j}.shared_head.head.weight" for j in range(num_mtp)}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    errors: list[str] = []
    by_file: dict[str, list[str]] = {}
    for name in expected:
        if name in where:
            by_file.setdefault(where[name], []).append(name)
        elif name not in optional:
            errors.append(f"missing tensor {name} (not in {_listing(path)})")
    missing_files = sorted(f for f in by_file if not (path / f).is_file())
    for f in missing_files:
        errors.append(f"file {path / f} listed in {INDEX_FILE} does not exist (holds e.g. {by_file.pop(f)[0]})")

    loaded: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    quantized = False
    with contextlib.ExitStack() as stack:
        handles: dict[str, object] = {}

        def get(name: str) -> torch.Tensor:
            file = where[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(path / file), framework="pt", device="cpu"))
            consumed.add(name)
            return handles[file].get_tensor(name)  # type: ignore[attr-defined]

        files = sorted(by_file)
        for i, file in enumerate(files, 1):
            for name in by_file[file]:
                try:
                    t = get(name)
                except Exception as e:  # unreadable tensor data
                    errors.append(f"tensor {name} in {file}: cannot be read ({e})")
                    continue
                if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    scale_name = name[: -len("weight")] + "weight_scale_inv"
                    if scale_name not in where:
                        errors.append(f"tensor {name} in {file} is {t.dtype} but {scale_name} is missing")
                        continue
                    try:
                        t = dequantize_fp8(t, get(scale_name), torch.float32, block)
                    except ValueError as e:
                        errors.append(f"tensor {scale_name} in {where[scale_name]}: {e}")
                        continue
                    quantized = True
                want = tuple(expected[name].shape)
                if tuple(t.shape) != want:
                    errors.append(f"tensor {name} in {file}: shape {tuple(t.shape)}, expected {want}")
                    continue
                target = torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype
                loaded[name] = t.to(device=device, dtype=target)
            logger.info("loaded shard %d/%d %s (%d tensors, %d/%d total)", i, len(files), file,
                        len(by_file[file]), len(loaded), len(expected))
    if errors:
        raise CheckpointError(f"checkpoint {path} is not loadable ({len(errors)} problem(s)):\n  "
                              + "\n  ".join(errors))

    for name, t in loaded.items():
        prefix, _, attr = name.rpartition(".")
        setattr(model.get_submodule(prefix), attr, nn.Parameter(t, requires_grad=False))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name in optional - loaded.keys():
        # No own head in the checkpoint: the MTP head is the main lm_head (DeepSeek shares it).
        model.get_submodule(name.rsplit(".", 1)[0]).weight = model.lm_head.weight
    leftover = [k for k, p in model.named_parameters() if p.is_meta]
    if leftover:  # cannot happen unless the name mapping above is wrong
        raise CheckpointError(f"checkpoint {path}: parameters left unloaded: {', '.join(leftover)}")
    model.eval()

    ignored = [k for k in where if k not in consumed and not k.endswith("weight_scale_inv")]
    if ignored:
        logger.info("ignored %d checkpoint tensor(s) the model does not use, e.g. %s", len(ignored),
                    ", ".join(sorted(ignored)[:5]))
    if num_mtp == 0:
        logger.warning("%s: no MTP layer loaded; MTP speculative decoding is unavailable", path)
    logger.info("loaded %s (%s, %d layers + %d MTP, %s%s) in %.1fs", path, cfg.model_type, n, num_mtp,
                str(dtype).removeprefix("torch."), ", fp8 dequantised" if quantized else "",
                time.perf_counter() - start)
    info = ModelInfo(config=cfg, has_mtp=num_mtp > 0, num_mtp_layers=num_mtp, model_type=cfg.model_type,
                     path=path, dtype=dtype, quantization="fp8" if quantized else None)
    return model, info


def read_config(path: str | Path) -> DeepseekConfig:
    """config.json -> DeepseekConfig, or CheckpointError naming the file and the problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: missing config.json (a Hugging Face checkpoint needs one)")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: cannot be read as JSON ({e})") from e
    try:
        return DeepseekConfig.from_hf(raw)
    except UnsupportedConfigError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e


def _fp8_block(cfg: DeepseekConfig, path: Path) -> int:
    q = cfg.extra.get("quantization_config") or {}
    size = q.get("weight_block_size") or [BLOCK, BLOCK]
    if q and q.get("quant_method") not in (None, "fp8"):
        raise CheckpointError(f"{path / 'config.json'}: quantization_config.quant_method "
                              f"{q.get('quant_method')!r} is not supported; allowed: fp8")
    if len(size) != 2 or size[0] != size[1]:
        raise CheckpointError(f"{path / 'config.json'}: weight_block_size {size} is not supported; "
                              "allowed: square blocks such as [128, 128]")
    return int(size[0])


def _tensor_index(path: Path) -> dict[str, str]:
    """Map every tensor name to the file holding it (single file or sharded index)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        return dict(weight_map)
    single = path / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{path}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE})")
    try:
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return {k: SINGLE_FILE for k in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{single}: not a readable safetensors file ({e})") from e


def _listing(path: Path) -> str:
    return INDEX_FILE if (path / INDEX_FILE).is_file() else SINGLE_FILE
