"""Helpers for config tests: dotted-path edits, a fake weights folder, the JSON fixtures, the
``python -m server`` command line."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
DELETE = object()          # edit value meaning "remove this key"
MC0 = "BackendConfig.ModelDeployConfig.ModelConfig[0]"


def set_path(doc: dict, path: str, value: Any) -> None:
    """Set (or with DELETE remove) ``A.B[0].c`` in ``doc``, creating objects on the way."""
    parts: list[str | int] = []
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        parts.append(int(index) if index else name)
    node: Any = doc
    for part in parts[:-1]:
        if isinstance(part, str) and part not in node:
            node[part] = {}
        node = node[part]
    if value is DELETE:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value


def write_weights(folder: Path, model_type: str = "deepseek_v3") -> Path:
    """The least a weights folder needs for config validation: config.json with model_type."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 64}))
    return folder


def minimal() -> dict:
    """Model name and weight path only (relative: resolves against the config's folder)."""
    return {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [
        {"modelName": "tiny", "modelWeightPath": "tiny-model"}]}}}


def fixture(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def edited(base: dict, edits: dict[str, Any] | None) -> dict:
    doc = copy.deepcopy(base)
    for path, value in (edits or {}).items():
        set_path(doc, path, value)
    return doc


def run_cli(*args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python -m server *args`` from the checkout, without the caller's MIES_/MINDIE_ variables."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
    full_env["PYTHONPATH"] = str(REPO)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=60)
