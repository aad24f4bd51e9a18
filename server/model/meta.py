"""Modules built on the meta device, without their random initialisation.

Every model here is built on the meta device and then given loaded (or generated) tensors,
so the init a constructor runs is wasted.  It is also slow the first time: on a meta tensor
``normal_`` / ``uniform_`` run as Python reference decompositions that import
``torch._dynamo``, about 2 s of a 3 s daemon start on a 2-core machine (the engine process
would pay it on every start).  So the model's layers skip their init on the meta device
(layers/linear.py's Linear and Embedding, the MoE router), as transformers'
``no_init_weights`` does, without touching ``torch.nn.init`` for the process.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """``with torch.device("meta")``: modules built inside hold no storage."""
    with torch.device("meta"):
        yield
