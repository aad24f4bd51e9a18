"""The daemon over a rank group (worldSize 2, gloo on this CPU) against one process.

Same answers (greedy and seeded, streamed and not, with tools and reasoning) from a
tp=2 daemon, from a two-"node" group (two launchers on loopback, one rank each,
multiNodesInferEnabled, moe_ep=2) and from the one-process daemon, all with MTP k=2 on
the demo model (fixed k, so the acceptance counters can be compared); then a rank killed mid-stream: the stream ends with an error within 30 s,
/health answers 503, the daemon exits 1 and leaves no process behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server.testing.daemon import (MODEL_NAME, ROOT, Daemon, demo_model_ready, free_port,
                                   make_config, process_alive)
from tests.daemon.answers import K2, answers, metric

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.demo,
              pytest.mark.skipif(not demo_model_ready(), reason="demo model not present")]
DEMO = ROOT / "models" / "deepseek-v3-tiny-mtp"


def _env() -> dict:
    # /health's 503 is read at once after the failure: 2 s of it is enough (default 5).
    return {"MTP_SERVE_COMPILE": "0", "MTP_SERVE_FATAL_EXIT_DELAY": "2"}


def _answers(d: Daemon) -> list:
    return answers(d.base)


def _acceptance(d: Daemon) -> tuple[int, int]:
    return (int(metric(d.metrics, "spec_decode_num_draft_tokens_total")),
            int(metric(d.metrics, "spec_decode_num_accepted_tokens_total")))


@pytest.fixture(scope="module")
def reference(demo_k2_reference):
    """The one-process daemon's answers and (drafts, accepted drafts): conftest.py's, with
    the engine on a thread (test_daemon_engine_process holds the engine process to it)."""
    ref_answers, counters = demo_k2_reference
    return ref_answers, counters[:2]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_tp2_daemon_answers_like_one_process_then_survives_a_dead_rank(tmp_path, reference):
    ref_answers, ref_acceptance = reference
    cfg = make_config(tmp_path, DEMO, model={**K2, "worldSize": 2},
                      backend={"npuDeviceIds": [[0, 1]]})
    d = Daemon(cfg, env=_env()).start()
    try:
        assert _answers(d) == ref_answers
        assert _acceptance(d) == ref_acceptance         # drafts and accepted counts equal
        status = d.status()
        par = status["runtime"]["parallel"]
        assert (par["world_size"], par["moe_tp"], par["moe_ep"]) == (2, 2, 1)
        pids = par["worker_pids"]
        assert len(pids) == 2 and all(process_alive(p) for p in pids)

        # A long stream, then rank 1 dies under it.
        client = openai.OpenAI(base_url=d.base + "/v1", api_key="none", timeout=60, max_retries=0)
        stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", stream=True,
                                           max_tokens=400, temperature=0,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception) as err:
            for _chunk in stream:
                pass
        assert time.monotonic() - t0 < 30
        assert "rank" in str(err.value) or "worker" in str(err.value)
        assert httpx.get(d.base + "/health", timeout=5).status_code == 503
        st = d.status()
        assert st["status"] == "unhealthy" and "rank" in st["error"]
        r = httpx.post(d.base + "/v1/completions", timeout=10, json={      # was 500 (issue 58)
            "model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 503 and "rank" in r.json()["error"]["message"], r.text
        assert d.proc.wait(30) == 1
        assert "worker group failed" in d.output()
        deadline = time.monotonic() + 15
        while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(process_alive(p) for p in pids), "a rank outlived the daemon"
    finally:
        d.kill()


def test_two_node_group_on_loopback(tmp_path, reference):
    ref_answers, _ = reference
    cfg = make_config(tmp_path, DEMO, model={**K2, "worldSize": 2, "moe_ep": 2},
                      backend={"multiNodesInferEnabled": True, "interNodeTLSEnabled": False})
    env = {**_env(), "NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    node1 = subprocess.Popen([sys.executable, "-m", "server", "--config-file", str(cfg)],
                             cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env,
                                            "NODE_RANK": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    d = Daemon(cfg, env={**env, "NODE_RANK": "0"})
    try:
        d.start()
        pids = d.status()["runtime"]["parallel"]["worker_pids"]
        assert len(pids) == 1                             # rank 0 here, rank 1 on "node 1"
        assert _answers(d) == ref_answers
        assert d.terminate() == 0                          # SIGTERM: drain, stop every rank
        assert not any(process_alive(p) for p in pids)
        out, _ = node1.communicate(timeout=30)
        assert node1.returncode == 0, out
        assert "the group was shut down" in out
    finally:
        d.kill()
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)
