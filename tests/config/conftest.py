"""Fixtures for config tests: a fake weights folder and a config-file builder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.config.cfgkit import edited, minimal, write_weights


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    return write_weights(tmp_path / "tiny-model")


@pytest.fixture
def build(tmp_path: Path, weights: Path) -> Callable[..., Path]:
    """build(edits, base=minimal()) -> path of a config.json next to the tiny-model folder."""
    def _build(edits: dict[str, Any] | None = None, base: dict | None = None,
               name: str = "config.json") -> Path:
        file = tmp_path / name
        file.write_text(json.dumps(edited(base if base is not None else minimal(), edits), indent=2))
        return file
    return _build
