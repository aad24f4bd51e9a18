"""Prefill/decode disaggregation: roles, the KV transfer between instances, the coordinator."""
