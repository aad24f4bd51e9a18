"""A test that crashes its process ends the run, fast, naming the test.

Why: on an AVX-512 CPU a private torch operator segfaulted a pytest-xdist worker; xdist
replaced it, and the suite then idled for ever with ~3% of its tests left, so CI ran to its
time limit.  scripts/test.sh now runs xdist with ``--max-worker-restart 0`` and the warm-up
waiters give up on a dead warmer (tests/conftest.py).  Here a throwaway suite with a test
that segfaults on purpose runs under scripts/test.sh's own settings (its xdist arguments,
pyproject.toml's ini options, this suite's conftest as a plugin).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_segfaulting_test_fails_the_suite_within_a_minute_with_its_name(tmp_path):
    (tmp_path / "test_a_native.py").write_text(
        "import os, signal\n\n\ndef test_segfaults_on_purpose():\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n")
    for i in range(12):                  # tests after it: the other worker may still run them
        (tmp_path / f"test_after_{i:02d}.py").write_text(
            "import time\n\n\ndef test_takes_a_moment():\n    time.sleep(0.25)\n")
    env = {**os.environ, "MTP_TEST_WORKERS": "2", "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), "-c", str(ROOT / "pyproject.toml"),
                           "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert elapsed < 60, (elapsed, out[-3000:])
    assert "crashed while running 'test_a_native.py::test_segfaults_on_purpose'" in out, out[-3000:]
    assert "FAILED test_a_native.py::test_segfaults_on_purpose" in out, out[-3000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed is None or int(passed.group(1)) < 12, out[-2000:]   # it stopped, not went on
    sys.stdout.write(f"\nthe crash ended the run in {elapsed:.1f} s\n")
