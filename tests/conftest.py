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
