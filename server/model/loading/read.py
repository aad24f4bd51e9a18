"""Reading a planned load's tensors (plan.py) from the checkpoint's safetensors files,
through memory-mapped ``safe_open``: a rank reads only its slice of a sharded tensor,
FP8 block-quantised weights are dequantised on the way in, and every missing, mis-typed
or mis-shaped tensor is collected, not raised one at a time."""
from __future__ import annotations

import contextlib
import logging

import torch
from safetensors import safe_open

from server.model.loading.plan import LoadPlan
from server.model.parallel.plan import TensorSlice
from server.model.quant.formats import check_fa_scales, load_layers
from server.model.quant.fp8 import dequantize_fp8
from server.model.quant.linear import QuantLinear

logger = logging.getLogger("server.model.loading")
# Routing stays in float32 whatever the model dtype (as the reference implementations keep it).
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class Reader:
    """The checkpoint's files, opened once each for the reads of one load."""

    def __init__(self, lp: LoadPlan, stack: contextlib.ExitStack) -> None:
        self.lp, self.stack = lp, stack
        self.handles: dict[str, object] = {}
        self.consumed: set[str] = set()
        self.fp8_seen = False

    def _handle(self, name: str):
        file = self.lp.where[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(
                safe_open(str(self.lp.path / file), framework="pt", device="cpu"))
        self.consumed.add(name)
        return self.handles[file]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)  # type: ignore[attr-defined]

    def read(self, name: str, sl: TensorSlice | None) -> torch.Tensor:
        """Checkpoint tensor ``name``, or only its slice ``sl``.  FP8 tensors are read
        whole (their scales cover 128 x 128 blocks) and cut by the caller."""
        if sl is None:
            return self.get(name)
        part = self._handle(name).get_slice(name)  # type: ignore[attr-defined]
        if part.get_dtype() in ("F8_E4M3", "F8_E5M2"):
            return self.get(name)
        return part[sl.index(len(part.get_shape()))]

    def parameter(self, name: str) -> torch.Tensor:
        """The tensor parameter ``name`` loads: a slice of its source under a plan."""
        sl = self.lp.slices.get(name)
        return self.get(name) if sl is None else self.read(sl.source, sl)


def read_tensors(lp: LoadPlan) -> tuple[dict[str, torch.Tensor], set[str], bool]:
    """(parameter name -> tensor in its serving dtype, checkpoint tensors read, whether any
    FP8 weight was dequantised); problems go to ``lp.errors``."""
    loaded: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        reader = Reader(lp, stack)
        files = sorted(lp.by_file)
        for i, file in enumerate(files, 1):
            for name in lp.by_file[file]:
                t = _float_tensor(lp, reader, name, file)
                if t is None:
                    continue
                target = torch.float32 if name.endswith(FP32_SUFFIXES) else lp.dtype
                # A column slice read through get_slice is a view of the whole rows: copied,
                # so the rank holds only its slice (and the compiled graphs' strides).
                loaded[name] = t.to(device=lp.device, dtype=target).contiguous()
            logger.info("loaded shard %d/%d %s (%d tensors, %d/%d total)", i, len(files), file,
                        len(lp.by_file[file]), len(loaded), len(lp.expected))
        if lp.spec is not None:
            loaded.update(_int8_tensors(lp, reader))
    return loaded, reader.consumed, reader.fp8_seen


def _float_tensor(lp: LoadPlan, reader: Reader, name: str, file: str) -> torch.Tensor | None:
    """Parameter ``name`` as the checkpoint holds it (FP8 dequantised to float32), or None
    with the problem in ``lp.errors``."""
    try:
        t = reader.parameter(name)
    except Exception as e:  # unreadable tensor data
        lp.errors.append(f"tensor {name} in {file}: cannot be read ({e})")
        return None
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        lp.errors.append(f"tensor {name} in {file} is {t.dtype}, but nothing describes it as "
                         "quantized (no quant_model_description*.json entry or "
                         "quantization_config); refusing to cast it to float")
        return None
    if t.dtype in _FP8:
        src = lp.slices[name].source if name in lp.slices else name
        scale_name = src[: -len("weight")] + "weight_scale_inv"
        if scale_name not in lp.where:
            lp.errors.append(f"tensor {name} in {file} is {t.dtype} but {scale_name} is missing")
            return None
        try:
            t = dequantize_fp8(t, reader.get(scale_name), torch.float32, lp.fp8_block)
        except ValueError as e:
            lp.errors.append(f"tensor {scale_name} in {lp.where[scale_name]}: {e}")
            return None
        reader.fp8_seen = True
        if name in lp.slices:
            t = t[lp.slices[name].index(t.dim())]
    want = tuple(lp.expected[name].shape)
    if tuple(t.shape) != want:
        lp.errors.append(f"tensor {name} in {file}: shape {tuple(t.shape)}, expected {want}")
        return None
    return t


def _int8_tensors(lp: LoadPlan, reader: Reader) -> dict[str, torch.Tensor]:
    """The int8 layers' tensors (quant/formats.py reads and checks them), their float
    companions in the model dtype."""
    check_fa_scales(lp.spec, lp.config.num_attention_heads, reader.get, lp.where.__contains__, lp.errors)
    get, has = (lp.shard.reader(reader.read, lp.where.__contains__) if lp.shard
                else (reader.get, lp.where.__contains__))
    out = {}
    for name, t in load_layers(lp.model, lp.spec, get, has, lp.device, lp.errors).items():
        owner = lp.model.get_submodule(name.rpartition(".")[0])
        # A rank's column slice is a view of whole rows: copied, so kernels read it by rows.
        out[name] = (t.to(lp.dtype) if t.is_floating_point() and not isinstance(owner, QuantLinear)
                     else t).contiguous()
    return out
