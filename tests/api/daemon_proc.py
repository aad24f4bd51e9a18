"""The tests' names for the daemon launcher, which lives in server/testing/daemon.py (the
benchmarks and the soak and hostile-client checks use it too).

Tests share one daemon per module; the fixture's teardown sends SIGTERM and checks the
drain ends with exit code 0.
"""
from server.testing.daemon import (DEMO_MODEL, MODEL_NAME, READY, ROOT, Daemon,
                                   demo_model_ready, free_port, make_config, process_alive,
                                   tiny_checkpoint)

__all__ = ["DEMO_MODEL", "MODEL_NAME", "READY", "ROOT", "Daemon", "demo_model_ready", "free_port",
           "make_config", "process_alive", "tiny_checkpoint"]
