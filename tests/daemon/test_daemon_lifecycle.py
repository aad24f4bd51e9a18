"""Start and stop of the real daemon as an operator sees them in its output.

numpy is only in the test extra, so the daemon runs here with numpy hidden (a package on
PYTHONPATH that fails to import, as a missing one does), with async scheduling on so the
spawned worker process imports torch too: no "Failed to initialize NumPy" warning from
either. A stop with a request in flight waits for it and logs that the drain finished.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from server.testing.daemon import MODEL_NAME, Daemon, make_config

pytestmark = pytest.mark.slow          # starts a real daemon


@pytest.fixture(scope="module")
def daemon(tiny_weights, tmp_path_factory):
    shim = tmp_path_factory.mktemp("no-numpy")
    (shim / "numpy").mkdir()
    (shim / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    path = os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {"PYTHONPATH": path, "MINDIE_ASYNC_SCHEDULING_ENABLE": "1",
           "PYTHONWARNINGS": "default"}
    d = Daemon(make_config(tmp_path_factory.mktemp("cfg-life"), tiny_weights), env=env,
               log_level="info").start()
    yield d
    d.kill()


def test_no_numpy_warning_and_the_drain_is_logged(daemon):
    status = daemon.status()
    assert status["async_scheduling_enabled"] is True, status
    result = {}

    def long_request() -> None:
        r = httpx.post(daemon.base + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": "count", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0})
        result["status"] = r.status_code

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while daemon.status()["in_flight"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(120) == 0, daemon.output()[-3000:]
    t.join(30)
    out = daemon.output()
    assert result.get("status") == 200, out[-3000:]
    assert "drain finished:" in out, out[-3000:]
    assert "NumPy" not in out, out
