"""Grammars for structured output: ``response_format`` and forced tool calls, as llguidance
grammar text (the engine applies it as a token mask: server/engine/sample/grammar.py).

* ``response_format`` ``json_object``: any JSON object; ``json_schema``: the given
  schema.  ``strict: true`` is honoured by compiling the schema with llguidance's
  non-lenient JSON compiler: a keyword it cannot enforce is a 400, so everything the
  schema says holds for the output.  Without ``strict`` unsupported keywords are ignored
  (the rest is still enforced).
* ``tool_choice`` ``auto``: free text, or text with one tool-call section whose names and
  arguments are constrained as below (a call can start any time; once it does, only
  offered names and schema-valid arguments can follow).
* ``tool_choice`` ``required`` / named: the tool-call section in the model's own syntax
  (DeepSeek V3 or V3.1, server/text/tool_calls.py) whose name part is one of the offered
  names (only the named one) and whose arguments follow that tool's ``parameters``
  schema; one call, or several when ``parallel_tool_calls`` (required only).  The fence
  of the V3 format is part of the grammar, so the server no longer writes it into the
  prompt for the model to repeat.

Objects that list ``properties`` get no other keys unless the schema allows them
(``_close_objects``).  JSON is written as ``json.dumps`` writes it (``", "`` and ``": "``, no other
whitespace): the model cannot stall in whitespace and the text is what DeepSeek models
emit.  A grammar's text is its cache key: the engine compiles each distinct grammar once.
"""
from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass
from typing import Any

from server.web.errors import bad_request
from server.text.special_tokens import (TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN,
                                        TOOL_CALLS_END, TOOL_SEP)

try:
    import llguidance
except ImportError:          # pragma: no cover - then every grammar request gets a 400
    llguidance = None

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_VALIDATED: dict[str, None] = {}          # grammar texts that passed validation (bounded)
_MAX_VALIDATED = 1024


@dataclass(frozen=True, slots=True)
class GrammarRequest:
    grammar: str            # llguidance grammar text (SamplingParams.grammar)
    param: str              # the request field it came from (for errors)


def _close_objects(node: Any) -> None:
    """An object schema that lists ``properties`` and says nothing about extra ones gets
    none (``additionalProperties: false``), as xgrammar's default strict mode and OpenAI's
    strict mode do: otherwise a model can wander off into invented keys that no client
    expects (Pydantic's schemas, e.g. LangChain's, never say)."""
    if isinstance(node, list):
        for item in node:
            _close_objects(item)
        return
    if not isinstance(node, dict):
        return
    if "properties" in node and not {"additionalProperties", "patternProperties",
                                     "unevaluatedProperties"} & node.keys():
        node["additionalProperties"] = False
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions", "dependentSchemas"):
            if isinstance(value, dict):
                for sub in value.values():
                    _close_objects(sub)
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not",
                     "additionalProperties", "contains", "then", "else", "if"):
            _close_objects(value)


def _schema(schema: Any, strict: bool, param: str) -> dict:
    if isinstance(schema, bool):              # JSON Schema allows true/false
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise bad_request("the JSON schema must be an object", param)
    out = copy.deepcopy(schema)
    _close_objects(out)
    guidance = dict(out.get("x-guidance") or {})
    guidance.update(_JSON_STYLE, lenient=not strict)
    out["x-guidance"] = guidance
    return out


