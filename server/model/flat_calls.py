"""Calling a compiled layer graph with its flat inputs, below the bytecode Dynamo wrote.

Why: a graph made by ``aot_compile`` (worker/compile_step.py) is called through Dynamo's
bytecode for the layer function.  Every call it walks the modules it was given for each
weight (about 30 attribute and dict lookups), reads the sizes the graph keeps symbolic,
and records two profiler markers before the graph runs.  With the call's other wrappers
that was ~95 us between two layer graphs of the 0.5b bf16 model at batch 1 on 2 Zen 3
cores: about 1 ms of an 18 ms step, and more in MTP steps, which call more graphs.

What a layer's call passes never changes between steps but for the call's own tensors
(the window, block tables, cache, expert stacks), their sizes and its numbers: the weights
are the same objects (guards are skipped for the same reason: compile_step._prepare).  So
the first call of each (graph, layer) goes the ordinary way while it is watched: the flat
inputs the bytecode hands the compiled function (each one of the call's tensors or
numbers, a size of one of its tensors, or a constant weight) and which of the graph's
outputs it returns.  Later calls fill in the call's own and call the compiled function
directly.  A call that cannot be
learned cleanly (an input that is none of these, a tensor passed twice, an output that is
not one of the graph's) keeps the ordinary call for that pair, as does
``$MTP_SERVE_FLAT_CALLS=0``.

Below the compiled function sit AOTAutograd's runtime wrappers and Inductor's graph object
before its generated code: about 3.5 us a call; and a C++-wrapper graph turns each number
it takes into a new tensor (3.6 us each; a layer graph takes three sizes).  With the kernels
stubbed out a batch-1 step of the 0.5b model costs ~1.1 ms besides its products, so a
learned call goes straight to the generated code where the watched call showed the
wrappers hand it the very inputs and return its very outputs (no input mutation or output
alias for them to replay), and hands a C++-wrapper graph each number as a tensor made once
per value.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger("server.engine")

ENV = "MTP_SERVE_FLAT_CALLS"
_LEARNING = threading.Lock()          # a watched call swaps globals a graph's bytecode may share


class _Size(int):
    """A size the bytecode read of one of the call's tensors (argument, item, dim), or one
    of the call's own numbers (argument, None, None)."""
    source: tuple[int, int | None, int | None]


@dataclass(frozen=True)
class FlatCall:
    """A learned call: ``compiled(*inputs)`` with ``slots`` (input position, argument,
    item of a tuple argument or None, dim or None for the tensor itself) filled per call;
    ``picks``: which of its outputs the layer function returns (an int: that one alone)."""
    compiled: object
    template: tuple
    slots: tuple[tuple[int, int, int | None, int | None], ...]
    picks: int | tuple[int, ...]
    direct: object = None           # the graph's generated code, taking the inputs as a list
    scalars: bool = False           # ``direct`` takes numbers as tensors (a C++ wrapper)
    outputs: int = 0                # how many outputs the graph returns

    def __call__(self, args: tuple):
        inputs = list(self.template)
        for position, arg, item, dim in self.slots:
            value = args[arg] if item is None else args[arg][item]
            if dim is not None:
                value = value.size(dim)
            inputs[position] = _scalar(value) if self.scalars and type(value) is int else value
        out = self.compiled(*inputs) if self.direct is None else self.direct(inputs)
        if isinstance(self.picks, int):
            return out[self.picks]
        return tuple(out[i] for i in self.picks)


_SCALARS: dict[int, torch.Tensor] = {}


def _scalar(value: int) -> torch.Tensor:
    """``value`` as the 0-d int64 tensor a C++-wrapper graph reads it from, made once (a
    graph only reads it); the few sizes a decoder passes take a few entries."""
    t = _SCALARS.get(value)
    if t is None:
        if len(_SCALARS) > 4096:
            _SCALARS.clear()
        with torch.inference_mode(False):
            t = _SCALARS[value] = torch.tensor(value, dtype=torch.int64)
    return t


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


