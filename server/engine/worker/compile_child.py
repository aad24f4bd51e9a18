"""The child processes that compile the static step's graphs (compile_step.py says why
and when): each rebuilds the serving model from its description (config, every tensor's
dtype, its int8 layers, its rank's shard) on uninitialised memory, since the graphs take
the weights as inputs, and makes the graphs it was given into the cache folder.

Here: how a child is described and started, and the empty model it rebuilds.  A child
runs ``python -m server.engine.worker.compile_step SPEC`` (compile_step.run_child): the
graphs are made by the module that makes them in the serving process too, and this one
imports nothing of it (compile_step imports this one).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import torch

from server.model.kernels.native import native_ops
from server.model.kernels.products import use_products
from server.model.kernels.select import products_named
from server.model.meta import meta_device
from server.model.quant.linear import QuantLinear

_ROOT = Path(__file__).resolve().parents[3]        # where ``server`` imports from


def tensor_dtypes(model) -> dict[str, torch.dtype]:
    """The dtype of every parameter and buffer: a graph is made for these exactly (the
    loader keeps the router in float32 in a bf16 model, for one)."""
    derived = {f"{prefix}{'.' if prefix else ''}{name}" for prefix, m in model.named_modules()
               for name in m._non_persistent_buffers_set}
    # Not the stacks the worker derives from the weights (model.stack_projections, which
    # the child repeats): a model's graphs are the same before and after.
    return {name: t.dtype for name, t in (*model.named_parameters(), *model.named_buffers())
            if name not in derived}


def spawn_compile_child(model, block_size: int, device: torch.device, folder: Path,
                        max_query_len: int, files: list[str], stem: Path, *, cpp_wrapper: bool,
                        threads: int | None = None) -> tuple[subprocess.Popen, Path]:
    """One compile child for ``files``, not waited for: (the process, its log file).

    ``cpp_wrapper`` and ``threads`` (default: this process's) are what ``folder``'s key was
    made from (compile_step.cache_dir): the child compiles with them whatever its inherited
    environment says, so the graphs in a folder are always the ones its key names."""
    spec = {"config": model.config, "dtypes": tensor_dtypes(model), "int8": int8_layers(model), "products": model.products.name,
            "threads": threads or torch.get_num_threads(), "block_size": block_size,
            "device": str(device), "folder": str(folder), "max_query_len": max_query_len,
            "files": files, "plan": model.parallel_plan, "cpp_wrapper": cpp_wrapper,
            "kv_form": model.static_decoder.kv_form}
    spec_file, log_file = stem.with_suffix(".pkl"), stem.with_suffix(".log")
    spec_file.write_bytes(pickle.dumps(spec))
    with open(log_file, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "server.engine.worker.compile_step", str(spec_file)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=_ROOT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, log_file


def int8_layers(model) -> dict[str, dict]:
    """Each QuantLinear's name and make: what a compile child swaps into its empty model
    (a graph traced with a float layer where the server has an int8 one would be another
    function)."""
    return {name: dict(in_features=m.in_features, out_features=m.out_features, scheme=m.scheme,
                       backend=m.backend, bias=m.bias is not None, row_parallel=m.row_parallel)
            for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def empty_model(config, dtypes: dict[str, torch.dtype], device: torch.device,
                int8: dict[str, dict] | None = None, plan=None, products: str = "torch"):
    """The model a compile child traces: never read, so shapes and dtypes are what count,
    each tensor's as the serving model has it (a graph traced with a bf16 router would
    read the serving model's float32 one wrong, and nothing checks it at call time), and
    its int8 layers (``int8_layers``) where the serving model has them; cut as the rank's
    shard under ``plan``."""
    from server.model.deepseek_v3 import DeepseekV3ForCausalLM
    from server.model.parallel.plan import shard_model

    with meta_device():
        model = DeepseekV3ForCausalLM(config)
        if plan is not None:
            shard_model(model, plan)
            model.parallel_plan = plan
        for name, make in (int8 or {}).items():
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, QuantLinear(**make))
    model = model.to_empty(device=device)
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if name in dtypes and t.dtype != dtypes[name]:
            t.data = torch.empty_like(t, dtype=dtypes[name])
    use_products([model], products_named(products, device))
    model.stack_projections()                 # as the loader leaves the serving model
    if device.type == "cpu":
        native_ops()          # the graphs call the serving process's operators (compile_step's key)
    return model

