"""Compiling the static decode step on CPU (torch.compile with Inductor).

Why per layer kind, not the whole step: one Inductor graph of the whole 8-layer demo
forward ran at 2.5-3x eager, but took 70-110 s to compile per shape family on two cores
(27-42 s again with a warm cache).  The layer functions of static_decode.py take the
layer's modules as arguments, so one graph serves every layer of a kind (main and MTP
layers alike).  Per kind (dense, MoE) a deployment needs one graph per decode window a
step feeds, 1 .. 1 + k tokens per sequence, for a lone sequence and for batches, plus a
lone sequence's prompt window of any length (``graph_plan``): 6 graphs with MTP off, 10
at k=1, 14 at k=2 (no prompt window where the decoder takes no prompts: a 16-bit model on
a CPU without 16-bit instructions).

Why static windows: symbolic sizes cost time inside the kernels (a MoE layer on a lone
2-token window: 153 us static but for the context and the pool, 190 us fully symbolic;
16 sequences, their number symbolic too: 710 vs 784 us).

Why ahead-of-time artifacts: with only Inductor's code cache warm, a second start still
re-traces each graph (about 4 s each here).  ``aot_compile`` captures a graph once and
saves it whole (guards, Inductor code, C++ kernels) to a file that later starts load in
about a second.  Files live under ``$MTP_SERVE_COMPILE_CACHE`` (default
``~/.cache/mtp-serve/compiled``), in a folder keyed by the torch version, device, dtype,
model shape and the source of the model code, and are written atomically; one that fails
to load is compiled again and replaced.

Why graphs for a lone sequence: a graph made for two or more sequences would specialise
a batch of one (a lone sequence ran twice, padded: a third of a step at concurrency 1).

Why in the background: the graphs take one to two minutes to compile on one core.  A
daemon (``BackgroundGraphs``) opens its ports at once and serves the static step
uncompiled; child processes (one per core, up to four) compile what the cache lacks (each
builds the model from its config on uninitialised memory: the graphs take weights as
inputs), a thread loads the files, and the worker switches to the graphs between two
steps.  A child runs this module (``run_child``); compile_child.py describes and starts
it.  Outputs are the same either way (the compiled graphs are exact).
``$MTP_SERVE_COMPILE_WAIT=1`` makes start-up wait for them instead
(``compile_static_decoder``), as engines built in-process do.

Switch: ``$MTP_SERVE_COMPILE`` = ``auto`` (default: compile when the static path applies
and the device is a CPU), ``1``/``on`` (wherever the static path applies), ``0``/``off``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from server.engine.worker.compile_child import (
    empty_model,
    int8_layers,
    spawn_compile_child,
    tensor_dtypes,
)
from server.model import static_decode
from server.model.batch import DecodeMetadata
from server.model.kernels.native import native_ops
from server.model.kernels.products import Products, products_for
from server.model.layers.latent_cache import Int8LatentCache

log = logging.getLogger("server.engine")

CACHE_ENV = "MTP_SERVE_COMPILE_CACHE"
CPP_WRAPPER_ENV = "MTP_SERVE_COMPILE_CPP_WRAPPER"


def should_compile(mode: str, device: torch.device, static_ok: bool) -> bool:
    if mode == "off" or not static_ok:
        return False
    return mode == "on" or device.type == "cpu"


@contextlib.contextmanager
def compile_settings(threads: int | None = None) -> Iterator[None]:
    """Torch's compile settings a graph of the static step is made under, for the trace and
    the compile only (config patches, nothing assigned for the process).  ``threads``: the
    serving process's, which Inductor's CPU kernels are made for (a compile child traces
    on one)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config
    inductor: dict[str, object] = {}
    # Inductor proves each vector ISA the CPU reports by compiling and loading a test
    # library (about 12 s per process with a cold cache: every first start, in every
    # compile child).  Trust the CPU's flags instead; a compiler that cannot build for
    # them fails the compile, which leaves the step serving uncompiled.
    # $TORCHINDUCTOR_VEC_ISA_OK, where set, decides.
    if os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") is None:
        inductor["cpp.vec_isa_ok"] = True
    if threads is not None:
        inductor["cpp.threads"] = threads
    if inductor_config.post_grad_custom_pre_pass is None:
        inductor["post_grad_custom_pre_pass"] = _UnsplitKey()
    # Duck sizing would assume equal sizes are one symbol (batch 2 == 2 tokens).  Module
    # floats (softmax scale, norm eps) are constants of the model: without specialising
    # them a capture restarts once to turn them into tensors, which aot_compile cannot do.
    with fx_config.patch(use_duck_shape=False), dynamo_config.patch(specialize_float=True), \
            inductor_config.patch(inductor), outer_loops_parallel():
        yield