def response_format_grammar(rf: dict | None) -> GrammarRequest | None:
    """The grammar of ``response_format`` (None for text or absent)."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema = _schema({"type": "object"}, True, "response_format")
    elif kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format json_schema needs json_schema.schema",
                              "response_format.json_schema")
        schema = _schema(spec["schema"], bool(spec.get("strict")), "response_format.json_schema")
    elif kind == "structural_tag":
        raise bad_request("response_format type 'structural_tag' is not supported; allowed: "
                          "'text', 'json_object', 'json_schema'", "response_format")
    else:
        raise bad_request(f"response_format type {kind!r} is unknown; allowed: 'text', "
                          "'json_object', 'json_schema'", "response_format")
    _need_llguidance("response_format")
    return GrammarRequest(llguidance.LLMatcher.grammar_from_json_schema(schema), "response_format")


def _call_rules(fmt: str, tools: list[Any], named: str | None, token_id) -> tuple[dict, list[str]]:
    """Marker references by token id (text cannot spell them) and the rules ``call``,
    ``callN`` and ``argsN``: one alternative per offered tool (only ``named``'s)."""
    _need_llguidance("tool_choice")
    ids = {}
    for name, text in (("calls_begin", TOOL_CALLS_BEGIN), ("call_begin", TOOL_CALL_BEGIN),
                       ("sep", TOOL_SEP), ("call_end", TOOL_CALL_END), ("calls_end", TOOL_CALLS_END)):
        tid = token_id(text)
        if tid is None:
            raise bad_request(f"tool calls need the tokenizer's {text} token, which this "
                              "model's vocabulary lacks", "tool_choice")
        ids[name] = f"<[{tid}]>"
    rules = []
    alts = []
    for i, tool in enumerate(t for t in tools if named is None or t.function.name == named):
        fn = tool.function
        strict = bool((fn.model_extra or {}).get("strict"))
        schema = _schema(fn.parameters if fn.parameters is not None else {"type": "object"},
                         strict, "tools")
        name = json.dumps(fn.name)
        if fmt == "deepseek_v31":
            body = f'{name} {ids["sep"]} args{i} {ids["call_end"]}'
        else:
            body = f'"function" {ids["sep"]} {name} "\\n```json\\n" args{i} "\\n```" {ids["call_end"]}'
        rules.append(f"call{i}: {ids['call_begin']} {body}")
        rules.append(f"args{i}: %json {json.dumps(schema)}")
        alts.append(f"call{i}")
    return ids, ["call: " + " | ".join(alts), *rules]


def tool_call_grammar(fmt: str, tools: list[Any], named: str | None, parallel: bool,
                      token_id) -> GrammarRequest:
    """The tool-call section for ``tool_choice`` required (``named`` None) or named.

    ``tools``: the request's Tool models; ``token_id(text)``: a special token's id.
    """
    ids, rules = _call_rules(fmt, tools, named, token_id)
    more = '("\\n" call)* ' if named is None and parallel else ""
    start = f'start: {ids["calls_begin"]} call {more}{ids["calls_end"]}'
    lark = "\n".join([start, *rules]) + "\n"
    return GrammarRequest(llguidance.LLMatcher.grammar_from_lark(lark), "tool_choice")


def auto_tool_grammar(fmt: str, tools: list[Any], parallel: bool, token_id,
                      text_markers: list[str]) -> GrammarRequest:
    """``tool_choice`` auto: any text (``text_markers``, e.g. ``<think>``, may appear in it
    as the tokens they are), and at most one tool-call section, whose names and arguments
    are constrained as for ``required``; text may follow the section."""
    ids, rules = _call_rules(fmt, tools, None, token_id)
    marks = [f"<[{t}]>" for t in (token_id(m) for m in text_markers) if t is not None]
    more = '("\\n" call)* ' if parallel else ""
    lark = "\n".join([
        "start: free? section?",
        "free: (" + " | ".join(["TEXT", *marks]) + ")+",
        "TEXT: /(?s:.+)/",
        f'section: {ids["calls_begin"]} call {more}{ids["calls_end"]} free?', *rules]) + "\n"
    return GrammarRequest(llguidance.LLMatcher.grammar_from_lark(lark), "tools")


def _need_llguidance(param: str) -> None:
    if llguidance is None:
        raise bad_request(f"{param} needs structured output, which needs the llguidance "
                          "package (not installed)", param)


def validate(g: GrammarRequest) -> None:
    """400 for a grammar llguidance refuses (an invalid schema, or under ``strict`` a
    keyword it cannot enforce).  Validated texts are remembered."""
    if g.grammar in _VALIDATED:
        return
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(g.grammar)
    if is_error:
        raise bad_request(f"{g.param}: the schema cannot be enforced: {messages[0]}", g.param)
    if len(_VALIDATED) >= _MAX_VALIDATED:
        _VALIDATED.pop(next(iter(_VALIDATED)))
    _VALIDATED[g.grammar] = None


async def prepare_grammar(engine, g: GrammarRequest, release) -> None:
    """Validate ``g`` and have the engine compile it, both on threads, before submitting
    (the engine thread then only copies a compiled matcher).  A refusal frees the
    request's admission slots (``release``) and is a 400."""
    from server.engine.sample.grammar import GrammarError
    try:
        await asyncio.to_thread(validate, g)
        await engine.prepare_grammar(g.grammar)
    except GrammarError as exc:
        release()
        raise bad_request(f"{g.param}: {exc}", g.param) from None
    except BaseException:
        release()
        raise
