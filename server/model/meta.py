"""Modules built on the meta device without their random initialisation.

Every model here is built on the meta device and then given loaded (or generated) tensors,
so the init a constructor runs is wasted.  It is also slow the first time: on a meta tensor
``normal_`` / ``uniform_`` run as Python reference decompositions that import
``torch._dynamo``, about 2 s of a 3 s daemon start on a 2-core machine (the engine process
would pay it on every start).  Inside ``meta_device()`` the ``torch.nn.init`` functions
return their tensor untouched, as transformers' ``no_init_weights`` does.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                   "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                   "kaiming_normal_", "orthogonal_", "sparse_")
_lock = threading.RLock()
_depth = 0
_saved: dict[str, object] = {}


def _skip(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """``with torch.device("meta")``, with ``torch.nn.init`` a no-op meanwhile (re-entrant)."""
    global _depth
    with _lock:
        if _depth == 0:
            for name in _INIT_FUNCTIONS:
                _saved[name] = getattr(torch.nn.init, name)
                setattr(torch.nn.init, name, _skip)
        _depth += 1
    try:
        with torch.device("meta"):
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name, fn in _saved.items():
                    setattr(torch.nn.init, name, fn)
                _saved.clear()