_OUTER_ONLY = {"active": 0, "installed": False}


class _UnsplitKey(CustomGraphPass):
    """A pass that changes nothing: its uuid puts ``outer_loops_parallel`` in the key of
    Inductor's own cache, which would otherwise hand back kernels made without it."""

    def __call__(self, graph) -> None:
        return None

    def uuid(self) -> str:
        return "mtp-serve: reductions unsplit (outer_loops_parallel) 1"


@contextlib.contextmanager
def outer_loops_parallel() -> Iterator[None]:
    """Inductor's CPU kernels made in the context share their outer loops (rows, heads)
    among threads, never a reduction's own loop.  Why: with fewer rows than threads
    Inductor splits a reduction into a partial sum per thread, so a one-token window summed
    an RMSNorm over 1536 in two halves and a two-token window each row whole: the same row
    rounded differently, and on the 0.5b bf16 model (2 threads) greedy tokens of MTP k=1
    parted from MTP off's at a chat prompt's 12th token.  Split reductions are the norms'
    1536-element sums, not worth two threads.  (A private hook of torch 2.13's Inductor,
    ``CppKernel.decide_parallel_depth``; where a torch lacks it, nothing changes.)"""
    from torch._inductor.codegen import cpp
    kernel = getattr(cpp, "CppKernel", None)
    real = getattr(kernel, "decide_parallel_depth", None)
    if real is None:
        yield
        return
    if not _OUTER_ONLY["installed"]:
        def decide_parallel_depth(self, max_parallel_depth, threads):
            depth = real(self, max_parallel_depth, threads)
            outer = getattr(self, "reduction_depth", None)
            if not _OUTER_ONLY["active"] or outer is None:
                return depth
            keep = max(0, min(depth.parallel_depth, outer - depth.start_depth))
            return type(depth)(parallel_depth=keep, start_depth=depth.start_depth)
        kernel.decide_parallel_depth = decide_parallel_depth
        _OUTER_ONLY["installed"] = True
    _OUTER_ONLY["active"] += 1
    try:
        yield
    finally:
        _OUTER_ONLY["active"] -= 1


