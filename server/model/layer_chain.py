"""A decode step's layer graphs run back to back in one native call.

Why: once each layer's graph call is learned (flat_calls.py), what remains between two
layers is Python that does the same every step: find the layer's kind, graph and
modules, build its arguments, fill the learned call's inputs, turn a list of tensors into
handles and back.  ~25 us a layer on warm caches; in a served step, right after a layer's
products have streamed tens of megabytes through the caches, ~95 us (the 0.5b model at
batch 1 on 2 Zen 4 cores: ~1 ms of a 17 ms step).  A chain (kernels/layer_chain.cpp)
holds each layer's C++-wrapper entry point, its constant inputs and where each other input
comes from, and calls them in order: the forward's Python runs once a step, not once a
layer.

A chain is made from the learned calls of one step that went layer by layer, for that
step's kind of window (tokens a sequence, a lone sequence or a batch, the gathered MoE or
not), and only where every layer's call goes straight to a C++ wrapper's generated code
(``FlatCall.direct`` with numbers as tensors) and returns one tensor.  It calls the very
code with the very inputs the learned calls would: its outputs are the layer-by-layer
ones, bit for bit.  Like the learned calls, it holds the weights it was made with (the
same objects every step); it is dropped with them (``FlatCalls.clear``) and when an MoE
rebuilds its expert stacks (``layers.moe.stack_builds``).
``$MTP_SERVE_LAYER_CHAIN=0`` keeps the layer-by-layer calls.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

import torch

from server.model.flat_calls import FlatCall

log = logging.getLogger("server.engine")

ENV = "MTP_SERVE_LAYER_CHAIN"
# The wrapper's entry point as GCC mangles ``void inductor_entry_impl(AtenTensorHandle*,
# AtenTensorHandle*)`` (torch/_inductor/codegen/cpp_wrapper_cpu.py).
_ENTRY_SYMBOL = "_Z19inductor_entry_implPP16AtenTensorOpaqueS1_"

# Where an input comes from (layer_chain.cpp's Source).
_CONSTANT, _HIDDEN, _WINDOW, _CACHE = 0, 1, 2, 3
# A layer's arguments after the hidden state (static_decode.StaticDecoder._args): the
# window's cos, sin, positions, slots, then the block tables, then the cache.
WINDOW_ARGS = 5


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def available() -> bool:
    """Whether layer_chain.cpp is loaded (built with ops.cpp: kernels.native.native_ops)."""
    try:
        from server.model.kernels.native import native_ops
        return native_ops() and hasattr(torch.ops.mtp_native, "chain_run")
    except (ImportError, RuntimeError, AttributeError):
        return False


def entry_point(flat: FlatCall) -> int | None:
    """The address of the C++ wrapper's ``inductor_entry_impl`` under a learned call, or
    None where the call does not go straight to such a wrapper."""
    if flat.direct is None or not flat.scalars or not isinstance(flat.picks, int) or flat.outputs < 1:
        return None
    binding = next((c.cell_contents for c in getattr(flat.direct, "__closure__", None) or ()
                    if type(c.cell_contents).__name__ == "builtin_function_or_method"), None)
    path = getattr(getattr(binding, "__self__", None), "__file__", None)
    if not path:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        return ctypes.cast(getattr(lib, _ENTRY_SYMBOL), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


class LayerChains:
    """A decoder's chains, one per kind of window (``key``)."""

    def __init__(self) -> None:
        self._chains: dict[tuple, tuple[int, bool, int]] = {}   # key -> (id, windowed, stack builds)
        self._refused: set[tuple] = set()
        self.enabled = enabled()
        self.made = 0
        self.reasons: list[str] = []

    def clear(self) -> None:
        for chain, _w, _b in self._chains.values():
            torch.ops.mtp_native.chain_drop(chain)
        self._chains.clear()
        self._refused.clear()

    def __del__(self) -> None:
        try:
            if sys.meta_path is not None:
                self.clear()
        except Exception:                                     # noqa: BLE001 - at exit
            pass

    def find(self, key: tuple, stack_builds: int) -> tuple[int, bool] | None:
        """(chain id, takes the windowed layout?) made for ``key``, if any and current."""
        found = self._chains.get(key) if self.enabled else None
        if found is None:
            return None
        if found[2] != stack_builds:                          # an MoE rebuilt its stacks
            self.clear()
            return None
        return found[0], found[1]

    def wanted(self, key: tuple) -> bool:
        """Whether a step of this kind should record its layers' calls to make a chain."""
        return self.enabled and key not in self._chains and key not in self._refused

    def make(self, key: tuple, calls: list, stack_builds: int) -> bool:
        """A chain from one step's calls, layer by layer: (learned call or None, the call's
        arguments, the hidden state's position among them, takes the windowed layout?).
        Refused (for good, for this key) where a call is not chainable."""
        why = None
        if not available():
            why = "layer_chain.cpp is not loaded"
        elif not calls:
            why = "no layers"
        elif len({windowed for *_, windowed in calls}) != 1:
            why = "layers in both layouts"
        layers = []
        for flat, args, hidden, windowed in calls if why is None else ():
            entry = entry_point(flat) if isinstance(flat, FlatCall) else None
            if entry is None:
                why = "a layer whose call does not go straight to a C++ wrapper"
                break
            layer = _layer(flat, args, hidden)
            if isinstance(layer, str):
                why = layer
                break
            layers.append((entry, flat, windowed, *layer))
        if why is not None:
            self._refused.add(key)
            self.reasons = [*self.reasons[-15:], why]
            log.debug("no layer chain for %s: %s", key, why)
            return False
        chain, first = 0, 0
        for entry, flat, windowed, spec, constants, cache_items in layers:
            chain = torch.ops.mtp_native.chain_add(chain, entry, flat.outputs, flat.picks, windowed,
                                                   first, spec, constants)
            first += cache_items
        self._chains[key] = (chain, calls[0][3], stack_builds)
        self.made += 1
        return True


