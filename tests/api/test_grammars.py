"""The grammars the API layer builds (server/api/grammars.py), checked with llguidance
matchers on the demo tokenizer: what they accept and what they refuse."""
from __future__ import annotations

from pathlib import Path

import pytest

from server.api.openai.grammars import response_format_grammar, tool_call_grammar, validate
from server.api.openai.protocol import Tool
from server.engine.sample.grammar import GrammarBook
from server.web.errors import APIError
from server.text.special_tokens import (TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN,
                                        TOOL_CALLS_END, TOOL_SEP)
from server.text.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "models" / "deepseek-v3-tiny-mtp"
pytestmark = pytest.mark.demo          # its tokenizer
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {p: {"type": "string"}}, "required": [p]}}})
    for n, p in (("get_weather", "city"), ("GetTime", "tz"))]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO)


@pytest.fixture(scope="module")
def book():
    return GrammarBook(str(DEMO), 2048)


def accepts(book, tok, grammar: str, text: str) -> bool:
    ids = tok.encode(text)
    m = book.matcher(grammar, [])
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def v3(name: str, args: str) -> str:
    return (TOOL_CALL_BEGIN + "function" + TOOL_SEP + name + "\n```json\n" + args + "\n```"
            + TOOL_CALL_END)


def test_v3_required_allows_offered_names_with_schema_valid_arguments(book, tok):
    g = tool_call_grammar("deepseek_v3", TOOLS, None, True, tok.token_to_id).grammar
    ok = TOOLS_SECTION = TOOL_CALLS_BEGIN + v3("get_weather", '{"city": "Paris"}') + TOOL_CALLS_END
    assert accepts(book, tok, g, ok)
    assert accepts(book, tok, g, TOOL_CALLS_BEGIN + v3("get_weather", '{"city": "Paris"}') + "\n"
                   + v3("GetTime", '{"tz": "UTC"}') + TOOL_CALLS_END)
    assert not accepts(book, tok, g, TOOLS_SECTION.replace("get_weather", "search"))
    assert not accepts(book, tok, g, TOOLS_SECTION.replace('"city"', '"town"'))      # schema
    assert not accepts(book, tok, g, TOOLS_SECTION.replace('{"city": "Paris"}', '{"city": 3}'))
    assert not accepts(book, tok, g, "Sure! " + ok)                                 # a call at once
    one = tool_call_grammar("deepseek_v3", TOOLS, None, False, tok.token_to_id).grammar
    assert not accepts(book, tok, one, TOOL_CALLS_BEGIN + v3("get_weather", '{"city": "P"}') + "\n"
                       + v3("GetTime", '{"tz": "UTC"}') + TOOL_CALLS_END)    # parallel_tool_calls false


def test_named_choice_allows_only_that_function(book, tok):
    g = tool_call_grammar("deepseek_v3", TOOLS, "GetTime", True, tok.token_to_id).grammar
    assert accepts(book, tok, g, TOOL_CALLS_BEGIN + v3("GetTime", '{"tz": "CET"}') + TOOL_CALLS_END)
    assert not accepts(book, tok, g, TOOL_CALLS_BEGIN + v3("get_weather", '{"city": "P"}') + TOOL_CALLS_END)


def test_v31_syntax(book, tok):
    g = tool_call_grammar("deepseek_v31", TOOLS, None, True, tok.token_to_id).grammar
    call = TOOL_CALL_BEGIN + "GetTime" + TOOL_SEP + '{"tz": "UTC"}' + TOOL_CALL_END
    assert accepts(book, tok, g, TOOL_CALLS_BEGIN + call + TOOL_CALLS_END)
    assert not accepts(book, tok, g, TOOL_CALLS_BEGIN + v3("GetTime", '{"tz": "UTC"}') + TOOL_CALLS_END)


def test_json_schema_objects_are_closed_and_written_as_json_dumps(book, tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).grammar
    assert accepts(book, tok, g, '{"a": 1}')
    assert not accepts(book, tok, g, '{"a": 1, "b": 2}')      # no additionalProperties: closed
    assert not accepts(book, tok, g, '{"a":1}')               # json.dumps separators only
    obj = response_format_grammar({"type": "json_object"}).grammar
    assert accepts(book, tok, obj, '{"x": [1, 2], "y": {"z": null}}')
    assert not accepts(book, tok, obj, '[1, 2]')


def test_strict_refuses_a_keyword_it_cannot_enforce():
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    lenient = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    validate(lenient)                                          # ignored without strict
    strict = response_format_grammar({"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}})
    with pytest.raises(APIError) as e:
        validate(strict)
    assert e.value.status == 400 and "uniqueItems" in e.value.message
