"""Every weight a decode step reads in one allocation, in the order the step reads it.

Why: a CPU decode step is a stream of weight reads, split into a hundred-odd products a
few MB each.  Held as the loader and the worker leave them (a storage per tensor, wherever
the allocator put it, 4 KB pages), each product starts a new stream somewhere else in
memory; packed back to back in forward order on 2 MB pages, one product's weights follow
the last one's.  Measured on the 2-core Zen 4 (the same compiled step alternating with an
unpacked copy of the model in one process, 6-8 rounds): the 0.5b bf16 model's batch-1 step
1.21x and 1.15x (two runs), batch 8 1.12x, its W8A8 copy's batch-1 step 1.03x; packed on
4 KB pages instead, 1.03-1.08x at batch 1.

Nothing changes but where the bytes live: every tensor keeps its Python object, dtype,
shape, strides and offset inside its storage (views of one storage, such as a routed
expert's rows of its MoE's stack, stay views of one), so values and compiled graphs carry
on; a module whose caches are keyed on where its weights were has ``weights_moved()``
called.  Storages are copied one at a time and the old ones handed back every
``TRIM_EVERY`` bytes, so the resident memory does not double while packing (0.5b model:
1481 MB before and after, 1759 at the peak).

``$MTP_SERVE_WEIGHT_ARENA=0`` leaves the weights where they are.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import logging
import os
import sys

import torch
from torch import nn

from server.model.kernels.alignment import ALIGNMENT

log = logging.getLogger("server.model.loading")

ENV = "MTP_SERVE_WEIGHT_ARENA"
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
# Bytes copied between two hand-backs of the freed storages: the resident memory stays
# within this of the model's size while packing (glibc keeps freed blocks below 32 MB).
TRIM_EVERY = 256 << 20


@dataclasses.dataclass(frozen=True)
class Packed:
    """What ``pack_weights`` did: storages moved, their bytes, on huge pages or not."""

    storages: int
    nbytes: int
    huge_pages: bool


def enabled() -> bool:
    """Unset or on (1/true/on/yes): pack; 0/false/off/no: leave the weights (the config
    loader refuses other values)."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "off", "no")


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model's modules hold (parameters, buffers, and tensors kept as
    attributes or in tuples of them, such as a MoE's expert stacks), each once, in module
    order: the order a forward pass reads them.  Not inference tensors (made inside
    inference mode, e.g. a cache a forward built): they cannot be pointed elsewhere."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        held = [*module._parameters.values(), *module._buffers.values()]
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                held.append(value)
            elif isinstance(value, (tuple, list)):
                held += [v for v in value if isinstance(v, torch.Tensor)]
        for t in held:
            if t is not None and t.device.type == "cpu" and not t.is_meta and not t.is_inference():
                seen.setdefault(id(t), t)
    return list(seen.values())


def pack_weights(model: nn.Module) -> Packed | None:
    """Move every CPU weight storage of ``model`` into one arena (module docstring); None
    where there is nothing to move (already packed, no CPU weights) or packing is off."""
    if not enabled():
        return None
    tensors = weight_tensors(model)
    # Storage -> the tensors on it, storages in first-use order.
    by_storage: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        s = t.untyped_storage()
        by_storage.setdefault(s.data_ptr(), (s, []))[1].append(t)
    if len(by_storage) <= 1:
        return None
    slots, total = {}, 0
    for key, (s, _) in by_storage.items():
        slots[key] = total
        total += -(-s.nbytes() // ALIGNMENT) * ALIGNMENT
    _release_freed_memory()                             # what stacking the experts freed
    # Plain tensors even when the worker is built inside inference mode: version counters
    # (the caches keyed on them) and in-place edits of weights keep working.
    with torch.inference_mode(False):
        huge = _copy_into_arena(by_storage, slots, total)
    for module in model.modules():
        if hasattr(module, "weights_moved"):
            module.weights_moved()                      # caches keyed on where bytes were
    _release_freed_memory()
    log.info("weights packed: %d storages, %.0f MiB in one arena%s", len(slots), total / 2**20,
             " on huge pages" if huge else "")
    return Packed(len(slots), total, huge)


def _copy_into_arena(by_storage: dict, slots: dict[int, int], total: int) -> bool:
    """Each storage's bytes to its slot, every tensor on it re-pointed there, the old
    storage let go; whether the arena got huge pages."""
    raw = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE                 # the arena on a 2 MB boundary
    huge = _advise_huge_pages(raw.data_ptr() + start, total)
    arena = raw.untyped_storage()
    copied = 0
    with torch.no_grad():
        for key in list(by_storage):
            s, refs = by_storage.pop(key)
            if copied > TRIM_EVERY:            # the old storages freed so far back to the OS
                _release_freed_memory()
                copied = 0
            copied += s.nbytes()
            at = start + slots[key]
            raw[at:at + s.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
            for t in refs:
                size = t.element_size()
                # ``.data``: the tensor object stays (a Parameter stays the Parameter its
                # modules share), its version counter too (caches keyed on it stay valid).
                t.data = torch.empty(0, dtype=t.dtype).set_(
                    arena, (at + t.storage_offset() * size) // size, t.size(), t.stride())
            del s, refs
    return huge


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL | None:
    """Linux's C library (madvise, malloc_trim), None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def _advise_huge_pages(address: int, length: int) -> bool:
    """Ask Linux to back the range with 2 MB pages (transparent huge pages in "madvise"
    mode); False where it cannot (another OS, THP off): the packing helps without."""
    libc = _libc()
    if libc is None or length < HUGE_PAGE:
        return False
    return libc.madvise(address, length - length % HUGE_PAGE, _MADV_HUGEPAGE) == 0


def _release_freed_memory() -> None:
    """Hand the old storages' pages back to the OS: glibc keeps freed heap memory below its
    mmap threshold (tensors up to 32 MB) unless asked (musl and other OSes: nothing to do)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
