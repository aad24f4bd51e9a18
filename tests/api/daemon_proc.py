"""Start the real daemon (``python -m server --config-file ...``) on free loopback ports.

Tests share one daemon per module; the fixture's teardown sends SIGTERM and checks the
drain ends with exit code 0.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = ROOT / "models" / "deepseek-v3-tiny-mtp"
READY = "Daemon start success!"
MODEL_NAME = "tiny-mtp"


def process_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie is gone for our purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on, never one this process was given before: the
    kernel may hand a just-released port out again, and one config takes two or three."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def tiny_checkpoint(dir: Path) -> Path:
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(dir, seed=0)


def demo_model_ready() -> bool:
    return (DEMO_MODEL / "config.json").is_file() and any(DEMO_MODEL.glob("*.safetensors"))


def make_config(folder: Path, weights: Path, *, server: dict | None = None,
                deploy: dict | None = None, schedule: dict | None = None,
                model: dict | None = None, same_mgmt_metrics: bool = True,
                backend: dict | None = None) -> Path:
    """A MindIE config.json for the test daemon, based on the project's conf/config.json."""
    doc = json.loads((ROOT / "conf" / "config.json").read_text())
    doc = copy.deepcopy(doc)
    srv = doc["ServerConfig"]
    port, mport = free_port(), free_port()
    srv.update({"ipAddress": "127.0.0.1", "managementIpAddress": "127.0.0.1", "port": port,
                "managementPort": mport, "metricsPort": mport if same_mgmt_metrics else free_port(),
                "httpsEnabled": False, "maxLinkNum": 64, "tokenTimeout": 60, "e2eTimeout": 120,
                "maxRequestLength": 1})
    srv.update(server or {})
    dep = doc["BackendConfig"]["ModelDeployConfig"]
    dep.update({"maxSeqLen": 512, "maxInputTokenLen": 384, "truncation": 0})
    dep.update(deploy or {})
    mc = dep["ModelConfig"][0]
    mc.update({"modelName": MODEL_NAME, "modelWeightPath": str(weights)})
    mc.update(model or {})
    sch = doc["BackendConfig"]["ScheduleConfig"]
    sch.update({"maxIterTimes": 256, "maxPrefillTokens": 4096})
    sch.update(schedule or {})
    doc["BackendConfig"].update(backend or {})
    path = folder / "config.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


class Daemon:
    def __init__(self, config: Path, env: dict | None = None, log_level: str = "warning") -> None:
        self.config = config
        self.log_level = log_level
        doc = json.loads(config.read_text())["ServerConfig"]
        scheme = "https" if doc.get("httpsEnabled") else "http"
        self.base = f"{scheme}://127.0.0.1:{doc['port']}"
        self.mgmt = f"{scheme}://127.0.0.1:{doc['managementPort']}"
        self.metrics = f"{scheme}://127.0.0.1:{doc['metricsPort']}"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def start(self, timeout_s: float = 180) -> "Daemon":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--config-file", str(self.config),
             "--log-level", self.log_level],
            cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("daemon did not start:\n" + "".join(self.lines[-60:]))
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if READY in line:
                self._ready.set()

    def output(self) -> str:
        return "".join(self.lines)

    def status(self) -> dict:
        return httpx.get(self.mgmt + "/v1/status", timeout=10).json()

    def wait_kv_free(self, timeout_s: float = 10) -> dict:
        """Poll /v1/status until no request runs and the KV pool is fully free."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            kv = st["kv_cache"]
            free = kv["usage"] == 0 or (kv["free_blocks"] is not None and
                                        kv["free_blocks"] == kv["total_blocks"])
            if free and st["engine"]["num_requests_running"] == 0:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"KV pool not free: {st}")
            time.sleep(0.05)

    def terminate(self, timeout_s: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
