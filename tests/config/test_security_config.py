"""Security-related config: every spelling of "all interfaces", API keys from file and env."""
from __future__ import annotations

import pytest

from server.config import ConfigError, parse_config
from tests.config.cfgkit import edited, minimal, write_weights

ALL_INTERFACES = ["0.0.0.0", "::", "::0", "0:0:0:0:0:0:0:0", "::0.0.0.0", "::ffff:0.0.0.0",
                  "0000:0000:0000:0000:0000:0000:0000:0000"]


def _parse(tmp_path, edits=None, env=None):
    write_weights(tmp_path / "tiny-model")
    return parse_config(edited(minimal(), edits), base_dir=tmp_path, env=env or {})


@pytest.mark.parametrize("key", ["ipAddress", "managementIpAddress"])
@pytest.mark.parametrize("ip", ALL_INTERFACES)
def test_all_interfaces_needs_the_switch(tmp_path, key, ip):
    with pytest.raises(ConfigError) as err:
        _parse(tmp_path, {f"ServerConfig.{key}": ip})
    assert f"ServerConfig.{key}" in str(err.value) and "allowAllZeroIpListening" in str(err.value)
    cfg = _parse(tmp_path, {f"ServerConfig.{key}": ip, "ServerConfig.allowAllZeroIpListening": True})
    assert cfg.server.allow_all_zero_ip_listening


@pytest.mark.parametrize("ip", ["127.0.0.1", "::1", "10.1.2.3", "::ffff:127.0.0.1"])
def test_specific_addresses_need_no_switch(tmp_path, ip):
    assert _parse(tmp_path, {"ServerConfig.ipAddress": ip}).server.ip_address == ip


def test_api_keys_from_file_and_env_are_merged_and_never_printed(tmp_path):
    cfg = _parse(tmp_path, {"ServerConfig.apiKeys": ["file-key-0001"]},
                 env={"MTP_SERVE_API_KEY": "env-key-0001, env-key-0002,file-key-0001"})
    assert cfg.api_keys == ("file-key-0001", "env-key-0001", "env-key-0002")
    shown = str(cfg.to_dict())
    assert "key-0001" not in shown and "key-0002" not in shown
    assert cfg.to_dict()["Derived"]["apiKeys"] == 3


@pytest.mark.parametrize("edits, env", [
    ({"ServerConfig.apiKeys": ["short"]}, {}),
    ({"ServerConfig.apiKeys": ["has space-1234"]}, {}),
    ({"ServerConfig.apiKeys": "not-a-list-123"}, {}),
    ({}, {"MTP_SERVE_API_KEY": "tiny"}),
])
def test_unusable_api_keys_are_refused_without_echo(tmp_path, edits, env):
    with pytest.raises(ConfigError) as err:
        _parse(tmp_path, edits, env)
    text = str(err.value)
    assert "apiKeys" in text or "MTP_SERVE_API_KEY" in text
    for secret in ("short", "has space", "not-a-list", "tiny\""):
        assert secret not in text.replace("tiny-model", "")
