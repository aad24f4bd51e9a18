"""Compiling the static decode step on CPU (torch.compile with Inductor), at start-up.

Why per layer kind, not the whole step: one Inductor graph of the whole 8-layer demo
forward ran at 2.5-3x eager, but took 70-110 s to compile per shape family on two cores
(27-42 s again with a warm cache).  The layer functions of static_decode.py take the
layer's modules as arguments, so one graph serves every layer of a kind (main and MTP
layers alike); a deployment needs {dense, MoE} layer x {one token per sequence, several}:
four graphs, with every size (batch, window, context, pool) dynamic.

Why ahead-of-time artifacts: with only Inductor's code cache warm, a second start still
re-traces each graph (about 4 s each here).  ``aot_compile`` captures a graph once and
saves it whole (guards, Inductor code, C++ kernels) to a file that later starts load in
about a second.  Files live under ``$MTP_SERVE_COMPILE_CACHE`` (default
``~/.cache/mtp-serve/compiled``), in a folder keyed by the torch version, device, dtype,
model shape and the source of the model code, and are written atomically; one that fails
to load is compiled again and replaced.

Switch: ``$MTP_SERVE_COMPILE`` = ``auto`` (default: compile when the static path applies
and the device is a CPU), ``1``/``on`` (wherever the static path applies), ``0``/``off``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from server.model import static_decode
from server.model.batch import DecodeMetadata

log = logging.getLogger("server.engine")

CACHE_ENV = "MTP_SERVE_COMPILE_CACHE"
_MODEL_SOURCES = ("static_decode.py", "attention.py", "layers.py", "deepseek_v3.py", "batch.py")


def should_compile(mode: str, device: torch.device, static_ok: bool) -> bool:
    if mode == "off" or not static_ok:
        return False
    return mode == "on" or device.type == "cpu"


def _configure() -> None:
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config
    # Duck sizing would assume equal sizes are one symbol (batch 2 == 2 tokens).
    fx_config.use_duck_shape = False
    # Module floats (softmax scale, norm eps) are constants of the model: without this a
    # capture restarts once to turn them into tensors, which aot_compile cannot do.
    dynamo_config.specialize_float = True


def cache_dir(model, device: torch.device) -> Path:
    """Artifacts are valid for one torch build, device type, dtype, model shape and model code."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mtp-serve" / "compiled")
    here = Path(static_decode.__file__).parent
    h = hashlib.sha256()
    h.update(f"{torch.__version__}|{device.type}|{next(model.parameters()).dtype}".encode())
    h.update(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    for name in _MODEL_SOURCES:
        h.update((here / name).read_bytes())
    return root / h.hexdigest()[:24]


def _example(model, index: int, q: int, block_size: int, device: torch.device) -> tuple:
    """Call arguments of the layer function for layer ``index``: 2 sequences x q tokens
    on a scratch cache (nothing the engine owns)."""
    dtype = next(model.parameters()).dtype
    meta = DecodeMetadata.build([1, 2], q, [[1, 2], [3, 0]], block_size, device)
    cos, sin = model.rope.cos_sin(meta.positions)
    x = torch.zeros(2 * q, model.config.hidden_size, dtype=dtype, device=device)
    scratch = torch.zeros(4, block_size, model.kv_cache_dim, dtype=dtype, device=device)
    return model.static_decoder.layer_args(index, x, cos[:, None], sin[:, None], meta, scratch)


def _load_or_compile(fn, args: tuple, path: Path, device: torch.device) -> tuple[object, bool]:
    """(compiled function, loaded from disk?)."""
    if path.is_file():
        try:
            with open(path, "rb") as f:
                return torch.compiler.load_compiled_function(f), True
        except Exception as exc:                     # noqa: BLE001 - a stale or broken file
            log.warning("compiled artifact %s did not load (%s); compiling again", path, exc)
    # On CPU the generated wrapper in C++ calls the kernels ~20% faster than the Python
    # one (a layer call at batch 2: 259 vs 394 us), for ~9 s more compile per graph.
    options = {"cpp_wrapper": True} if device.type == "cpu" else {}
    compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=options).aot_compile((args, {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    compiled.save_compiled_function(str(path))
    return compiled, False


def compile_static_decoder(model, block_size: int, device: torch.device) -> float:
    """Load (or compile and save) every graph ``model.static_decoder`` needs and switch it
    to them; returns the seconds it took."""
    _configure()
    t0 = time.perf_counter()
    decoder = model.static_decoder
    folder = cache_dir(model, device)
    graphs, loaded = {}, 0
    with torch.inference_mode():
        for kind, index in decoder.layer_kinds().items():
            for many in (False, True):
                args = _example(model, index, 2 if many else 1, block_size, device)
                fn, hit = _load_or_compile(decoder.function(kind), args,
                                           folder / f"{kind}-{'many' if many else 'one'}.bin", device)
                # Guards were checked when the graph was made; the calls the decoder makes
                # differ only in sizes the graph keeps symbolic (lone sequences and
                # one-block tables are padded), so skip re-checking ~30 weights per call.
                fn.disable_guard_check()
                graphs[(kind, many)] = fn
                loaded += hit
    decoder.use_graphs(graphs)
    seconds = time.perf_counter() - t0
    log.info("static decode step: %d compiled graphs (%d loaded from %s) in %.1f s",
             len(graphs), loaded, folder, seconds)
    return seconds
