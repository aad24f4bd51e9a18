"""Load a Hugging Face DeepSeek-V3/V2 checkpoint directory into DeepseekV3ForCausalLM.

Reads ``config.json`` and ``model.safetensors`` (or the shards listed by
``model.safetensors.index.json``) through memory-mapped ``safe_open``, in three steps:
plan (plan.py: the model built on the meta device, a rank's shard, the int8 layers, which
file holds each tensor), read (read.py) and install (install.py), so nothing is randomly
initialised first. FP8 block-quantised weights (``weight_scale_inv``) are dequantised on
the way in. Int8 checkpoints (msModelSlim's W8A8 / W8A8_DYNAMIC / W4A8_DYNAMIC,
compressed-tensors int8; quant/formats.py) keep their layers in int8 (QuantLinear). Every
missing, mis-typed or mis-shaped tensor is collected and reported at once in one
CheckpointError; an integer tensor nothing describes as quantized is refused, never cast
to float.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from server.model.config import TORCH_DTYPES, DeepseekConfig
from server.model.deepseek_v3 import DeepseekV3ForCausalLM
from server.model.loading.files import CheckpointError, read_config
from server.model.loading.install import install_weights
from server.model.loading.plan import LoadPlan, plan_load
from server.model.loading.read import read_tensors
from server.model.parallel.plan import ParallelPlan

logger = logging.getLogger("server.model.loading")


@dataclass(frozen=True)
class ModelInfo:
    config: DeepseekConfig
    has_mtp: bool
    num_mtp_layers: int
    model_type: str
    path: Path
    dtype: torch.dtype
    quantization: str | None   # "fp8" when block-FP8 weights were dequantised at load;
                               # the int8 scheme and its layer counts otherwise


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu",
                    int8_backend: str = "auto",
                    plan: ParallelPlan | None = None) -> tuple[DeepseekV3ForCausalLM, ModelInfo]:
    """Load model weights; dtype None means the checkpoint's ``torch_dtype``.

    ``plan`` (tensor/expert parallel): build and load only that rank's shard, reading each
    sharded tensor's slice through ``safe_open(...).get_slice`` (parallel/plan.py says which).

    ``int8_backend`` (int8 checkpoints): "int_mm" (torch._int_mm), "float" (the same exact
    integer products through a float GEMM), "avx2" (the same through our AVX2 kernel),
    "int8pack" (16-bit models: those products rounded to bf16) or "auto"
    ($MTP_SERVE_INT8_BACKEND, else the fastest for ``dtype``, measured once: quant/int8.py)."""
    start = time.perf_counter()
    path = Path(path)
    cfg = read_config(path)
    if dtype is None:
        dtype = TORCH_DTYPES[cfg.torch_dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"dtype {dtype} is not supported; allowed: float32, bfloat16, float16")
    lp = plan_load(path, cfg, dtype, torch.device(device), int8_backend, plan)
    if lp.num_mtp_layers < cfg.num_nextn_predict_layers:
        logger.warning("%s: config has %d MTP layer(s) but the weights hold %d; %s", path,
                       cfg.num_nextn_predict_layers, lp.num_mtp_layers,
                       "MTP is unavailable" if lp.num_mtp_layers == 0 else "using those present")
    loaded, consumed, dequantised = read_tensors(lp)
    if lp.errors:
        raise CheckpointError(f"checkpoint {path} is not loadable ({len(lp.errors)} problem(s)):\n  "
                              + "\n  ".join(lp.errors))
    model = install_weights(lp, loaded)
    _log_loaded(lp, consumed, dequantised, time.perf_counter() - start)
    quantization = lp.spec.describe() if lp.spec is not None else ("fp8" if dequantised else None)
    return model, ModelInfo(config=cfg, has_mtp=lp.num_mtp_layers > 0, num_mtp_layers=lp.num_mtp_layers,
                            model_type=cfg.model_type, path=path, dtype=dtype, quantization=quantization)


def _log_loaded(lp: LoadPlan, consumed: set[str], dequantised: bool, seconds: float) -> None:
    ignored = [k for k in lp.where if k not in consumed and not k.endswith("weight_scale_inv")]
    plan = lp.model.parallel_plan
    if ignored and plan is not None:
        logger.info("rank %d of %d: %d checkpoint tensor(s) belong to other ranks or are unused",
                    plan.rank, plan.world_size, len(ignored))
    elif ignored:
        logger.info("ignored %d checkpoint tensor(s) the model does not use, e.g. %s", len(ignored),
                    ", ".join(sorted(ignored)[:5]))
    if lp.num_mtp_layers == 0:
        logger.warning("%s: no MTP layer loaded; MTP speculative decoding is unavailable", lp.path)
    cfg = lp.config
    logger.info("loaded %s (%s, %d layers + %d MTP, %s%s) in %.1fs; products %s", lp.path,
                cfg.model_type, cfg.num_hidden_layers, lp.num_mtp_layers,
                str(lp.dtype).removeprefix("torch."), ", fp8 dequantised" if dequantised else "",
                seconds, lp.model.products.name)
    if lp.spec is not None:
        logger.info("quantized checkpoint: %s; int8 GEMM backend %s", lp.spec.describe(), lp.int8_backend)