def cache_dir(model, device: torch.device) -> Path:
    """Artifacts are valid for one torch build, device type, dtype of every tensor, model
    shape and model code."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mtp-serve" / "compiled")
    model_code = Path(static_decode.__file__).parent             # server/model, every part
    h = hashlib.sha256()
    h.update(f"{torch.__version__}|{device.type}|{next(model.parameters()).dtype}".encode())
    h.update(repr(sorted((n, str(d)) for n, d in tensor_dtypes(model).items())).encode())
    h.update(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    # Inductor's CPU kernels are made for the process's thread count, and a traced int8
    # layer for its backend: a graph made for 1 thread (or the float backend) and served
    # with 2 (or int_mm) ran the 0.5b W8A8 model's layers 2-5x slower.
    h.update(f"threads {torch.get_num_threads()}".encode())
    h.update(repr(sorted(int8_layers(model).items())).encode())
    h.update(_plan_key(model.parallel_plan).encode())
    # A graph reads the KV cache it was traced with: a float tensor, or an int8 cache's
    # three (static_decode.attend).
    h.update(f"kv {model.static_decoder.kv_form}".encode())
    # The forms a graph takes are its products' (kernels/products.py): "avx2" batch graphs
    # call half_avx2.c, "float32" ones reduce in float32, torch's call its own.
    native = device.type == "cpu" and native_ops()        # mtp_native's operators or mtp_serve's
    h.update(f"products {model.products.name} native {native} cpp_wrapper {cpp_wrapper(device)}".encode())
    h.update(f"mla kernels {getattr(model.products, 'mla', False)}".encode())   # half_cpu.mla_ops
    h.update(b"reductions unsplit")                      # outer_loops_parallel
    h.update(b"lone windows one thread where our operators read the weights")   # _graph_threads
    for source in sorted(model_code.rglob("*")):
        if source.suffix in (".py", ".c", ".h", ".cpp"):
            h.update(source.relative_to(model_code).as_posix().encode() + source.read_bytes())
    return root / h.hexdigest()[:24]


def _plan_key(plan) -> str:
    """A rank's shard: its layout, and its rank only under expert parallel (each rank's
    expert offset is a constant of its graphs; tensor-parallel ranks share theirs)."""
    if plan is None:
        return "one process"
    return repr((plan.world_size, plan.moe_tp, plan.moe_ep, plan.sp, plan.dp, plan.cp,
                 plan.rank if plan.moe_ep > 1 else "any"))


def graph_plan(model, max_query_len: int = 1) -> list[tuple[str, int, str, bool]]:
    """(kind, a layer index of that kind, window, lone sequence?) of every graph the
    model's static decoder uses.  Windows "q1" .. "q<max_query_len>": exactly that many
    tokens per sequence (every size static but the context, the KV pool, the block size
    and, for batches, the number of sequences); "many": a lone sequence's prompt window
    of any length (sizes symbolic), where the decoder takes prompts."""
    plan = []
    decoder = model.static_decoder
    prompts = decoder.takes_prompts
    for kind, index in decoder.layer_kinds().items():
        if kind.startswith("gmoe"):
            # The gathered MoE is for few tokens only: the windows it can take (a batch
            # window has two sequences or more).
            plan += [(kind, index, f"q{q}", lone) for lone in (False, True)
                     for q in range(1, max_query_len + 1)
                     if q * (1 if lone else 2) <= decoder.gather_max_tokens]
            continue
        plan += [(kind, index, f"q{q}", lone) for lone in (False, True) for q in range(1, max_query_len + 1)]
        if prompts:
            plan.append((kind, index, "many", True))
    return plan


def _file(kind: str, window: str, lone: bool) -> str:
    return f"{kind}-{window}{'-lone' if lone else ''}.bin"


def _example(model, index: int, q: int, lone: bool, block_size: int, device: torch.device,
             static: bool = False, kind: str | None = None) -> tuple:
    """Call arguments of the layer function for layer ``index``: 1 (``lone``) or 2
    sequences x q tokens on a scratch cache (nothing the engine owns).  ``static``: mark
    the only sizes a static graph keeps symbolic: the context (block-table width), the
    pool (cache blocks and block size: one file serves every engine) and, for batches,
    the number of sequences (on the windowed layout, ``StaticDecoder.function``)."""
    dtype = next(model.parameters()).dtype
    starts, tables = ([1], [[1, 2]]) if lone else ([1, 2], [[1, 2], [3, 0]])
    meta = DecodeMetadata.build(starts, q, tables, block_size, device)
    cos, sin = model.rope.cos_sin(meta.positions)
    x = torch.zeros(len(starts) * q, model.config.hidden_size, dtype=dtype, device=device)
    if model.static_decoder.kv_form == "int8":
        c = model.config
        scratch = Int8LatentCache(4, block_size, c.kv_lora_rank, c.qk_rope_head_dim, dtype, device).block_tensors()
    else:
        scratch = torch.zeros(4, block_size, model.kv_cache_dim, dtype=dtype, device=device)
    windowed = static and not lone
    args = model.static_decoder.layer_args(index, x, cos[:, None], sin[:, None], meta, scratch,
                                           windowed, kind)
    if static:
        torch._dynamo.mark_dynamic(meta.block_tables, 1)
        for t in (scratch if isinstance(scratch, tuple) else (scratch,)):
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 1)
    if windowed:
        # x, cos, sin, positions, slots, then the block tables
        first = next(i for i, a in enumerate(args) if a is meta.block_tables) - 5
        for t in args[first:first + 6]:
            torch._dynamo.mark_dynamic(t, 0)
    return args


def cpp_wrapper(device: torch.device) -> bool:
    """Whether graphs call their kernels from a wrapper in C++: on CPU ~20% faster than the
    Python one (a layer call at batch 2: 259 against 394 us), for ~9 s more compile per
    graph.  $MTP_SERVE_COMPILE_CPP_WRAPPER=0 trades the speed for the compile time (the
    test suite does: it compiles its graphs cold on every clean checkout)."""
    return device.type == "cpu" and os.environ.get(CPP_WRAPPER_ENV, "1") != "0"


def _window(lone: bool, static: bool) -> str:
    """The products' window of a graph (kernels/products.py): a lone sequence's window, a
    batch's, or the lone prompt window (sizes symbolic)."""
    return ("lone" if lone else "batch") if static else "prompt"