def cache_tensors(cache) -> tuple[torch.Tensor, ...]:
    """A layer's cache argument as the tensors a chain takes: a float cache's one, an int8
    cache's three."""
    return cache if isinstance(cache, tuple) else (cache,)


def _layer(flat: FlatCall, args: tuple, hidden: int) -> tuple[list[int], list[torch.Tensor], int] | str:
    """(spec: (source, index, dim) per input, the constants, how many cache tensors the
    layer takes) of one learned call, or why it cannot be chained."""
    cache_at = hidden + 1 + WINDOW_ARGS
    if len(args) <= cache_at:
        return "a call without a cache argument"
    slots = {position: (arg, item, dim) for position, arg, item, dim in flat.slots}
    spec: list[int] = []
    constants: list[torch.Tensor] = []

    def constant(value) -> None:
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value)                       # as the wrapper's Python shim makes it
        spec.extend((_CONSTANT, len(constants), -1))
        constants.append(value)

    for position, value in enumerate(flat.template):
        if position not in slots:
            if value is None:
                return "an input that is neither learned nor constant"
            constant(value)
            continue
        arg, item, dim = slots[position]
        d = -1 if dim is None else dim
        if arg == hidden and item is None:
            spec.extend((_HIDDEN, 0, d))
        elif hidden < arg < cache_at and item is None:
            spec.extend((_WINDOW, arg - hidden - 1, d))
        elif arg == cache_at:
            spec.extend((_CACHE, 0 if item is None else item, d))
        elif arg > cache_at:                                   # the layer's own constants (expert stacks, sizes)
            value = args[arg] if item is None else args[arg][item]
            if dim is not None:
                value = value.size(dim)
            elif not isinstance(value, (torch.Tensor, int, float)):
                return f"argument {arg} a {type(value).__name__}"
            constant(value)
        else:
            return f"an input from argument {arg} (item {item})"
    return spec, constants, len(cache_tensors(args[cache_at]))
