"""The one launcher of real daemons (``python -m server --config-file ...``) for the tests,
the benchmarks (benchmarks/) and the soak and hostile-client checks.

A daemon runs on free loopback ports, over plain HTTP, from a MindIE config made from the
checkout's conf/config.json (``make_config``: the tests' small limits) or from any config
(``daemon_config`` + ``write_config``: the benchmarks keep the config's own limits).
``Daemon.start`` waits for the ready line; ``terminate`` sends SIGTERM and returns the
exit code of the drain; ``kill`` ends it at once.  The output is kept in memory
(``output()``).

Used from a checkout (an editable install, or the repository root as the working
directory): ROOT is the checkout that holds this file, with its conf/ and models/.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "conf" / "config.json"
DEMO_MODEL = ROOT / "models" / "deepseek-v3-tiny-mtp"
READY = "Daemon start success!"
COORDINATOR_READY = "Coordinator start success"
MODEL_NAME = "tiny-mtp"

_GIVEN: set[int] = set()


def start_all(*daemons: "Daemon", timeout_s: float = 180) -> tuple["Daemon", ...]:
    """Start several daemons side by side (each start is mostly one core's imports and
    model load), then wait for each; all of them are killed if one fails to start."""
    try:
        for d in daemons:
            d.launch()
        for d in daemons:
            d.wait_ready(timeout_s)
    except BaseException:
        for d in daemons:
            if d.proc is not None:
                d.kill()
        raise
    return daemons


def free_port() -> int:
    """A loopback port nobody listens on, never one this process was given before.

    Taken below the kernel's ephemeral range: a port from ``bind(0)`` is free only until the
    socket closes, and in the seconds before the daemon binds it any outbound connection on
    the machine (another test's client, a rank's rendezvous) may be handed it, and a daemon
    then fails to start with "Address already in use".  Below the range nothing is handed
    out implicitly; each pytest-xdist worker draws from its own slice, each process from its
    own offset in it, and a port is checked bindable before it is given."""
    window = _port_window()
    if not window:
        return _ephemeral_port()
    start = (os.getpid() * 7919) % len(window)
    for i in range(len(window)):
        port = window[(start + i) % len(window)]
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    return _ephemeral_port()


def _port_window() -> range:
    """This process's slice of the ports just below the ephemeral range (empty when that
    range starts too low to leave room)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    bottom = max(10000, low - 16384)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    index = int(worker) % workers if worker.isdigit() else 0
    size = (low - bottom) // workers
    return range(bottom + index * size, bottom + (index + 1) * size) if size >= 64 else range(0)


def _ephemeral_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def process_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie is gone for our purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def demo_model_ready() -> bool:
    return (DEMO_MODEL / "config.json").is_file() and any(DEMO_MODEL.glob("*.safetensors"))


def tiny_checkpoint(dir: Path) -> Path:
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(dir, seed=0)


def daemon_config(base: Path = DEFAULT_CONFIG, *, same_mgmt_metrics: bool = True) -> dict:
    """The MindIE config ``base`` on free loopback ports (management and metrics on one
    port unless ``same_mgmt_metrics`` is false), plain HTTP, its weight path absolute."""
    doc = json.loads(base.read_text())
    port, mport = free_port(), free_port()
    doc["ServerConfig"].update({
        "ipAddress": "127.0.0.1", "managementIpAddress": "127.0.0.1", "port": port,
        "managementPort": mport, "metricsPort": mport if same_mgmt_metrics else free_port(),
        "httpsEnabled": False})
    mc = doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    weights = Path(mc["modelWeightPath"])
    if not weights.is_absolute():
        mc["modelWeightPath"] = str((base.parent / weights).resolve())
    return doc


def write_config(folder: Path, doc: dict) -> Path:
    path = folder / "config.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def make_config(folder: Path, weights: Path, *, server: dict | None = None,
                deploy: dict | None = None, schedule: dict | None = None,
                model: dict | None = None, same_mgmt_metrics: bool = True,
                backend: dict | None = None) -> Path:
    """A test daemon's config.json in ``folder``: conf/config.json on loopback ports with
    small limits (64 links, 1 MB bodies, maxSeqLen 512), serving ``weights`` as
    MODEL_NAME; each dict updates its section."""
    doc = daemon_config(DEFAULT_CONFIG, same_mgmt_metrics=same_mgmt_metrics)
    doc["ServerConfig"].update({"maxLinkNum": 64, "tokenTimeout": 60, "e2eTimeout": 120,
                                "maxRequestLength": 1})
    doc["ServerConfig"].update(server or {})
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
    return write_config(folder, doc)


class Daemon:
    """One daemon process.  ``module`` "server.pd" with ``ready=COORDINATOR_READY`` runs the
    PD coordinator (its config has its ports at the top level).  ``log_level`` None leaves
    the config's.  ``new_session``: the daemon and the processes it starts (tensor-parallel
    ranks) get their own process group, which ``terminate`` and ``kill`` signal as a whole,
    and a Ctrl-C of the caller does not reach them (the caller stops them itself)."""

    def __init__(self, config: Path, env: dict | None = None, log_level: str | None = "warning", *,
                 cwd: Path = ROOT, module: str = "server", ready: str = READY,
                 new_session: bool = False) -> None:
        self.config = config
        self.log_level = log_level
        self.cwd, self.module, self.ready, self.new_session = cwd, module, ready, new_session
        doc = json.loads(config.read_text())
        srv = doc.get("ServerConfig", doc)
        scheme = "https" if srv.get("httpsEnabled") else "http"
        self.base = f"{scheme}://127.0.0.1:{srv['port']}"
        self.mgmt = f"{scheme}://127.0.0.1:{srv.get('managementPort', srv['port'])}"
        self.metrics = f"{scheme}://127.0.0.1:{srv.get('metricsPort', srv['port'])}"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.launched = 0.0             # time.monotonic() at launch
        self.start_s = 0.0              # launch to the ready line
        self._ready = threading.Event()

    def start(self, timeout_s: float = 180) -> "Daemon":
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> "Daemon":
        """Start the process and return at once (``wait_ready`` waits for the ready line)."""
        cmd = [sys.executable, "-m", self.module, "--config-file", str(self.config)]
        if self.log_level:
            cmd += ["--log-level", self.log_level]
        self.launched = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     start_new_session=self.new_session)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def wait_ready(self, timeout_s: float = 180) -> "Daemon":
        deadline = self.launched + timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.module} did not start:\n" + "".join(self.lines[-60:]))
        self.start_s = time.monotonic() - self.launched
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.ready in line:
                self._ready.set()

    def output(self) -> str:
        return "".join(self.lines)

    def status(self) -> dict:
        import httpx
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

    def _signal(self, sig: int) -> None:
        if self.new_session:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        else:
            self.proc.send_signal(sig)

    def terminate(self, timeout_s: float = 60) -> int:
        """SIGTERM (the drain), then its exit code; killed when it outlasts ``timeout_s``."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGKILL)
            self.proc.wait(10)
