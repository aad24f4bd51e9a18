"""scripts/_bootstrap.sh picks the torch build a machine can use, without installing it.

Why: on a machine without a GPU, a plain ``pip install torch`` resolves the CUDA build on
Linux (several GB of nvidia-* packages); the bootstrap must ask PyTorch's CPU wheel index
when it answers, fall back to the configured index quickly when it does not (offline
mirrors), and still install the project.  These tests run the real shell functions with
a fake virtualenv whose ``pip`` only records its arguments, and a real local HTTP server
standing in for the CPU index.
"""
from __future__ import annotations

import functools
import http.server
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A fake .venv: ``python -c 'import torch'`` fails unless $FAKE_TORCH is set; ``pip``
    appends its arguments, one call per line, to pip.log."""
    v = tmp_path / "venv"
    (v / "bin").mkdir(parents=True)
    py = v / "bin" / "python"
    py.write_text('#!/bin/bash\n[ "$1 $2" = "-c import torch" ] && [ -z "${FAKE_TORCH:-}" ] && exit 1\n'
                  "exit 0\n")
    pip = v / "bin" / "pip"
    pip.write_text(f'#!/bin/bash\necho "$*" >> "{v}/pip.log"\n')
    py.chmod(0o755)
    pip.chmod(0o755)
    return v


@pytest.fixture
def cpu_index(tmp_path: Path):
    """A reachable wheel index (its /torch/ page answers 200)."""
    (tmp_path / "index" / "whl" / "cpu" / "torch").mkdir(parents=True)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"


def bootstrap(venv: Path, tmp_path: Path, *, gpu: bool, index: str, extras: str = "test",
              **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    fake_bin = tmp_path / "fakebin"
    fake_bin.mkdir(exist_ok=True)
    smi = fake_bin / "nvidia-smi"                # shadows a real one on GPU machines
    smi.write_text(f"#!/bin/bash\nexit {0 if gpu else 1}\n")
    smi.chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("MTP_", "TORCH_", "FAKE_"))}
    full_env.update(PATH=f"{fake_bin}:{os.environ['PATH']}", MTP_VENV=str(venv),
                    TORCH_CPU_INDEX=index, **env)
    proc = subprocess.run(["bash", "-c", f'source scripts/_bootstrap.sh && bootstrap_venv "{extras}"'],
                          cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=60)
    log = venv / "pip.log"
    return proc, log.read_text().splitlines() if log.exists() else []


def test_no_gpu_uses_the_cpu_index_when_it_answers(venv, tmp_path, cpu_index):
    proc, calls = bootstrap(venv, tmp_path, gpu=False, index=cpu_index)
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"install -q --extra-index-url {cpu_index} {TORCH}",
                     f"install -q -e {ROOT}[test]"]
    assert "CPU build" in proc.stderr
    assert (venv / ".installed-test").is_file()


def test_no_gpu_falls_back_to_the_configured_index_fast(venv, tmp_path):
    index = closed_port_url()
    t0 = time.monotonic()
    proc, calls = bootstrap(venv, tmp_path, gpu=False, index=index)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 15
    assert calls == [f"install -q {TORCH}", f"install -q -e {ROOT}[test]"]
    assert f"{index} is not reachable" in proc.stderr


def test_gpu_takes_the_default_build(venv, tmp_path, cpu_index):
    proc, calls = bootstrap(venv, tmp_path, gpu=True, index=cpu_index, extras="")
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"install -q {TORCH}", f"install -q -e {ROOT}"]
    assert "GPU found" in proc.stderr


def test_cpu_build_can_be_forced_on_a_gpu_machine(venv, tmp_path, cpu_index):
    proc, calls = bootstrap(venv, tmp_path, gpu=True, index=cpu_index, MTP_TORCH_BUILD="cpu")
    assert proc.returncode == 0, proc.stderr
    assert calls[0] == f"install -q --extra-index-url {cpu_index} {TORCH}"


def test_unknown_build_is_refused(venv, tmp_path, cpu_index):
    proc, calls = bootstrap(venv, tmp_path, gpu=False, index=cpu_index, MTP_TORCH_BUILD="rocm")
    assert proc.returncode != 0 and "allowed: auto, cpu, cuda" in proc.stderr
    assert calls == []


def test_installed_torch_is_kept_and_a_current_stamp_skips_everything(venv, tmp_path, cpu_index):
    proc, calls = bootstrap(venv, tmp_path, gpu=False, index=cpu_index, FAKE_TORCH="1")
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"install -q -e {ROOT}[test]"]                 # torch already there
    (venv / "pip.log").unlink()
    proc, calls = bootstrap(venv, tmp_path, gpu=False, index=cpu_index)
    assert proc.returncode == 0 and calls == []                      # stamp newer than pyproject