class FlatCalls:
    """The learned calls of one decoder's graphs, per (graph, layer index)."""

    def __init__(self) -> None:
        self._calls: dict[tuple[int, int], FlatCall | None] = {}
        self._graphs: dict[int, object] = {}      # keeps each keyed graph alive (its id)
        self.learned = 0
        self.refused = 0
        self.reasons: list[str] = []          # why each refused pair was

    def clear(self) -> None:
        self._calls.clear()
        self._graphs.clear()

    def learned_call(self, graph, index: int) -> FlatCall | None:
        """The learned call of ``graph`` for layer ``index`` (None: not learned, or refused)."""
        flat = self._calls.get((id(graph), index))
        return flat if isinstance(flat, FlatCall) else None

    def call(self, graph, index: int, args: tuple):
        key = (id(graph), index)
        flat = self._calls.get(key, False)
        if flat is None:
            return graph(*args)
        if flat is not False:
            return flat(args)
        result, flat = _learn(graph, args)
        self._calls[key] = flat if isinstance(flat, FlatCall) else None
        self._graphs[id(graph)] = graph
        if isinstance(flat, FlatCall):
            self.learned += 1
        else:
            self.refused += 1
            self.reasons.append(flat)
            log.debug("layer %d: its graph keeps the ordinary call (%s)", index, flat)
        return result


def _learn(graph, args: tuple):
    """(the ordinary call's result, its FlatCall or why not)."""
    fn = getattr(graph, "fn", None)
    glb, code = getattr(fn, "__globals__", None), getattr(fn, "__code__", None)
    names = [n for n in code.co_names if n.startswith("__compiled_fn")] if code is not None else []
    if not enabled():
        return graph(*args), f"${ENV}=0"
    if len(names) != 1 or glb is None or names[0] not in glb:
        return graph(*args), "no compiled function under it"
    own, twice = _own_tensors(args)
    result, seen = _watched_call(graph, args, own, glb, code, names[0])
    inputs, out = seen.get("inputs"), seen.get("out")
    if twice:
        return result, "a tensor passed twice"
    if seen.get("stranger"):
        return result, "a size of something else than the call's tensors"
    if inputs is None or not isinstance(out, (list, tuple)):
        return result, "the compiled function was not called once with its outputs in a list"
    template, slots = list(inputs), []
    for position, value in enumerate(inputs):
        if isinstance(value, _Size):
            slots.append((position, *value.source))
            template[position] = None
        elif isinstance(value, torch.Tensor):
            if id(value) in own:
                slots.append((position, *own[id(value)], None))
                template[position] = None
        else:
            return result, f"input {position} a {type(value).__name__} of unknown source"
    picks = _picks(result, out)
    if picks is None:
        return result, "a result that is not one of the graph's outputs"
    direct, scalars = _direct(seen)
    return result, FlatCall(seen["compiled"], tuple(template), tuple(slots), picks, direct, scalars, len(out))


def _direct(seen: dict) -> tuple[object, bool]:
    """(the graph's generated code, whether it takes numbers as tensors) where the watched
    call showed the wrappers above it pass its inputs and outputs through untouched; else
    (None, False)."""
    inner, got = seen.get("graph"), seen.get("graph_call")
    if inner is None or got is None:
        return None, False
    inputs, out = seen["inputs"], seen["out"]
    given, returned = got
    same_in = len(given) == len(inputs) and all(
        a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)
        for a, b in zip(given, inputs))
    same_out = (isinstance(returned, (list, tuple)) and len(returned) == len(out)
                and all(a is b for a, b in zip(returned, out)))
    if not (same_in and same_out):
        return None, False
    return inner.current_callable, bool(getattr(inner, "fx_kwargs", {}).get("cpp_wrapper"))


