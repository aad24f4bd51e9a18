"""An int8 checkpoint over tensor/expert-parallel ranks: which quantized layers a rank
holds, under its own names, and which slice of each checkpoint tensor it reads.

model/parallel.py cuts the float model and says, per parameter, which checkpoint tensor
and which slice of it a rank loads (``TensorSlice``); a rank's routed experts are
renumbered from 0.  A quantized layer brings companions (scales, offsets, biases): those
with one value per output row follow the weight's row slice; per-tensor ones, and
everything of a layer cut along its input features (row parallel: ``o_proj``, the dense
and shared ``down_proj``), are read whole.  W4A8 weights hold two output rows per byte,
so their row slice is halved.

Row-parallel int8 layers sum their integer products over the group (quant.QuantLinear),
so a rank's numbers are the one process's.  An expert cut within itself (``moe_tp > 1``)
would need that sum over the expert's own ranks only, which run it on a different token
subset than the rest of the group: refused, with the layout that works.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from server.model.parallel.plan import ParallelPlan, TensorSlice
from server.model.quant.formats import QuantSpec

# Companions with one value per output row of their layer.
PER_ROW = frozenset({"weight_scale", "weight_offset", "scale_bias", "deq_scale", "quant_bias", "bias"})
# Layers a rank holds whole under another, vocabulary-parallel module: never int8 here.
_VOCAB = ("embed_tokens", "lm_head", "shared_head.head")


class QuantShardError(ValueError):
    """The quantized checkpoint cannot be served over this layout; the message says why."""


@dataclasses.dataclass(frozen=True)
class QuantShard:
    """A rank's quantized layers: ``spec`` under local names, and the slices they load."""

    spec: QuantSpec
    slices: dict[str, TensorSlice]            # local "<prefix>.weight" -> checkpoint slice
    row_parallel: frozenset[str]              # layers holding a slice of their input features

    def source(self, name: str) -> tuple[str, TensorSlice | None]:
        """Local tensor name of a quantized layer -> (checkpoint name, slice to read or None
        for the whole tensor)."""
        prefix, _, part = name.rpartition(".")
        sl = self.slices.get(prefix + ".weight")
        if sl is None:
            return name, None
        src = sl.source[: -len("weight")] + part
        if part == "weight":
            if sl.dim == 0 and self.spec.layer_types.get(prefix) == "W4A8_DYNAMIC":
                return src, TensorSlice(src, 0, sl.start // 2, sl.stop // 2)
            return src, dataclasses.replace(sl, source=src)
        if part in PER_ROW and sl.dim == 0:
            return src, TensorSlice(src, 0, sl.start, sl.stop)
        return src, None

    def reader(self, read: Callable[[str, TensorSlice | None], torch.Tensor],
               exists: Callable[[str], bool]) -> tuple[Callable[[str], torch.Tensor], Callable[[str], bool]]:
        """``get``/``has`` over local names for quant_loader.load_layers."""
        def get(name: str) -> torch.Tensor:
            src, sl = self.source(name)
            return read(src, sl)

        def has(name: str) -> bool:
            return exists(self.source(name)[0])
        return get, has


def shard_spec(spec: QuantSpec, slices: dict[str, TensorSlice], local_linears: list[str],
               plan: ParallelPlan) -> QuantShard:
    """The quantized layers rank ``plan.rank`` holds (``local_linears``: the sharded model's
    linear layers), or QuantShardError for what the layout cannot serve exactly."""
    types: dict[str, str] = {}
    for prefix in local_linears:
        sl = slices.get(prefix + ".weight")
        src = sl.source[: -len(".weight")] if sl is not None else prefix
        if src in spec.layer_types:
            types[prefix] = spec.layer_types[src]
    problems = [f"{p}: {t}, but over {plan.world_size} ranks this layer is vocabulary "
                "parallel and served in float; allowed: FLOAT" for p, t in spec.layer_types.items()
                if p.endswith(_VOCAB)]
    row_parallel = set()
    for prefix in types:
        sl = slices.get(prefix + ".weight")
        if sl is None:
            continue
        expert = ".experts." in prefix
        if sl.dim == 1 and not (expert and plan.moe_tp == 1):   # moe_tp 1: experts whole
            row_parallel.add(prefix)
        if sl.dim == 1 and plan.dp > 1 and ".self_attn." in prefix:
            problems.append(f"{prefix}: an int8 attention layer cut over tp {plan.tp} ranks "
                            f"with dp {plan.dp} would sum its integers over the groups' "
                            "different tokens; serve int8 attention with dp and tp 1")
            break
        if sl.dim == 1 and plan.cp > 1 and ".self_attn." in prefix:
            problems.append(f"{prefix}: an int8 attention layer cut over tp {plan.tp} ranks "
                            f"with cp {plan.cp} would sum its integers over the cp ranks' "
                            "different tokens; serve int8 attention with cp 1")
            break
        if sl.dim == 1 and expert and plan.moe_tp > 1:
            problems.append(f"{prefix}: an int8 routed expert cut {plan.moe_tp} ways within "
                            f"itself (moe_tp {plan.moe_tp}) cannot be computed exactly; serve "
                            f"int8 experts whole: moe_tp 1, moe_ep {plan.world_size}")
            break
        if sl.dim == 0 and types[prefix] == "W4A8_DYNAMIC" and (sl.start % 2 or sl.stop % 2):
            problems.append(f"{prefix}: W4A8 rows [{sl.start}, {sl.stop}) split a packed byte")
    if problems:
        raise QuantShardError("; ".join(problems))
    kept = {p + ".weight": slices[p + ".weight"] for p in types if p + ".weight" in slices}
    return QuantShard(dataclasses.replace(spec, layer_types=types), kept, frozenset(row_parallel))
