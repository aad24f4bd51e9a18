"""Fixtures for the end-to-end API tests: one tiny checkpoint per session."""
from __future__ import annotations

import pytest

from tests.api.daemon_proc import tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))
