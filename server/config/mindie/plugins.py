"""``ModelConfig[i].plugin_params``: MindIE's feature-plugin switch, parsed once into a typed object.

MindIE stores it as a JSON *string* (``"{\\"plugin_type\\":\\"mtp\\",\\"num_speculative_tokens\\":1}"``);
its C++ loader also accepts an object and dumps it to a string.  We take either form, check
the 1024-character limit on the compact dump, and hand the engine a ``PluginParams`` whose
``mtp`` / ``prefix_cache`` ... answer the questions it has.  The raw string goes no further.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_serializer, field_validator
from pydantic_core import PydanticCustomError

# MindIE's order in its "Unsupported plugin type" message.
SUPPORTED_PLUGIN_TYPES: tuple[str, ...] = ("la", "memory_decoding", "prefix_cache", "mtp", "splitfuse")
MAX_PLUGIN_PARAMS_CHARS = 1024
MAX_SPECULATIVE_TOKENS = 5


@dataclass(frozen=True, slots=True)
class MtpSettings:
    """MTP is on and drafts up to ``num_speculative_tokens`` (>= 1) tokens per decode step.

    ``adaptive_speculation`` (our extension, default on) lets the engine draft fewer
    tokens, down to none, in steps where drafting does not pay; outputs are unchanged.
    """
    num_speculative_tokens: int
    adaptive_speculation: bool = True


def compact_json(value: Any) -> str:
    """How MindIE's loader serialises an object-form plugin_params (nlohmann ``dump()``)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def decode_plugin_params(value: Any) -> Any:
    """String or object -> dict; enforces JSON syntax and the 1024-character limit."""
    if value is None:
        return {}                                   # "plugin_params": null = no plugins
    if isinstance(value, BaseModel):
        return value
    text = value if isinstance(value, str) else compact_json(value)
    if len(text) > MAX_PLUGIN_PARAMS_CHARS:
        raise PydanticCustomError(
            "plugin_params_length",
            "plugin_params is {length} characters long",
            {"length": len(text), "allowed": f"at most {MAX_PLUGIN_PARAMS_CHARS} characters"})
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise PydanticCustomError(
                "plugin_params_json",
                "The 'plugin_params' field does not conform to JSON format: {reason}",
                {"reason": str(exc), "allowed": "a JSON object (as a string or an object)"}) from None
    if not isinstance(value, dict):
        raise PydanticCustomError(
            "plugin_params_type", "plugin_params must be a JSON object",
            {"allowed": "a JSON object (as a string or an object)"})
    return value


class PluginParams(BaseModel):
    """Parsed plugin_params.  Keys we do not know are kept (and warned about by the loader)."""
    model_config = ConfigDict(frozen=True, extra="allow")

    plugin_type: tuple[str, ...] = Field(
        (), description="Enabled plugins; comma list in MindIE's text form.")
    num_speculative_tokens: StrictInt | None = Field(
        None, ge=0, le=MAX_SPECULATIVE_TOKENS,
        description="MTP draft tokens per step; 0 keeps the MTP layer unused.")
    adaptive_speculation: StrictBool | None = Field(
        None, description="Our extension: pick k in 0..num_speculative_tokens per step "
                          "from measured cost and acceptance (default true).")
    level: StrictInt | None = Field(None, description="Lookahead (la) setting; kept, not used.")
    window: StrictInt | None = Field(None, description="Lookahead (la) setting; kept, not used.")
    guess_set_size: StrictInt | None = Field(None, description="Lookahead (la) setting; kept, not used.")
    decoding_length: StrictInt | None = Field(None, description="memory_decoding setting; kept, not used.")

    @field_validator("plugin_type", mode="before")
    @classmethod
    def _split_types(cls, value: Any) -> tuple[str, ...]:
        # MindIE splits on the regex ",\s*"; we also strip stray spaces before commas.
        if isinstance(value, str):
            parts = [p.strip() for p in re.split(r",\s*", value)] if value.strip() else []
        elif isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
            parts = [p.strip() for p in value]
        else:
            raise PydanticCustomError(
                "plugin_type_type", "plugin_type must be a comma-separated string",
                {"allowed": "comma list of " + ", ".join(SUPPORTED_PLUGIN_TYPES)})
        unknown = [p for p in parts if p not in SUPPORTED_PLUGIN_TYPES]
        if unknown:
            raise PydanticCustomError(
                "plugin_type_unknown",
                "Unsupported plugin type: {unknown}; only {supported} are supported",
                {"unknown": ", ".join(repr(u) for u in unknown),
                 "supported": ", ".join(SUPPORTED_PLUGIN_TYPES),
                 "allowed": "comma list of " + ", ".join(SUPPORTED_PLUGIN_TYPES)})
        return tuple(dict.fromkeys(parts))          # de-duplicated, order kept

    @field_serializer("plugin_type")
    def _join_types(self, value: tuple[str, ...]) -> str:
        return ",".join(value)

    def has(self, plugin: str) -> bool:
        return plugin in self.plugin_type

    @property
    def mtp(self) -> MtpSettings | None:
        """MTP settings, or None when MTP is off or ``num_speculative_tokens`` is 0."""
        if not self.has("mtp") or not self.num_speculative_tokens:
            return None
        return MtpSettings(self.num_speculative_tokens,
                           adaptive_speculation=self.adaptive_speculation is not False)

    @property
    def prefix_cache(self) -> bool:
        return self.has("prefix_cache")

    @property
    def splitfuse(self) -> bool:
        return self.has("splitfuse")

    @property
    def parallel_decoding(self) -> tuple[str, ...]:
        """Enabled parallel-decoding plugins (lookahead ``la``, ``memory_decoding``)."""
        return tuple(p for p in self.plugin_type if p in ("la", "memory_decoding"))

    def to_json(self) -> dict[str, Any]:
        """Object form without unset fields: what ``--check`` prints."""
        return self.model_dump(exclude_none=True)
