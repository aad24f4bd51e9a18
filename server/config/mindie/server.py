"""``ServerConfig``: the daemon's planes, their TLS, keys, limits and its PD part.

Field-local checks only; rules that read several fields are in rules.py.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import StrictBool, StrictInt, StrictStr, field_validator
from pydantic_core import PydanticCustomError

from server.config.mindie.base import F, Section


def _check_ip(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise PydanticCustomError("ip_address", "not an IP address",
                                  {"allowed": "an IPv4 or IPv6 address"}) from None
    return value


API_KEY_RULE = "8-256 printable ASCII characters, no spaces or commas"
_API_KEY = re.compile(r"[!-+\--~]{8,256}", re.ASCII)


def check_api_key(key: str) -> str:
    """A key must fit an ``Authorization`` header unchanged and not be guessable by size."""
    if not _API_KEY.fullmatch(key):
        raise PydanticCustomError("api_key", "an API key must be " + API_KEY_RULE,
                                  {"allowed": API_KEY_RULE})
    return key


def is_all_interfaces(ip: str) -> bool:
    """Every spelling of "all interfaces": 0.0.0.0, ::, ::0, 0:0:0:0:0:0:0:0, ::0.0.0.0,
    ::ffff:0.0.0.0 (a string compare let all but the first two through)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if addr.is_unspecified:
        return True
    mapped = getattr(addr, "ipv4_mapped", None)
    return mapped is not None and mapped.is_unspecified


class HealthCheckConfig(Section):
    npu_usage_threshold: StrictInt = F("npuUsageThreshold", 0, lo=0, hi=100)


