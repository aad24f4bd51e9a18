"""Load a Hugging Face DeepSeek-V3/V2 checkpoint directory into DeepseekV3ForCausalLM.

Reads ``config.json`` and ``model.safetensors`` (or the shards listed by
``model.safetensors.index.json``) through memory-mapped ``safe_open``. The model is built
on the meta device and each parameter is replaced by the loaded tensor, so nothing is
randomly initialised first. FP8 block-quantised weights (``weight_scale_inv``) are
dequantised on the way in. Int8 checkpoints (msModelSlim's W8A8 / W8A8_DYNAMIC /
W4A8_DYNAMIC, compressed-tensors int8; quant_loader.py) keep their layers in int8
(QuantLinear). Every missing, mis-typed or mis-shaped tensor is collected and reported at
once in one CheckpointError; an integer tensor nothing describes as quantized is refused,
never cast to float.
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

from server.model import bf16_cpu, kernels
from server.model.config import TORCH_DTYPES, DeepseekConfig, UnsupportedConfigError
from server.model.deepseek_v3 import DeepseekV3ForCausalLM
from server.model.fp8 import BLOCK, dequantize_fp8
from server.model.layers import column_major
from server.model.meta import meta_device
from server.model.parallel import ParallelPlan, ShardError, TensorSlice, shard_model
from server.model.quant import QuantLinear, fastest_int8_backend
from server.model.quant_shard import QuantShard, QuantShardError, shard_spec
from server.model.quant_loader import (QuantConfigError, check_fa_scales, detect, install,
                                      load_layers)

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
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
    quantization: str | None   # "fp8" when block-FP8 weights were dequantised at load;
                               # the int8 scheme and its layer counts otherwise


def heads_by_columns(model: DeepseekV3ForCausalLM) -> None:
    """Hold the vocabulary heads column-major (layers.column_major): a decode step
    multiplies 1 to 1 + k rows by them.  On the demo model the main logits of a step took
    0.066 ms instead of 0.138 ms, and a k=1 step (two head products) 4.17 ms instead of
    4.38.  Not a head tied to the embedding, whose row lookups want the row-major table;
    the MTP head that is the main one is changed once."""
    heads = {id(h.weight): h for h in [model.lm_head] + [
        model.model.layers[model.config.num_hidden_layers + j].shared_head.head
        for j in range(model.num_mtp_layers)]}
    for head in heads.values():
        if type(head) is nn.Linear and head.weight is not model.model.embed_tokens.weight:
            with torch.no_grad():
                head.weight.data = column_major(head.weight.data)


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu",
                    int8_backend: str = "auto",
                    plan: ParallelPlan | None = None) -> tuple[DeepseekV3ForCausalLM, ModelInfo]:
    """Load model weights; dtype None means the checkpoint's ``torch_dtype``.

    ``plan`` (tensor/expert parallel): build and load only that rank's shard, reading each
    sharded tensor's slice through ``safe_open(...).get_slice`` (parallel.py says which).

    ``int8_backend`` (int8 checkpoints): "int_mm" (torch._int_mm), "float" (the same exact
    integer products through a float GEMM), "avx2" (the same through our AVX2 kernel),
    "int8pack" (16-bit models: those products rounded to bf16) or "auto" (the fastest for
    ``dtype``, measured once: server/model/quant.py)."""
    start = time.perf_counter()
    path = Path(path)
    cfg = read_config(path)
    if dtype is None:
        dtype = TORCH_DTYPES[cfg.torch_dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"dtype {dtype} is not supported; allowed: float32, bfloat16, float16")
    int8_backend = _int8_backend(int8_backend, dtype)
    block = _fp8_block(cfg, path)
    where = _tensor_index(path)                                  # tensor name -> file name

    n = cfg.num_hidden_layers
    num_mtp = _num_mtp_layers(cfg, where)
    if cfg.num_nextn_predict_layers and num_mtp < cfg.num_nextn_predict_layers:
        logger.warning("%s: config has %d MTP layer(s) but the weights hold %d; %s", path,
                       cfg.num_nextn_predict_layers, num_mtp,
                       "MTP is unavailable" if num_mtp == 0 else "using those present")

    with meta_device():
        model = DeepseekV3ForCausalLM(cfg, num_mtp_layers=num_mtp)
    try:
        if bf16_cpu.pays(dtype, torch.device(device).type):
            bf16_cpu.install()                   # prompts' rows as float32 GEMMs (bf16_cpu.py)
    except (kernels.BackendUnavailable, kernels.KernelSettingError) as e:
        raise CheckpointError(str(e)) from e
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        spec = detect(path, cfg.extra, linears)
    except QuantConfigError as e:
        raise CheckpointError(str(e)) from e
    slices: dict[str, TensorSlice] = {}
    shard: QuantShard | None = None
    if plan is not None and plan.world_size > 1:
        try:
            slices = shard_model(model, plan)
            if spec is not None:
                local = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
                shard = shard_spec(spec, slices, local, plan)
                spec = shard.spec
        except (ShardError, QuantShardError) as e:
            raise CheckpointError(f"{path}: cannot be split over {plan.world_size} ranks "
                                  f"(moe_tp {plan.moe_tp}, moe_ep {plan.moe_ep}): {e}") from e
    model.parallel_plan = plan if plan is not None and plan.world_size > 1 else None
    if spec is not None:
        if int8_backend == "auto":
            int8_backend = fastest_int8_backend(device, dtype)
        install(model, spec, int8_backend, shard.row_parallel if shard else frozenset())
    expected = dict(model.named_parameters())                  # tied duplicates appear once
    if spec is not None:                                       # loaded by quant_loader below
        for name in [n for n in expected if n.rpartition(".")[0] in spec.layer_types]:
            del expected[name]
    optional = {f"model.layers.{n + j}.shared_head.head.weight" for j in range(num_mtp)}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    errors: list[str] = []
    by_file: dict[str, list[str]] = {}
    for name in expected:
        src = slices[name].source if name in slices else name
        if src in where:
            by_file.setdefault(where[src], []).append(name)
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

        def read(name: str, sl: TensorSlice | None) -> torch.Tensor:
            """Checkpoint tensor ``name``, or only its slice ``sl``.  FP8 tensors are read
            whole (their scales cover 128 x 128 blocks) and cut by the caller."""
            if sl is None:
                return get(name)
            file = where[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(path / file), framework="pt", device="cpu"))
            consumed.add(name)
            part = handles[file].get_slice(name)  # type: ignore[attr-defined]
            if part.get_dtype() in ("F8_E4M3", "F8_E5M2"):
                return get(name)
            return part[sl.index(len(part.get_shape()))]

        def get_param(name: str) -> torch.Tensor:
            """The tensor parameter ``name`` loads: a slice of its source under a plan."""
            sl = slices.get(name)
            return get(name) if sl is None else read(sl.source, sl)

        files = sorted(by_file)
        for i, file in enumerate(files, 1):
            for name in by_file[file]:
                try:
                    t = get_param(name)
                except Exception as e:  # unreadable tensor data
                    errors.append(f"tensor {name} in {file}: cannot be read ({e})")
                    continue
                if not (t.dtype.is_floating_point or t.dtype.is_complex):
                    errors.append(f"tensor {name} in {file} is {t.dtype}, but nothing describes it as "
                                  "quantized (no quant_model_description*.json entry or "
                                  "quantization_config); refusing to cast it to float")
                    continue
                if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    src = slices[name].source if name in slices else name
                    scale_name = src[: -len("weight")] + "weight_scale_inv"
                    if scale_name not in where:
                        errors.append(f"tensor {name} in {file} is {t.dtype} but {scale_name} is missing")
                        continue
                    try:
                        t = dequantize_fp8(t, get(scale_name), torch.float32, block)
                    except ValueError as e:
                        errors.append(f"tensor {scale_name} in {where[scale_name]}: {e}")
                        continue
                    quantized = True
                    if name in slices:
                        t = t[slices[name].index(t.dim())]
                want = tuple(expected[name].shape)
                if tuple(t.shape) != want:
                    errors.append(f"tensor {name} in {file}: shape {tuple(t.shape)}, expected {want}")
                    continue
                target = torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype
                # A column slice read through get_slice is a view of the whole rows: copied,
                # so the rank holds only its slice (and the compiled graphs' strides).
                loaded[name] = t.to(device=device, dtype=target).contiguous()
            logger.info("loaded shard %d/%d %s (%d tensors, %d/%d total)", i, len(files), file,
                        len(by_file[file]), len(loaded), len(expected))
        if spec is not None:
            check_fa_scales(spec, cfg.num_attention_heads, get, where.__contains__, errors)
            qget, qhas = shard.reader(read, where.__contains__) if shard else (get, where.__contains__)
            for name, t in load_layers(model, spec, qget, qhas, device, errors).items():
                loaded[name] = t.to(dtype) if t.is_floating_point() and not isinstance(
                    model.get_submodule(name.rpartition(".")[0]), QuantLinear) else t
    if errors:
        raise CheckpointError(f"checkpoint {path} is not loadable ({len(errors)} problem(s)):\n  "
                              + "\n  ".join(errors))

    for name, t in loaded.items():
        prefix, _, attr = name.rpartition(".")
        setattr(model.get_submodule(prefix), attr, nn.Parameter(t, requires_grad=False))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name in optional:
        # No own head in the checkpoint, or a copy equal to lm_head (DeepSeek's released MTP
        # layers carry one): the MTP head is the main lm_head, held once (1.85 GB in bf16
        # for DeepSeek-V3).
        head = model.get_submodule(name.rsplit(".", 1)[0])
        own = loaded.get(name)
        lm = model.lm_head.weight
        if own is None or (own.shape == lm.shape and own.dtype == lm.dtype and torch.equal(own, lm)):
            head.weight = lm
    if spec is not None:
        model.kv_cache_int8_layers = frozenset(i for i in spec.fa_layers if i < n + num_mtp)
    leftover = [k for k, p in model.named_parameters() if p.is_meta]
    if leftover:  # cannot happen unless the name mapping above is wrong
        raise CheckpointError(f"checkpoint {path}: parameters left unloaded: {', '.join(leftover)}")
    model.eval()
    heads_by_columns(model)
    moved = kernels.align_module(model)     # kernels/alignment.py: a crash is no way to learn a rule
    if moved:
        logger.info("%d tensor(s) moved to 64-byte aligned storage", moved)

    ignored = [k for k in where if k not in consumed and not k.endswith("weight_scale_inv")]
    if ignored and slices:
        logger.info("rank %d of %d: %d checkpoint tensor(s) belong to other ranks or are unused",
                    plan.rank, plan.world_size, len(ignored))
    elif ignored:
        logger.info("ignored %d checkpoint tensor(s) the model does not use, e.g. %s", len(ignored),
                    ", ".join(sorted(ignored)[:5]))
    if num_mtp == 0:
        logger.warning("%s: no MTP layer loaded; MTP speculative decoding is unavailable", path)
    logger.info("loaded %s (%s, %d layers + %d MTP, %s%s) in %.1fs", path, cfg.model_type, n, num_mtp,
                str(dtype).removeprefix("torch."), ", fp8 dequantised" if quantized else "",
                time.perf_counter() - start)
    if spec is not None:
        logger.info("quantized checkpoint: %s; int8 GEMM backend %s", spec.describe(), int8_backend)
    info = ModelInfo(config=cfg, has_mtp=num_mtp > 0, num_mtp_layers=num_mtp, model_type=cfg.model_type,
                     path=path, dtype=dtype,
                     quantization=spec.describe() if spec is not None else ("fp8" if quantized else None))
    return model, info


def _int8_backend(asked: str, dtype: torch.dtype) -> str:
    """The int8 backend to load with: ``asked``, or for "auto" $MTP_SERVE_INT8_BACKEND where
    set (still "auto" otherwise: measured once the device is known), checked against what
    this CPU and a model of ``dtype`` can run (kernels/choice.py)."""
    try:
        if asked == "auto":
            asked = kernels.kernel_settings().int8_backend
        if asked == "auto":
            return asked
        half = dtype in (torch.bfloat16, torch.float16)
        kernel = asked == "avx2" and bf16_cpu.half_kernel() is not None
        return kernels.forced_int8_backend(asked, kernels.cpu_caps(), half, kernel)
    except (kernels.BackendUnavailable, kernels.KernelSettingError) as e:
        raise CheckpointError(str(e)) from e


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
    return CheckpointSummary(cfg, _num_mtp_layers(cfg, _tensor_index(path)), path)


def _num_mtp_layers(cfg: DeepseekConfig, where: dict[str, str]) -> int:
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


def _fp8_block(cfg: DeepseekConfig, path: Path) -> int:
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


def _listing(path: Path) -> str:
    return INDEX_FILE if (path / INDEX_FILE).is_file() else SINGLE_FILE
