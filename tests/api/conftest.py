"""Fixtures for the end-to-end API tests: one tiny checkpoint per session."""
from __future__ import annotations

import httpx
import pytest

from tests.api.daemon_proc import tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))


@pytest.fixture(scope="module")
def http(daemon):
    """An httpx client on the business plane of the module's ``daemon`` fixture."""
    with httpx.Client(base_url=daemon.base, timeout=60) as c:
        yield c
