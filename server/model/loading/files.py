"""A checkpoint folder's files: config.json, the tensor index, the MTP layers it holds.
Nothing here reads a weight."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from server.model.config import DeepseekConfig, UnsupportedConfigError
from server.model.quant.fp8 import BLOCK

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(Exception):
    """The checkpoint cannot be served; the message names each offending file or tensor."""


@dataclass(frozen=True)
class CheckpointSummary:
    """What the engine's own process needs of a checkpoint whose weights live with the
    ranks of a parallel group (executor/parallel.py): shapes and the MTP layer count."""

    config: DeepseekConfig
    num_mtp_layers: int
    path: Path

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0

    @property
    def num_kv_layers(self) -> int:
        return self.config.num_hidden_layers + self.num_mtp_layers


def inspect_checkpoint(path: str | Path) -> CheckpointSummary:
    """Read config.json and the tensor index only (no weights)."""
    path = Path(path)
    cfg = read_config(path)
    return CheckpointSummary(cfg, num_mtp_layers(cfg, tensor_index(path)), path)


def num_mtp_layers(cfg: DeepseekConfig, where: dict[str, str]) -> int:
    """MTP layers the config declares and the weights hold (the first missing one ends it)."""
    n, num_mtp = cfg.num_hidden_layers, 0
    while num_mtp < cfg.num_nextn_predict_layers and any(
        k.startswith(f"model.layers.{n + num_mtp}.") for k in where
    ):
        num_mtp += 1
    return num_mtp


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


def fp8_block(cfg: DeepseekConfig, path: Path) -> int:
    """The FP8 weights' square block size (config.json's quantization_config)."""
    q = cfg.extra.get("quantization_config") or {}
    size = q.get("weight_block_size") or [BLOCK, BLOCK]
    if q and q.get("quant_method") not in (None, "fp8", "compressed-tensors"):
        raise CheckpointError(f"{path / 'config.json'}: quantization_config.quant_method "
                              f"{q.get('quant_method')!r} is not supported; allowed: fp8, "
                              "compressed-tensors (int8)")
    if len(size) != 2 or size[0] != size[1]:
        raise CheckpointError(f"{path / 'config.json'}: weight_block_size {size} is not supported; "
                              "allowed: square blocks such as [128, 128]")
    return int(size[0])


def tensor_index(path: Path) -> dict[str, str]:
    """Map every tensor name to the file holding it (single file or sharded index)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        return dict(weight_map)
    single = path / SINGLE_FILE
    # msModelSlim names its weight files quant_model_weight(s)*.safetensors.
    files = [single] if single.is_file() else sorted(path.glob("quant_model_weight*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no weights found (expected {SINGLE_FILE}, {INDEX_FILE} "
                              "or msModelSlim's quant_model_weight*.safetensors)")
    out: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                out.update({k: file.name for k in f.keys()})
        except Exception as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
    return out


def listing(path: Path) -> str:
    return INDEX_FILE if (path / INDEX_FILE).is_file() else SINGLE_FILE