class ServerConfig(Section):
    ip_address: StrictStr = F("ipAddress", "127.0.0.1", doc="Business-plane bind IP")
    management_ip_address: StrictStr | None = F(
        "managementIpAddress", None, doc="Management/metrics bind IP; absent: ipAddress")
    port: StrictInt = F("port", 1025, lo=1024, hi=65535)
    management_port: StrictInt = F("managementPort", 1026, lo=1024, hi=65535)
    metrics_port: StrictInt = F("metricsPort", 1027, lo=1024, hi=65535)
    allow_all_zero_ip_listening: StrictBool = F("allowAllZeroIpListening", False)
    # Not a MindIE key: bearer keys for the business plane (with $MTP_SERVE_API_KEY).
    api_keys: tuple[StrictStr, ...] = F("apiKeys", ())
    max_link_num: StrictInt = F("maxLinkNum", 1000, lo=1, hi=4096)
    https_enabled: StrictBool = F("httpsEnabled", True)
    full_text_enabled: StrictBool = F("fullTextEnabled", False)
    tls_ca_path: StrictStr = F("tlsCaPath", "security/ca/")
    tls_ca_file: tuple[StrictStr, ...] = F("tlsCaFile", ("ca.pem",))
    tls_cert: StrictStr = F("tlsCert", "security/certs/server.pem")
    tls_pk: StrictStr = F("tlsPk", "security/keys/server.key.pem")
    tls_pk_pwd: StrictStr = F("tlsPkPwd", "security/pass/key_pwd.txt")
    tls_crl_path: StrictStr = F("tlsCrlPath", "security/certs/")
    tls_crl_files: tuple[StrictStr, ...] = F("tlsCrlFiles", ("server_crl.pem",))
    management_tls_ca_file: tuple[StrictStr, ...] = F("managementTlsCaFile", ("management_ca.pem",))
    management_tls_cert: StrictStr = F("managementTlsCert", "security/certs/management/server.pem")
    management_tls_pk: StrictStr = F("managementTlsPk", "security/keys/management/server.key.pem")
    management_tls_pk_pwd: StrictStr | None = F("managementTlsPkPwd")
    management_tls_crl_path: StrictStr = F("managementTlsCrlPath", "security/management/certs/")
    management_tls_crl_files: tuple[StrictStr, ...] = F("managementTlsCrlFiles", ("server_crl.pem",))
    metrics_tls_ca_file: tuple[StrictStr, ...] = F("metricsTlsCaFile", ("metrics_ca.pem",))
    metrics_tls_cert: StrictStr = F("metricsTlsCert", "security/certs/metrics/server.pem")
    metrics_tls_pk: StrictStr = F("metricsTlsPk", "security/keys/metrics/server.key.pem")
    metrics_tls_pk_pwd: StrictStr | None = F("metricsTlsPkPwd")
    metrics_tls_crl_path: StrictStr = F("metricsTlsCrlPath", "security/metrics/certs/")
    metrics_tls_crl_files: tuple[StrictStr, ...] = F("metricsTlsCrlFiles", ("server_crl.pem",))
    kmc_ksf_master: StrictStr = F("kmcKsfMaster", "tools/pmt/master/ksfa")
    kmc_ksf_standby: StrictStr = F("kmcKsfStandby", "tools/pmt/standby/ksfb")
    infer_mode: Literal["standard", "dmi"] = F("inferMode", "standard")
    # This daemon's keys (MindIE assigns roles only through POST /v1/role/...): a fixed PD
    # role for a static set-up, and the peers' addresses a decode instance may pull from.
    pd_role: Literal["prefill", "decode"] | None = F("pdRole", None, doc="dmi only; else POST /v1/role/...")
    pd_peers: tuple[StrictStr, ...] = F("pdPeers", (), doc="peer instances' IP addresses, "
                                        "each with its KV port as ip:port ([ipv6]:port) "
                                        "when it is not this instance's interCommPort")
    # The deployment's KV transfer key (64 hex digits in a file): a decode instance takes
    # only kv_transfer_params signed with it (server/pd/trust.py).  The coordinator also
    # hands its key over with the role; this file is for roles fixed in the config.
    pd_transfer_key_file: StrictStr | None = F("pdTransferKeyFile", None)
    # A prefill instance's exports waiting for D: at most this many, and this many MB
    # (a request past either bound is answered 503 before it is prefilled).
    pd_max_exports: StrictInt = F("pdMaxExports", 256, lo=1, hi=65536)
    pd_max_export_mb: StrictInt = F("pdMaxExportMb", 2048, lo=1, hi=1 << 20, doc="MB")
    inter_comm_tls_enabled: StrictBool = F("interCommTLSEnabled", True)
    inter_comm_port: StrictInt = F("interCommPort", 1121, lo=1024, hi=65535)
    inter_comm_tls_ca_path: StrictStr = F("interCommTlsCaPath", "security/grpc/ca/")
    inter_comm_tls_ca_files: tuple[StrictStr, ...] = F("interCommTlsCaFiles", ("ca.pem",))
    inter_comm_tls_cert: StrictStr = F("interCommTlsCert", "security/grpc/certs/server.pem")
    inter_comm_pk: StrictStr = F("interCommPk", "security/grpc/keys/server.key.pem")
    inter_comm_pk_pwd: StrictStr | None = F("interCommPkPwd")
    inter_comm_tls_crl_path: StrictStr = F("interCommTlsCrlPath", "security/grpc/certs/")
    inter_comm_tls_crl_files: tuple[StrictStr, ...] = F("interCommTlsCrlFiles", ("server_crl.pem",))
    open_ai_support: StrictStr = F("openAiSupport", "vllm")
    token_timeout: StrictInt = F("tokenTimeout", 600, lo=1, hi=3600, doc="seconds")
    e2e_timeout: StrictInt = F("e2eTimeout", 600, lo=1, hi=65535, doc="seconds")
    max_request_length: StrictInt = F("maxRequestLength", 40, lo=1, hi=100, doc="MB")
    # Not MindIE keys: how long a client may take to send a request's headers / its body.
    client_header_timeout: StrictInt = F("clientHeaderTimeout", 10, lo=1, hi=600, doc="seconds")
    client_body_timeout: StrictInt = F("clientBodyTimeout", 60, lo=1, hi=3600, doc="seconds")
    max_json_depth: StrictInt | None = F("maxJsonDepth", None, lo=1)
    dist_dp_server_enabled: StrictBool = F("distDPServerEnabled", False)
    layerwise_disaggregated: StrictBool = F("layerwiseDisaggregated", False)
    layerwise_disaggregated_role_type: StrictStr = F("layerwiseDisaggregatedRoleType", "")
    layerwise_disaggregated_master_ip_address: StrictStr | None = F("layerwiseDisaggregatedMasterIpAddress")
    layerwise_disaggregated_slave_ip_address: tuple[StrictStr, ...] = F("layerwiseDisaggregatedSlaveIpAddress", ())
    layerwise_disaggregated_data_port: StrictInt | None = F("layerwiseDisaggregatedDataPort")
    layerwise_disaggregated_crtl_port: tuple[StrictInt, ...] = F("layerwiseDisaggregatedCrtlPort", ())
    health_check: HealthCheckConfig = F("HealthCheckConfig", HealthCheckConfig())

    @field_validator("ip_address", "management_ip_address")
    @classmethod
    def _ips(cls, value: str | None) -> str | None:
        return value if value is None else _check_ip(value)

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for key in value:
            check_api_key(key)
        return value

    @property
    def effective_management_ip(self) -> str:
        """Bind IP of the management and metrics planes (MindIE: ipAddress when absent)."""
        return self.management_ip_address or self.ip_address