def _inductor_graph(compiled) -> object | None:
    """The one Inductor graph object (CompiledFxGraph) under a compiled function's
    wrappers, or None where there is not exactly one or it is not an inference graph."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:
        return None
    found: dict[int, object] = {}
    seen: set[int] = set()

    def walk(o, depth: int) -> None:
        if id(o) in seen or depth > 8:
            return
        seen.add(id(o))
        if isinstance(o, CompiledFxGraph):
            found[id(o)] = o
            return
        for name in ("compiled_fn", "__wrapped__"):
            child = getattr(o, name, None)
            if child is not None:
                walk(child, depth + 1)
        for cell in getattr(o, "__closure__", None) or ():
            try:
                walk(cell.cell_contents, depth + 1)
            except ValueError:
                continue

    walk(compiled, 0)
    if len(found) != 1:
        return None
    graph = next(iter(found.values()))
    kwargs = getattr(graph, "fx_kwargs", None) or {}
    if not kwargs.get("is_inference") or not callable(getattr(graph, "current_callable", None)):
        return None
    return graph


def _own_tensors(args: tuple) -> tuple[dict[int, tuple[int, int | None]], bool]:
    """({id: (argument, item of a tuple argument or None)} of the call's tensors, whether
    one of them is passed twice)."""
    own: dict[int, tuple[int, int | None]] = {}
    twice = False
    for i, a in enumerate(args):
        for j, t in ([(None, a)] if isinstance(a, torch.Tensor) else
                     list(enumerate(a)) if isinstance(a, tuple) else []):
            if isinstance(t, torch.Tensor):
                twice |= id(t) in own
                own[id(t)] = (i, j)
    return own, twice


def _watched_call(graph, args: tuple, own: dict, glb: dict, code, name: str) -> tuple[object, dict]:
    """The ordinary call, with the compiled function ``name`` and the sizes the bytecode
    reads watched: (its result, {"inputs": the compiled function's inputs with the call's
    numbers and sizes marked, "out": its outputs, "compiled": it, "stranger": a size of
    something else was read})."""
    from torch._dynamo import utils as dynamo_utils
    compiled = glb[name]
    seen: dict[str, object] = {"compiled": compiled}
    # The bytecode reads sizes through Dynamo's utils module, which it holds as a global of
    # its own: that global (not the module) is what the watched call sees swapped.
    sizes_from = [n for n in code.co_names if glb.get(n) is dynamo_utils]

    def size_of(t, dim):
        value = dynamo_utils.call_size(t, dim)
        source = own.get(id(t))
        if source is None or not isinstance(dim, int):
            seen["stranger"] = True
            return value
        size = _Size(value)
        size.source = (*source, dim)
        return size

    class _Sizes:
        """Dynamo's utils module as the watched bytecode sees it: its sizes marked."""
        call_size = staticmethod(size_of)

        def __getattr__(self, attr):
            return getattr(dynamo_utils, attr)

    def watch(*inputs):
        seen["inputs"] = inputs
        seen["out"] = compiled(*[int(v) if isinstance(v, _Size) else v for v in inputs])
        return seen["out"]

    watched = list(args)
    for i, a in enumerate(args):
        if type(a) is int:                  # passed on as it is (or the call is refused)
            watched[i] = _Size(a)
            watched[i].source = (i, None, None)
    inner = _inductor_graph(compiled)
    if inner is not None:
        code_of = inner.current_callable

        def spy(inputs):
            given = list(inputs)                # the generated code empties its list
            returned = code_of(inputs)
            seen["graph_call"] = (given, returned) if "graph_call" not in seen else None
            return returned
        seen["graph"] = inner
    with _LEARNING:
        glb[name] = watch
        glb.update({n: _Sizes() for n in sizes_from})
        if inner is not None:
            inner.current_callable = spy
        try:
            result = graph(*watched)
        finally:
            glb[name] = compiled
            glb.update({n: dynamo_utils for n in sizes_from})
            if inner is not None:
                inner.current_callable = code_of
    return result, seen


def _picks(result, out) -> int | tuple[int, ...] | None:
    """Where the layer function's result sits among the graph's outputs."""
    def where(t) -> int | None:
        return next((i for i, o in enumerate(out) if o is t), None)
    if isinstance(result, torch.Tensor):
        return where(result)
    if isinstance(result, tuple) and all(isinstance(t, torch.Tensor) for t in result):
        found = tuple(where(t) for t in result)
        return None if None in found else found
    return None
