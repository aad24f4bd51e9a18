"""Fixtures for the tests that start a real daemon (``python -m server``)."""
from __future__ import annotations

import httpx
import pytest

from server.testing.daemon import DEMO_MODEL, Daemon, make_config
from tests.daemon.answers import K2, answers, metric


@pytest.fixture(scope="package")
def plain_daemon(tiny_weights, tmp_path_factory):
    """The tiny checkpoint on conf/config.json's settings (MTP on) with make_config's small
    limits, shared by every module that needs nothing else: they read its state and send
    it requests, none reconfigures or stops it.  Drained (exit code 0) after the last test
    of tests/daemon."""
    d = Daemon(make_config(tmp_path_factory.mktemp("cfg-plain"), tiny_weights)).start()
    yield d
    assert d.terminate() == 0, d.output()[-3000:]


@pytest.fixture(scope="module")
def http(daemon):
    """An httpx client on the business plane of the module's ``daemon`` fixture."""
    with httpx.Client(base_url=daemon.base, timeout=60) as c:
        yield c


@pytest.fixture(scope="package")
def demo_k2_reference(tmp_path_factory):
    """The demo model with MTP k=2 (fixed) in one process, the engine on a thread of the
    serving process ($MTP_SERVE_ENGINE_PROCESS=0): the answers of tests/daemon/answers.py
    and the counters after them (drafts and accepted drafts from /metrics, requests
    finished and tokens from /v1/status).  Started once for test_daemon_engine_process
    (the engine process must match it) and test_daemon_parallel (rank groups must)."""
    d = Daemon(make_config(tmp_path_factory.mktemp("demo-k2-thread"), DEMO_MODEL, model=K2),
               env={"MTP_SERVE_COMPILE": "0", "MTP_SERVE_ENGINE_PROCESS": "0"}).start()
    try:
        runtime = d.status()["runtime"]
        assert runtime["engine_pid"] == d.proc.pid
        # What the model multiplies with, as chosen for this CPU (model/kernels/report.py):
        # the demo model is float32, so torch's own products; no int8 layers.
        from server.model.kernels import CPU_CLASSES, cpu_caps
        kernels = runtime["kernels"]
        assert kernels["cpu_class"] == cpu_caps().cpu_class in CPU_CLASSES
        assert (kernels["products"], kernels["int8_backend"]) == ("torch", "none")
        ref = answers(d.base)
        engine = d.status()["engine"]
        counters = (int(metric(d.metrics, "spec_decode_num_draft_tokens_total")),
                    int(metric(d.metrics, "spec_decode_num_accepted_tokens_total")),
                    engine["num_requests_finished"], engine["num_generation_tokens"])
        return ref, counters
    finally:
        assert d.terminate() == 0
