"""Suite-wide settings: keep torch to the machine's cores and make runs repeatable."""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Daemons the tests start run uncompiled (a compile costs 15-60 s per start); the compiled
# step has its own tests, which ask for it (tests/engine/test_compiled_step.py).
os.environ.setdefault("MTP_SERVE_COMPILE", "0")

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
