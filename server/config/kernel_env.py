"""The CPU kernels' environment variables: parsed and checked here, torch-free, so that
``--check`` and the start refuse a bad value before anything loads
(server/model/kernels/settings.py reads them for the loader).

An operator forces a product backend the same way a test does: ``MTP_SERVE_INT8_BACKEND``
for int8 weights, ``MTP_SERVE_HALF_BACKEND`` for 16-bit ones (docs/config.md).  "auto"
leaves the choice to capability and measurement (server/model/kernels/choice.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

INT8_ENV = "MTP_SERVE_INT8_BACKEND"
HALF_ENV = "MTP_SERVE_HALF_BACKEND"
KERNEL_ENV = "MTP_SERVE_HALF_KERNEL"            # 0: never build or use our C kernels
KERNEL_CACHE_ENV = "MTP_SERVE_KERNEL_CACHE"     # where it is built (~/.cache/mtp-serve/kernels)
DRAFT_HEAD_ENV = "MTP_SERVE_DRAFT_HEAD"         # the MTP drafts' head (engine/spec/draft_head.py)
# auto: an int8 copy where the head is 16-bit and an int8 kernel of ours serves this CPU;
# model: the model's own head; int8: an int8 copy wherever an int8 backend runs.
DRAFT_HEADS = ("auto", "model", "int8")
DRAFT_LAYER_ENV = "MTP_SERVE_DRAFT_LAYER"       # the MTP layer's weights (engine/spec/draft_layer.py)
# auto: int8 where the layer is 16-bit and an int8 kernel of ours serves this CPU; model:
# as loaded; int8: int8 wherever the layer's products are float.  Same values as the head's.
DRAFT_LAYERS = DRAFT_HEADS
GREEDY_HEAD_ENV = "MTP_SERVE_GREEDY_HEAD"       # greedy steps' head (engine/sample/screened_head.py)
# auto: screen through an int8 copy where the argmax stays exact and the int8 kernel is
# ours; model: always the whole head.
GREEDY_HEADS = ("auto", "model")

# int_mm: torch._int_mm (oneDNN, VNNI/AMX); int8pack: torch._weight_int8pack_mm (16-bit
# models); avx2: half_avx2.c's int8 product; vnni: avx512_vnni.c's; float: the exact
# float32 path.
INT8_BACKENDS = ("int_mm", "int8pack", "avx2", "vnni", "float")
# onednn: torch's own F.linear; avx512: avx512_bf16.c (bf16 weights; oneDNN for prompts);
# avx2: half_avx2.c (and float32 GEMMs for many rows); float32: float32 GEMMs and fused
# reductions without a kernel.
HALF_BACKENDS = ("onednn", "avx512", "avx2", "float32")
_NATIVE = ("avx2", "avx512", "vnni")      # backends that are our own C kernels


class KernelSettingError(ValueError):
    """An environment variable of the kernels holds a value outside its allowed set."""


@dataclass(frozen=True)
class KernelSettings:
    int8_backend: str = "auto"
    half_backend: str = "auto"
    half_kernel: bool = True
    kernel_cache: Path = Path.home() / ".cache" / "mtp-serve" / "kernels"
    draft_head: str = "auto"
    draft_layer: str = "auto"
    greedy_head: str = "auto"


@dataclass(frozen=True)
class Problem:
    variable: str
    value: str
    allowed: str
    message: str

    def __str__(self) -> str:
        return f"${self.variable}={self.value!r}; {self.message}; allowed: {self.allowed}"


def problems(env: Mapping[str, str]) -> list[Problem]:
    """Every kernel variable of ``env`` outside its allowed set, and every contradiction."""
    out = []
    for name, allowed in ((INT8_ENV, INT8_BACKENDS), (HALF_ENV, HALF_BACKENDS)):
        raw = env.get(name, "").strip().lower()
        if raw and raw not in ("auto",) + allowed:
            out.append(Problem(name, raw, "auto, " + ", ".join(allowed), "not a backend"))
    for name, allowed, what in ((DRAFT_HEAD_ENV, DRAFT_HEADS, "a draft head"),
                                (DRAFT_LAYER_ENV, DRAFT_LAYERS, "a draft layer form"),
                                (GREEDY_HEAD_ENV, GREEDY_HEADS, "a greedy head")):
        raw = env.get(name, "").strip().lower()
        if raw and raw not in allowed:
            out.append(Problem(name, raw, ", ".join(allowed), "not " + what))
    kernel = env.get(KERNEL_ENV, "1").strip()
    if kernel not in ("0", "1"):
        out.append(Problem(KERNEL_ENV, kernel, "1 (build half_avx2.c), 0 (never)", "not a switch"))
    for name in (INT8_ENV, HALF_ENV):
        asked = env.get(name, "").strip().lower()
        if kernel == "0" and asked in _NATIVE:
            out.append(Problem(KERNEL_ENV, kernel, f"1, or another ${name}",
                               f"forbids the kernel that ${name}={asked} asks for"))
    return out


def parse(env: Mapping[str, str]) -> KernelSettings:
    """``KernelSettings`` from an environment; KernelSettingError naming every bad value."""
    found = problems(env)
    if found:
        raise KernelSettingError("; ".join(map(str, found)))
    cache = env.get(KERNEL_CACHE_ENV, "").strip()
    return KernelSettings(env.get(INT8_ENV, "").strip().lower() or "auto",
                          env.get(HALF_ENV, "").strip().lower() or "auto",
                          env.get(KERNEL_ENV, "1").strip() != "0",
                          Path(cache) if cache else KernelSettings.kernel_cache,
                          env.get(DRAFT_HEAD_ENV, "").strip().lower() or "auto",
                          env.get(DRAFT_LAYER_ENV, "").strip().lower() or "auto",
                          env.get(GREEDY_HEAD_ENV, "").strip().lower() or "auto")
