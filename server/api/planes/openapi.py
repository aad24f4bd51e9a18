"""The business plane's OpenAPI document, built from the request models themselves.

The routes read their bodies by hand (``body.read_json``: size cap first, 400 not 422), so
FastAPI cannot see a body model; this document names them instead.  It is the contract a
fuzzer (schemathesis, tests/daemon/test_daemon_fuzz.py) checks: every body the schema
forbids is refused with a 4xx, and no body at all gets a 5xx.  Only the business plane
serves it: the management plane is not for API clients.
"""
from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from server.api.openai.protocol import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"


def _error(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}}


_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"],
                             "properties": {"message": {"type": "string"},
                                            "type": {"type": "string"},
                                            "param": {"type": ["string", "null"]},
                                            "code": {"type": "integer"}}}},
}


def _generate(model: str, description: str, auth: bool) -> dict:
    responses = {"200": {"description": description + " (JSON, or SSE with stream: true)"},
                 "400": _error("invalid request"), "404": _error("unknown model"),
                 "413": _error("body over maxRequestLength"),
                 "503": _error("over capacity (maxLinkNum) or stopping")}
    if auth:
        responses["401"] = _error("missing or wrong API key")
    return {"requestBody": {"required": True, "content": {
                "application/json": {"schema": {"$ref": _REF.format(model=model)}}}},
            "responses": responses}


def _get(description: str, auth: bool, extra: dict | None = None) -> dict:
    responses = {"200": {"description": description}, **(extra or {})}
    if auth:
        responses["401"] = _error("missing or wrong API key")
    return {"responses": responses}


def business_openapi(title: str, auth: bool) -> dict[str, Any]:
    """OpenAPI 3.1 for the business routes; ``auth``: an API key is configured (bearer)."""
    _, defs = models_json_schema(
        [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
        ref_template=_REF)
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = _ERROR_SCHEMA
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": {
            "/v1/chat/completions": {"post": _generate("ChatCompletionRequest",
                                                       "a chat completion", auth)},
            "/v1/completions": {"post": _generate("CompletionRequest", "a completion", auth)},
            "/v1/models": {"get": _get("the served model", auth)},
            "/v1/models/{model_id}": {"get": {
                **_get("the model card", auth, {"404": _error("unknown model")}),
                "parameters": [{"name": "model_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}]}},
            "/health": {"get": {"responses": {"200": {"description": "serving"},
                                              "503": {"description": "stopping"}}}},
        },
        "components": {"schemas": schemas},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in doc["paths"].items():
            if path != "/health":
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    return doc