def _load_or_compile(fn, args: tuple, path: Path, device: torch.device, static: bool = False,
                     products: Products | None = None, threads: int | None = None) -> tuple[object, bool]:
    """(compiled function, loaded from disk?).  ``static``: sizes are constants except
    those ``_example`` marked dynamic.  ``products``: the form the modules among ``args``
    multiply with while the graph is traced (their products' ``window``), theirs again after."""
    if path.is_file():
        try:
            with open(path, "rb") as f:
                return torch.compiler.load_compiled_function(f), True
        except Exception as exc:                     # noqa: BLE001 - a stale or broken file
            log.warning("compiled artifact %s did not load (%s); compiling again", path, exc)
    options = {"cpp_wrapper": True} if cpp_wrapper(device) else {}
    modules = [a for a in args if isinstance(a, torch.nn.Module)]
    with products_for(modules, products) if products is not None else contextlib.nullcontext(), \
            compile_settings(threads):
        compiled = torch.compile(fn, dynamic=not static, fullgraph=True, options=options).aot_compile((args, {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written aside, then renamed: another process making the same graph (two compiles of
    # one model, a warm-up beside a start) never reads half a file.
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    compiled.save_compiled_function(str(part))
    os.replace(part, path)
    # Its modules multiply with their own products again, not the window's form it was
    # traced with: the guards on them would fail every call (and _prepare skips guards).
    compiled.disable_guard_check()
    return compiled, False


def _graph_threads(model, lone: bool, static: bool, threads: int | None) -> int | None:
    """Threads Inductor's own kernels of a graph are made for: one for a lone sequence's
    decode / verify window whose weights are all read by our operators
    (``_weights_in_operators``), the serving process's (``threads``: None, this process's)
    for the rest.  Why: such a window's Inductor kernels are a few thousand elements each
    (norms, rope, routing, casts), and shared out over two threads each paid a parallel
    region's fork and join, about 8 a layer: a layer call of the 0.5b bf16 model at batch 1
    took a median 1392 us so, 1305 us single-threaded (Zen 3, 2 cores; torch profiler, 230
    calls).  Our operators in it keep every thread: they read their count when called.
    Where Inductor streams a weight itself (a reduction standing in for a product), that
    needs every thread.  Sums are unchanged: ``outer_loops_parallel`` already keeps each
    row's reduction on one thread."""
    return 1 if lone and static and _weights_in_operators(model) else threads


def _weights_in_operators(model) -> bool:
    """Whether a decode window's graph reads every weight through our C operators: the
    products of our kernels ("avx2", "avx512") with ops.cpp loaded, MLA's head weights
    through theirs where the products have them, int8 layers on our int8 kernels."""
    products = model.products
    if products.name not in ("avx2", "avx512") or not native_ops():
        return False
    if products.name == "avx2" and not getattr(products, "mla", False):
        return False                     # W_UK / W_UV as Inductor reductions (half_cpu.py)
    return all(spec["backend"] in ("avx2", "vnni") for spec in int8_layers(model).values())


def _prepare(model, block_size: int, device: torch.device, folder: Path, max_query_len: int,
             only: list[str] | None = None, threads: int | None = None) -> tuple[dict, int]:
    """The graphs of ``graph_plan`` (those named in ``only``, if given), loaded from
    ``folder`` or compiled into it (for ``threads``, default this process's): ({(kind,
    window, lone): graph}, number loaded from disk)."""
    graphs, loaded = {}, 0
    with torch.inference_mode():
        for kind, index, window, lone in graph_plan(model, max_query_len):
            path = folder / _file(kind, window, lone)
            if only is not None and path.name not in only:
                continue
            static = window.startswith("q")
            q = int(window[1:]) if static else 2 if window == "many" else 1
            args = _example(model, index, q, lone, block_size, device, static, kind)
            fn, hit = _load_or_compile(model.static_decoder.function(kind, static and not lone),
                                       args, path, device, static,
                                       model.products.window(_window(lone, static)),
                                       _graph_threads(model, lone, static, threads))
            # Guards were checked when the graph was made; the calls the decoder makes
            # differ only in sizes the graph keeps symbolic (one-block tables are padded),
            # so skip re-checking ~30 weights per call.
            fn.disable_guard_check()
            graphs[(kind, window, lone)] = fn
            loaded += hit
    return graphs, loaded


def compile_static_decoder(model, block_size: int, device: torch.device, max_query_len: int = 1) -> float:
    """Load (or compile and save) every graph ``model.static_decoder`` needs for windows of
    up to ``max_query_len`` tokens (1 + the most drafts a step verifies) and switch it to
    them, before returning; returns the seconds it took."""
    t0 = time.perf_counter()
    folder = cache_dir(model, device)
    missing = [name for round_ in graph_rounds(model, max_query_len) for name in round_
               if not (folder / name).is_file()]
    if len(missing) > 1 and (os.cpu_count() or 1) > 1:
        # The graphs are independent: made on every core (a first start's 8 graphs of the
        # demo model on 2 cores: 28 s against 50 s one after another).  Whatever a child
        # leaves unmade, the in-process pass below makes.
        try:
            compile_in_children(model, block_size, device, folder, max_query_len, missing)
        except RuntimeError as exc:
            log.warning("static decode step: %s; compiling in-process", exc)
    graphs, loaded = _prepare(model, block_size, device, folder, max_query_len)
    model.static_decoder.use_graphs(graphs)
    seconds = time.perf_counter() - t0
    log.info("static decode step: %d compiled graphs (%d loaded from %s) in %.1f s",
             len(graphs), loaded, folder, seconds)
    return seconds


def graph_rounds(model, max_query_len: int) -> list[list[str]]:
    """The files of ``graph_plan`` in the order a background compile makes them: decode/
    verify windows first, then the lone prompt window (the varlen path serves prefills)."""
    plan = graph_plan(model, max_query_len)
    prompt = [g for g in plan if g[3] and g[2] == "many"]
    return [[_file(kind, window, lone) for kind, _i, window, lone in part]
            for part in ([g for g in plan if g not in prompt], prompt) if part]


class BackgroundGraphs:
    """The graphs of ``compile_static_decoder``, made without holding up start-up (module
    docstring), in the rounds of ``graph_rounds``: ``poll()`` between steps returns each
    round's graph set (with the ones before) once ready."""

    def __init__(self, model, block_size: int, device: torch.device, max_query_len: int = 1) -> None:
        self.model = model
        self.block_size = block_size
        self.max_query_len = max_query_len
        self.device = device
        self.folder = cache_dir(model, device)
        self.seconds: float | None = None        # start to the first round in use
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._ready: tuple[dict, bool] | None = None    # (graphs so far, last round?) not yet polled
        self._error: BaseException | None = None
        # A daemon thread, not an executor's: exiting must not wait for a compile.
        threading.Thread(target=self._work, name="compile", daemon=True).start()

    def _work(self) -> None:
        graphs: dict = {}
        try:
            rounds = graph_rounds(self.model, self.max_query_len)
            for n, names in enumerate(rounds):
                graphs.update(self._run(names))
                with self._lock:
                    self._ready = (dict(graphs), n == len(rounds) - 1)
        except BaseException as exc:              # noqa: BLE001 - handed to poll()
            with self._lock:
                self._error = exc

    def _run(self, names: list[str]) -> dict:
        missing = [name for name in names if not (self.folder / name).is_file()]
        if missing:
            log.info("static decode step: compiling %d graphs in child processes (serving the "
                     "step without them meanwhile)", len(missing))
            compile_in_children(self.model, self.block_size, self.device, self.folder,
                                self.max_query_len, missing)
        graphs, loaded = _prepare(self.model, self.block_size, self.device, self.folder,
                                  self.max_query_len, only=names)
        if loaded != len(graphs):                 # the child left a file that does not load
            log.warning("static decode step: %d graphs compiled in-process after the child's",
                        len(graphs) - loaded)
        return graphs

    def poll(self) -> tuple[dict, bool] | None:
        """(every graph made so far, is this the last round?) once a round is ready and
        until it is taken; None meanwhile.  Raises what compiling raised (the graphs of
        earlier rounds stay in use)."""
        with self._lock:
            ready, self._ready = self._ready, None
            error = self._error
        if ready is None and error is not None:
            raise error
        if ready is not None and self.seconds is None:
            self.seconds = self.elapsed()
        return ready

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0


def compile_in_children(model, block_size: int, device: torch.device, folder: Path,
                        max_query_len: int, files: list[str]) -> None:
    """Compile ``files`` into ``folder`` in child processes, one per core up to four (the
    graphs are independent, and a first start is otherwise idle), each with one torch
    thread.  Raises RuntimeError naming a child that failed."""
    n = max(1, min(len(files), os.cpu_count() or 1, 4))
    with tempfile.TemporaryDirectory(prefix="mtp-compile-") as tmp:
        children = [spawn_compile_child(model, block_size, device, folder, max_query_len,
                                        files[i::n], Path(tmp) / f"compile{i}",
                                        cpp_wrapper=cpp_wrapper(device))
                    for i in range(n)]
        failures = []
        for proc, log_file in children:
            rc = proc.wait()
            if rc != 0:
                tail = log_file.read_text(errors="replace").strip().splitlines()[-3:]
                failures.append(f"exited {rc}: {' | '.join(tail)}")
        if failures:
            raise RuntimeError(f"the compile process {failures[0]}")


def run_child(spec_file: Path) -> int:
    """A compile child (compile_child.spawn_compile_child started it): make the missing
    graphs of the model ``spec_file`` describes into its folder."""
    spec = pickle.loads(spec_file.read_bytes())
    parent = os.getppid()

    def watch() -> None:                          # the serving process went: stop too
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()
    torch.set_num_threads(1)
    device = torch.device(spec["device"])
    model = empty_model(spec["config"], spec["dtypes"], device, spec["int8"], spec.get("plan"),
                        spec.get("products", "torch"))
    model.static_decoder.kv_form = spec.get("kv_form", "float")
    folder = Path(spec["folder"])
    os.environ[CPP_WRAPPER_ENV] = "1" if spec["cpp_wrapper"] else "0"
    t0 = time.perf_counter()
    # Kernels for the serving process's threads, though this child traces on one.
    _prepare(model, spec["block_size"], device, folder, spec["max_query_len"], only=spec["files"],
             threads=spec["threads"])
    print(f"compiled into {folder} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_child(Path(sys.argv[1])))
