"""Suite-wide settings (one torch thread, runs repeatable) and the fixtures of more than one
folder."""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Daemons the tests start run uncompiled (a compile costs 15-60 s per start); the compiled
# step has its own tests, which ask for it (tests/engine/test_compiled_step.py).
os.environ.setdefault("MTP_SERVE_COMPILE", "0")
# Inductor compiles in this process rather than through a pool of worker processes: on
# two cores the pool's start-up (each worker imports torch) costs more than it saves.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread: the tests run tiny models, where a second thread only adds
# synchronisation, and on a shared 2-core machine its spin-waits slow every step badly.
# (Daemons the tests start set their own threads.)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    """One random tiny checkpoint (with MTP weights) per session, for the daemon tests and
    the daemon's start-up units."""
    from server.testing.daemon import tiny_checkpoint
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """The demo model through training/quantize.py, once per session: msModelSlim W8A8
    mixed (static attention, dynamic MLPs), W4A8 experts, compressed-tensors int8 (every
    linear W8A8_DYNAMIC) and FA3 KV scales.  Name -> checkpoint directory."""
    from pathlib import Path
    from training import quantize
    demo = Path(__file__).resolve().parents[1] / "models" / "deepseek-v3-tiny-mtp"
    if not any(demo.glob("*.safetensors")):
        pytest.skip("demo model weights not present")
    out = {}
    for name, extra in (("w8a8", []), ("w4a8", ["--w4a8-experts"]),
                        ("ct", ["--format", "compressed-tensors"]), ("fa3", ["--fa-quant"])):
        out[name] = tmp_path_factory.mktemp(name)
        assert quantize.main([str(demo), str(out[name]), "--calib-samples", "32", *extra]) == 0
    return out


# -- the compiled-step tests' graphs, made while the rest of the suite runs -----------------
_WARM: list = []


def pytest_collection_finish(session):
    """The compiled-step tests need 17 graphs of the demo model (MTP k=2), 35-45 s of
    compile on two cores when the cache is cold.  The suite leaves about one core idle on
    average, so one compile child starts now, at one thread, and the tests wait for it
    (``warm_compile``) when they get there; a graph it has not made yet they make
    themselves (files are written atomically, so two makers never clash)."""
    if os.environ.get("MTP_SERVE_TEST_WARM_COMPILE", "1") == "0":
        return
    if not any(item.nodeid.startswith("tests/engine/test_compiled_step.py") for item in session.items):
        return
    import tempfile
    from pathlib import Path

    from server.engine.worker import compile_step
    from server.model.loader import load_checkpoint
    from server.testing.daemon import DEMO_MODEL, demo_model_ready
    if not demo_model_ready():
        return
    model, _ = load_checkpoint(DEMO_MODEL)
    device = torch.device("cpu")
    folder = compile_step.cache_dir(model, device)
    files = [f for r in compile_step.graph_rounds(model, 3) for f in r if not (folder / f).is_file()]
    if files:
        tmp = Path(tempfile.mkdtemp(prefix="mtp-warm-compile-"))
        _WARM.append(compile_step.spawn_compile_child(model, 16, device, folder, 3, files, tmp / "warm")[0])


def pytest_sessionfinish(session, exitstatus):
    for proc in _WARM:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="session")
def warm_compile():
    """Waits for the compile child ``pytest_collection_finish`` started, if any."""
    for proc in _WARM:
        proc.wait(timeout=900)
