"""This process's kernel settings: the environment variables server/config/kernel_env.py
parses and checks, read once (the loader asks; ``--check`` has already refused a bad one)."""
from __future__ import annotations

import functools
import os

from server.config.kernel_env import (
    DRAFT_HEAD_ENV,
    DRAFT_LAYER_ENV,
    GREEDY_HEAD_ENV,
    HALF_BACKENDS,
    HALF_ENV,
    INT8_BACKENDS,
    INT8_ENV,
    KERNEL_CACHE_ENV,
    KERNEL_ENV,
    KernelSettingError,
    KernelSettings,
    parse,
)

__all__ = ["DRAFT_HEAD_ENV", "DRAFT_LAYER_ENV", "GREEDY_HEAD_ENV", "HALF_BACKENDS", "HALF_ENV", "INT8_BACKENDS", "INT8_ENV", "KERNEL_CACHE_ENV",
           "KERNEL_ENV", "KernelSettingError", "KernelSettings", "kernel_settings", "parse"]


@functools.lru_cache(maxsize=None)
def kernel_settings() -> KernelSettings:
    """This process's settings (from os.environ, the first time they are asked for)."""
    return parse(os.environ)
